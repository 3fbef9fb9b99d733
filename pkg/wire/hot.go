package wire

import (
	"errors"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
)

// The four messages of the hot path (Offload, Reload and their replies) are
// encoded and decoded here by hand, and so are the small ones of the calls
// an engine makes per request (Stream, Request and the replies of
// is_offloaded, remove_request and num_pages). The bytes are exactly protobuf's: the
// generated code and any other protobuf library read and write them; only
// the Go code is faster. Measured on the dev machine (BenchmarkCodec*, a
// 64-page offload): protobuf-go took about 0.85 µs to encode and 0.6-1.1 µs
// with 3 allocations to decode, some 3.5 µs of CPU per call across both
// ends, against a bare socket round trip of 7-25 µs; by hand each is about
// 0.35 µs with no allocation (page slices keep their capacity, repeated
// request IDs and labels are not copied again). FuzzHotCodec checks the hand
// code against protobuf-go byte for byte.
//
// The encoders were measured again against protobuf-go's MarshalAppend into
// a reused buffer, where protobuf-go does not allocate either
// (BenchmarkHotEncode, docs/benchmarks.md, 2026-12-01): by the encoding
// thread's CPU time the hand code takes 0.67-0.69 of protobuf-go's, 262-294
// ns against 386-427 ns for a 64-page message, so they stay.

var errBadUTF8 = errors.New("string field is not valid UTF-8")

func appendString(b []byte, num protowire.Number, s string) []byte {
	if s == "" {
		return b
	}
	b = protowire.AppendTag(b, num, protowire.BytesType)
	return protowire.AppendString(b, s)
}

func appendVarintField(b []byte, num protowire.Number, v uint64) []byte {
	if v == 0 {
		return b
	}
	b = protowire.AppendTag(b, num, protowire.VarintType)
	return protowire.AppendVarint(b, v)
}

func appendPacked(b []byte, num protowire.Number, vs []int32) []byte {
	if len(vs) == 0 {
		return b
	}
	n := 0
	for _, v := range vs {
		n += protowire.SizeVarint(uint64(int64(v)))
	}
	b = protowire.AppendTag(b, num, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(n))
	for _, v := range vs {
		b = protowire.AppendVarint(b, uint64(int64(v)))
	}
	return b
}

func appendOffload(b []byte, m *Offload) []byte {
	b = appendString(b, 1, m.Rid)
	b = appendString(b, 2, m.Label)
	b = appendPacked(b, 3, m.GpuPages)
	b = appendVarintField(b, 4, uint64(m.StoredLen))
	b = appendVarintField(b, 5, uint64(m.Position))
	return appendVarintField(b, 6, uint64(m.Released))
}

func appendReload(b []byte, m *Reload) []byte {
	b = appendString(b, 1, m.Rid)
	b = appendString(b, 2, m.Label)
	return appendPacked(b, 3, m.GpuPages)
}

func appendOffloadReply(b []byte, m *OffloadReply) []byte {
	if m.Ok {
		b = appendVarintField(b, 1, 1)
	}
	b = appendPacked(b, 2, m.HostPages)
	return appendVarintField(b, 3, uint64(m.Total))
}

func appendReloadReply(b []byte, m *ReloadReply) []byte {
	b = appendPacked(b, 1, m.HostPages)
	b = appendVarintField(b, 2, uint64(m.StoredLen))
	b = appendVarintField(b, 3, uint64(m.Position))
	b = appendVarintField(b, 4, uint64(m.Released))
	b = appendVarintField(b, 5, m.Ticket)
	return appendVarintField(b, 6, uint64(m.Total))
}

// The small messages: one or two fields each. By hand, with the bodies
// reused, an is_offloaded round trip on one CPU took 0.7-1.1 µs less at p50
// than through protobuf-go (latbench, docs/benchmarks.md).

func appendStream(b []byte, m *Stream) []byte {
	b = appendString(b, 1, m.Rid)
	return appendString(b, 2, m.Label)
}

func appendBool(b []byte, num protowire.Number, v bool) []byte {
	if v {
		b = appendVarintField(b, num, 1)
	}
	return b
}

func decodeStream(b []byte, m *Stream) error {
	rid, label := m.Rid, m.Label
	m.Reset()
	return decodeStrings(b, rid, label, &m.Rid, &m.Label)
}

func decodeRequest(b []byte, m *Request) error {
	rid := m.Rid
	m.Reset()
	return decodeStrings(b, rid, "", &m.Rid, nil)
}

// decodeStrings decodes a message whose fields 1 and 2 are strings (f2 nil:
// only field 1), reusing old1 and old2 when equal.
func decodeStrings(b []byte, old1, old2 string, f1, f2 *string) error {
	for len(b) > 0 {
		f, rest, err := nextField(b)
		if err != nil {
			return err
		}
		b = rest
		switch {
		case f.num == 1 && f.typ == protowire.BytesType:
			*f1, err = f.str(old1)
		case f.num == 2 && f2 != nil && f.typ == protowire.BytesType:
			*f2, err = f.str(old2)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// decodeVarint1 decodes a message whose only field is varint field 1; the
// last occurrence wins, as in protobuf.
func decodeVarint1(b []byte) (uint64, error) {
	var v uint64
	for len(b) > 0 {
		f, rest, err := nextField(b)
		if err != nil {
			return 0, err
		}
		b = rest
		if f.num == 1 && f.typ == protowire.VarintType {
			v = f.v
		}
	}
	return v, nil
}

// field is one decoded field: its number and, by wire type, its varint
// value or its bytes.
type field struct {
	num   protowire.Number
	typ   protowire.Type
	v     uint64
	bytes []byte
}

// nextField consumes one field of b. Fields of wire types other than varint
// and length-delimited are skipped (and reported with typ set), as protobuf
// treats a known field of the wrong type as unknown.
func nextField(b []byte) (field, []byte, error) {
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 {
		return field{}, nil, protowire.ParseError(n)
	}
	if num > protowire.MaxValidNumber {
		return field{}, nil, errors.New("field number out of range")
	}
	b = b[n:]
	f := field{num: num, typ: typ}
	switch typ {
	case protowire.VarintType:
		f.v, n = protowire.ConsumeVarint(b)
	case protowire.BytesType:
		f.bytes, n = protowire.ConsumeBytes(b)
	default:
		n = protowire.ConsumeFieldValue(num, typ, b)
	}
	if n < 0 {
		return field{}, nil, protowire.ParseError(n)
	}
	return f, b[n:], nil
}

// str returns f's bytes as a string, reusing old when equal (no
// allocation when a client repeats its request IDs and labels).
func (f field) str(old string) (string, error) {
	if !utf8.Valid(f.bytes) {
		return "", errBadUTF8
	}
	if string(f.bytes) == old {
		return old, nil
	}
	return string(f.bytes), nil
}

// int32s appends the values of a repeated int32 field, packed or not.
func (f field) int32s(dst []int32) ([]int32, error) {
	if f.typ == protowire.VarintType {
		return append(dst, int32(f.v)), nil
	}
	b := f.bytes
	for len(b) > 0 {
		v, n := protowire.ConsumeVarint(b)
		if n < 0 {
			return dst, protowire.ParseError(n)
		}
		dst = append(dst, int32(v))
		b = b[n:]
	}
	return dst, nil
}

func decodeOffload(b []byte, m *Offload) error {
	rid, label, pages := m.Rid, m.Label, m.GpuPages[:0]
	m.Reset()
	m.GpuPages = pages
	for len(b) > 0 {
		f, rest, err := nextField(b)
		if err != nil {
			return err
		}
		b = rest
		switch {
		case f.num == 1 && f.typ == protowire.BytesType:
			m.Rid, err = f.str(rid)
		case f.num == 2 && f.typ == protowire.BytesType:
			m.Label, err = f.str(label)
		case f.num == 3 && (f.typ == protowire.BytesType || f.typ == protowire.VarintType):
			m.GpuPages, err = f.int32s(m.GpuPages)
		case f.num == 4 && f.typ == protowire.VarintType:
			m.StoredLen = int64(f.v)
		case f.num == 5 && f.typ == protowire.VarintType:
			m.Position = int64(f.v)
		case f.num == 6 && f.typ == protowire.VarintType:
			m.Released = int64(f.v)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func decodeReload(b []byte, m *Reload) error {
	rid, label, pages := m.Rid, m.Label, m.GpuPages[:0]
	m.Reset()
	m.GpuPages = pages
	for len(b) > 0 {
		f, rest, err := nextField(b)
		if err != nil {
			return err
		}
		b = rest
		switch {
		case f.num == 1 && f.typ == protowire.BytesType:
			m.Rid, err = f.str(rid)
		case f.num == 2 && f.typ == protowire.BytesType:
			m.Label, err = f.str(label)
		case f.num == 3 && (f.typ == protowire.BytesType || f.typ == protowire.VarintType):
			m.GpuPages, err = f.int32s(m.GpuPages)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func decodeOffloadReply(b []byte, m *OffloadReply) error {
	pages := m.HostPages[:0]
	m.Reset()
	m.HostPages = pages
	for len(b) > 0 {
		f, rest, err := nextField(b)
		if err != nil {
			return err
		}
		b = rest
		switch {
		case f.num == 1 && f.typ == protowire.VarintType:
			m.Ok = f.v != 0
		case f.num == 2 && (f.typ == protowire.BytesType || f.typ == protowire.VarintType):
			m.HostPages, err = f.int32s(m.HostPages)
		case f.num == 3 && f.typ == protowire.VarintType:
			m.Total = uint32(f.v)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func decodeReloadReply(b []byte, m *ReloadReply) error {
	pages := m.HostPages[:0]
	m.Reset()
	m.HostPages = pages
	for len(b) > 0 {
		f, rest, err := nextField(b)
		if err != nil {
			return err
		}
		b = rest
		switch {
		case f.num == 1 && (f.typ == protowire.BytesType || f.typ == protowire.VarintType):
			m.HostPages, err = f.int32s(m.HostPages)
		case f.num == 2 && f.typ == protowire.VarintType:
			m.StoredLen = int64(f.v)
		case f.num == 3 && f.typ == protowire.VarintType:
			m.Position = int64(f.v)
		case f.num == 4 && f.typ == protowire.VarintType:
			m.Released = int64(f.v)
		case f.num == 5 && f.typ == protowire.VarintType:
			m.Ticket = f.v
		case f.num == 6 && f.typ == protowire.VarintType:
			m.Total = uint32(f.v)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// decodePages appends to m.GpuPages (keeping its capacity), so that a server
// reusing one Pages message does not allocate per packet.
func decodePages(b []byte, m *Pages) error {
	pages := m.GpuPages[:0]
	m.Reset()
	m.GpuPages = pages
	for len(b) > 0 {
		f, rest, err := nextField(b)
		if err != nil {
			return err
		}
		b = rest
		if f.num == 1 && (f.typ == protowire.BytesType || f.typ == protowire.VarintType) {
			if m.GpuPages, err = f.int32s(m.GpuPages); err != nil {
				return err
			}
		}
	}
	return nil
}
