// Package wire is the kvpool copy API's wire format: the packet header, the
// operation and status codes, the message bodies (kvpool.proto) and a
// connection type that sends one packet per SOCK_SEQPACKET message with
// chunk file descriptors passed by SCM_RIGHTS.
//
// docs/protocol.md is the specification; this package is its Go reading.
package wire

//go:generate ../../hack/gen-proto.sh

import (
	"encoding/binary"
	"errors"
	"fmt"

	"google.golang.org/protobuf/proto"
)

// Version is the protocol version this package speaks. Version 2 names
// GPUs by UUID in Open and carries page lists and label lists of any length
// (OpPages, OpMore); a version 1 peer is refused at hello.
const Version = 2

const (
	// HeaderSize is the size of the fixed header at the start of every packet.
	HeaderSize = 16
	// MaxMessage is the largest packet, header included, either side sends or
	// accepts. A larger packet closes the connection.
	MaxMessage = 128 << 10
	// MaxFDs is the most file descriptors one packet may carry: Linux's
	// SCM_MAX_FD, the most one sendmsg passes. An open granting more
	// chunks sends the rest in the replies to OpMore.
	MaxFDs = 253
	// MaxPagesPerPacket is the most page indices one packet carries. At
	// the widest (5 bytes a page, 1 KiB names, every other field) such a
	// packet stays under MaxMessage; longer lists go in several packets
	// (OpPages before an offload or reload, OpMore after its reply).
	MaxPagesPerPacket = 24576
	// MaxLabelBytes bounds the encoded labels of one LabelsReply or
	// MoreReply; longer lists continue with OpMore.
	MaxLabelBytes = MaxMessage - HeaderSize - 64
)

// Op names an operation. A reply carries the op of its request.
type Op uint8

const (
	OpHello         Op = 1
	OpOpen          Op = 2
	OpOffload       Op = 3
	OpReload        Op = 4
	OpDiscard       Op = 5
	OpRemoveRequest Op = 6
	OpIsOffloaded   Op = 7
	OpLabels        Op = 8
	OpNumPages      Op = 9
	OpUsage         Op = 10
	OpFence         Op = 11
	OpClose         Op = 12
	OpPages         Op = 13 // the first device pages of a long offload or reload
	OpMore          Op = 14 // the rest of a long reply
	OpLane          Op = 15 // the session's packets move to a pair of pipes (Conn.UseLane)
)

var opNames = [...]string{
	OpHello: "hello", OpOpen: "open", OpOffload: "offload", OpReload: "reload",
	OpDiscard: "discard", OpRemoveRequest: "remove_request", OpIsOffloaded: "is_offloaded",
	OpLabels: "labels", OpNumPages: "num_pages", OpUsage: "usage", OpFence: "fence", OpClose: "close",
	OpPages: "pages", OpMore: "more", OpLane: "lane",
}

func (o Op) String() string {
	if int(o) < len(opNames) && opNames[o] != "" {
		return opNames[o]
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// Valid reports whether o is an operation of this version.
func (o Op) Valid() bool { return o >= OpHello && o <= OpLane }

// Header is the fixed part of every packet, little-endian on the wire:
//
//	offset 0  uint8  op
//	offset 1  uint8  status (requests: 0)
//	offset 2  uint16 reserved, zero
//	offset 4  uint32 seq, chosen by the client, echoed by the reply
//	offset 8  uint64 fence: requests confirm every reload ticket <= fence
//	                 (0: none); replies carry 0
type Header struct {
	Op     Op
	Status Status
	Seq    uint32
	Fence  uint64
}

// ErrMalformed wraps every decoding failure.
var ErrMalformed = errors.New("malformed packet")

// AppendHeader appends h's encoding to b.
func AppendHeader(b []byte, h Header) []byte {
	b = append(b, byte(h.Op), byte(h.Status), 0, 0)
	b = binary.LittleEndian.AppendUint32(b, h.Seq)
	return binary.LittleEndian.AppendUint64(b, h.Fence)
}

// ParseHeader splits a packet into its header and body.
func ParseHeader(pkt []byte) (Header, []byte, error) {
	if len(pkt) < HeaderSize {
		return Header{}, nil, fmt.Errorf("%w: %d bytes, the header alone is %d", ErrMalformed, len(pkt), HeaderSize)
	}
	if len(pkt) > MaxMessage {
		return Header{}, nil, fmt.Errorf("%w: %d bytes exceed the maximum of %d", ErrMalformed, len(pkt), MaxMessage)
	}
	if pkt[2] != 0 || pkt[3] != 0 {
		return Header{}, nil, fmt.Errorf("%w: reserved header bytes are %#x %#x, want zero", ErrMalformed, pkt[2], pkt[3])
	}
	h := Header{
		Op:     Op(pkt[0]),
		Status: Status(pkt[1]),
		Seq:    binary.LittleEndian.Uint32(pkt[4:]),
		Fence:  binary.LittleEndian.Uint64(pkt[8:]),
	}
	return h, pkt[HeaderSize:], nil
}

// NewRequest returns an empty request body for op: the message the server
// decodes the body into. OpFence and OpClose have empty bodies (an Empty
// message of no fields is not needed: nil is returned and the body must be
// empty).
func NewRequest(op Op) (proto.Message, error) {
	switch op {
	case OpHello:
		return new(Hello), nil
	case OpOpen:
		return new(Open), nil
	case OpOffload:
		return new(Offload), nil
	case OpReload:
		return new(Reload), nil
	case OpDiscard, OpNumPages:
		return new(Stream), nil
	case OpRemoveRequest, OpIsOffloaded, OpLabels:
		return new(Request), nil
	case OpPages:
		return new(Pages), nil
	case OpMore:
		return new(More), nil
	case OpUsage, OpFence, OpClose, OpLane:
		return nil, nil
	}
	return nil, fmt.Errorf("%w: unknown op %d", ErrMalformed, uint8(op))
}

// NewReply returns an empty reply body for op and status.
func NewReply(op Op, st Status) (proto.Message, error) {
	if st != StatusOK {
		return new(Error), nil
	}
	switch op {
	case OpHello:
		return new(HelloReply), nil
	case OpOpen:
		return new(OpenReply), nil
	case OpOffload:
		return new(OffloadReply), nil
	case OpReload:
		return new(ReloadReply), nil
	case OpRemoveRequest:
		return new(RemoveRequestReply), nil
	case OpIsOffloaded:
		return new(IsOffloadedReply), nil
	case OpLabels:
		return new(LabelsReply), nil
	case OpNumPages:
		return new(NumPagesReply), nil
	case OpUsage:
		return new(UsageReply), nil
	case OpMore:
		return new(MoreReply), nil
	case OpDiscard, OpFence, OpClose, OpPages, OpLane:
		return nil, nil
	}
	return nil, fmt.Errorf("%w: unknown op %d", ErrMalformed, uint8(op))
}

// DecodeBody decodes body into m (nil m: the body must be empty). The hot
// path's messages (Offload, Reload and their replies) keep the capacity of
// their page slices, so a decoder that reuses them does not allocate.
func DecodeBody(body []byte, m proto.Message) error {
	if m == nil {
		if len(body) != 0 {
			return fmt.Errorf("%w: %d body bytes where none are expected", ErrMalformed, len(body))
		}
		return nil
	}
	var err error
	switch x := m.(type) {
	case *Offload:
		err = decodeOffload(body, x)
	case *Reload:
		err = decodeReload(body, x)
	case *OffloadReply:
		err = decodeOffloadReply(body, x)
	case *ReloadReply:
		err = decodeReloadReply(body, x)
	case *Pages:
		err = decodePages(body, x)
	case *Stream:
		err = decodeStream(body, x)
	case *Request:
		err = decodeRequest(body, x)
	case *IsOffloadedReply:
		var v uint64
		v, err = decodeVarint1(body)
		x.Reset()
		x.Offloaded = v != 0
	case *RemoveRequestReply:
		var v uint64
		v, err = decodeVarint1(body)
		x.Reset()
		x.Removed = uint32(v)
	case *NumPagesReply:
		var v uint64
		v, err = decodeVarint1(body)
		x.Reset()
		x.Pages = uint32(v)
	default:
		err = proto.Unmarshal(body, m)
	}
	if err != nil {
		return fmt.Errorf("%w: %T: %v", ErrMalformed, m, err)
	}
	return nil
}

// AppendPacket appends a packet of header h and body m (nil: no body).
func AppendPacket(b []byte, h Header, m proto.Message) ([]byte, error) {
	b = AppendHeader(b, h)
	if m == nil {
		return b, nil
	}
	start := len(b)
	var err error
	switch x := m.(type) {
	case *Offload:
		b = appendOffload(b, x)
	case *Reload:
		b = appendReload(b, x)
	case *OffloadReply:
		b = appendOffloadReply(b, x)
	case *ReloadReply:
		b = appendReloadReply(b, x)
	case *Pages:
		b = appendPacked(b, 1, x.GpuPages)
	case *Stream:
		b = appendStream(b, x)
	case *Request:
		b = appendString(b, 1, x.Rid)
	case *IsOffloadedReply:
		b = appendBool(b, 1, x.Offloaded)
	case *RemoveRequestReply:
		b = appendVarintField(b, 1, uint64(x.Removed))
	case *NumPagesReply:
		b = appendVarintField(b, 1, uint64(x.Pages))
	default:
		b, err = (proto.MarshalOptions{}).MarshalAppend(b, m)
	}
	if err != nil {
		return b[:start], fmt.Errorf("wire: encode %T: %w", m, err)
	}
	if len(b) > MaxMessage {
		return b[:start], fmt.Errorf("wire: %s packet of %d bytes exceeds the maximum of %d", h.Op, len(b), MaxMessage)
	}
	return b, nil
}
