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
	// MaxFDs is the most file descriptors one packet may carry.
	MaxFDs = 1024
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
)

var opNames = [...]string{
	OpHello: "hello", OpOpen: "open", OpOffload: "offload", OpReload: "reload",
	OpDiscard: "discard", OpRemoveRequest: "remove_request", OpIsOffloaded: "is_offloaded",
	OpLabels: "labels", OpNumPages: "num_pages", OpUsage: "usage", OpFence: "fence", OpClose: "close",
	OpPages: "pages", OpMore: "more",
}

func (o Op) String() string {
	if int(o) < len(opNames) && opNames[o] != "" {
		return opNames[o]
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// Valid reports whether o is an operation of this version.
func (o Op) Valid() bool { return o >= OpHello && o <= OpMore }

// Status is the outcome of a request, carried in the reply's header. Every
// status but StatusOK comes with an Error body.
type Status uint8

const (
	StatusOK              Status = 0
	StatusBadRequest      Status = 1  // malformed body or header
	StatusUnknownOp       Status = 2  // op not known to this version
	StatusVersion         Status = 3  // no common version, or hello missing
	StatusUnauthorized    Status = 4  // unknown or revoked allocation token
	StatusNoSession       Status = 5  // pool op before a successful open
	StatusBusy            Status = 6  // another live client holds this allocation's GPU
	StatusPending         Status = 7  // offload fits once the reload in Error.ticket is fenced
	StatusUnknownStream   Status = 8  // no such (rid, label)
	StatusDuplicateStream Status = 9  // (rid, label) already offloaded
	StatusPageCount       Status = 10 // wrong number of device pages
	StatusOutOfRange      Status = 11 // device page index outside [0, device pages)
	StatusDuplicateIndex  Status = 12 // device page named twice
	StatusBadSize         Status = 13 // bad layout, negative metadata, ...
	StatusBadName         Status = 14 // empty or over-long rid, over-long label
	StatusBadFence        Status = 15 // fence names a ticket never issued
	StatusClosed          Status = 16 // the session ended (allocation revoked, or replaced)
	StatusNoCapacity      Status = 17 // the allocation cannot hold the session
	StatusUnexpectedFDs   Status = 18 // a request carried file descriptors
	StatusInternal        Status = 19
	StatusUnknownGPU      Status = 20 // Open names a GPU that is not in the node's plan
	StatusNoGPUChunks     Status = 21 // the allocation holds no chunk of the session's GPU
)

// Statuses 23 to 27 are the tenant bounds' (docs/security.md).
const (
	// StatusLimit: a per-tenant bound refused the request (connections,
	// sessions, streams, name bytes, layout size, client name); the
	// Error message names the bound and its value.
	StatusLimit Status = 23

	// StatusUnavailable: the agent is starting or restoring its books
	// after a restart; nothing was done; retry the same request shortly.
	// Distinct from StatusUnauthorized, which means the allocation is gone.
	StatusUnavailable Status = 28
)

// statusTable is the one table of statuses: each code's name (what
// Status.String and the clients' error messages say) and its kind (a
// snake_case word: the "kind" label of the agent's metrics, the kind column
// of its error ring). Every other table of failures (the server's pool
// errors, the clients' errors, the agent's error kinds) is derived from it.
var statusTable = [...]struct{ name, kind string }{
	StatusOK:              {"ok", "ok"},
	StatusBadRequest:      {"bad request", "bad_request"},
	StatusUnknownOp:       {"unknown op", "unknown_op"},
	StatusVersion:         {"version", "version"},
	StatusUnauthorized:    {"unauthorized", "unauthorized"},
	StatusNoSession:       {"no session", "no_session"},
	StatusBusy:            {"busy", "busy"},
	StatusPending:         {"pending", "pending"},
	StatusUnknownStream:   {"unknown stream", "unknown_stream"},
	StatusDuplicateStream: {"duplicate stream", "duplicate_stream"},
	StatusPageCount:       {"page count", "page_count"},
	StatusOutOfRange:      {"out of range", "out_of_range"},
	StatusDuplicateIndex:  {"duplicate index", "duplicate_index"},
	StatusBadSize:         {"bad size", "bad_size"},
	StatusBadName:         {"bad name", "bad_name"},
	StatusBadFence:        {"bad fence", "bad_fence"},
	StatusClosed:          {"closed", "closed"},
	StatusNoCapacity:      {"no capacity", "no_capacity"},
	StatusUnexpectedFDs:   {"unexpected fds", "unexpected_fds"},
	StatusInternal:        {"internal", "internal"},
	StatusUnknownGPU:      {"unknown gpu", "unknown_gpu"},
	StatusNoGPUChunks:     {"no chunks of this gpu", "no_gpu_chunks"},
	StatusLimit:           {"limit", "limit"},
	StatusUnavailable:     {"unavailable, retry", "unavailable"},
}

// Statuses lists every status of this version, in code order.
func Statuses() []Status {
	var out []Status
	for s, e := range statusTable {
		if e.kind != "" {
			out = append(out, Status(s))
		}
	}
	return out
}

func (s Status) String() string {
	if int(s) < len(statusTable) && statusTable[s].name != "" {
		return statusTable[s].name
	}
	return fmt.Sprintf("status(%d)", uint8(s))
}

// Kind is the status's stable snake_case name for metrics labels and error
// logs ("no capacity" -> "no_capacity"); "status_<n>" for a code this
// version does not know.
func (s Status) Kind() string {
	if int(s) < len(statusTable) && statusTable[s].kind != "" {
		return statusTable[s].kind
	}
	return fmt.Sprintf("status_%d", uint8(s))
}

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
	case OpUsage, OpFence, OpClose:
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
	case OpDiscard, OpFence, OpClose, OpPages:
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
