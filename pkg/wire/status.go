package wire

import (
	"errors"
	"fmt"

	"github.com/kvpool/kvpool/pkg/poolerr"
)

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
	StatusNoGPUChunks     Status = 21 // no longer sent: agents that bound only chunks sized under the session's GPU's name refused others with it
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
// Status.String and the clients' error messages say), its kind (a
// snake_case word: the "kind" label of the agent's metrics, the kind column
// of its error ring) and the error of pkg/poolerr it means, where it means
// one. StatusOf reads it from error to status (the agent), ErrorOf from
// status to error (the clients, the C ABI through them): one table, both
// directions, so no second table is kept inverse by hand.
var statusTable = [...]struct {
	name, kind string
	err        error
}{
	StatusOK:              {"ok", "ok", nil},
	StatusBadRequest:      {"bad request", "bad_request", nil},
	StatusUnknownOp:       {"unknown op", "unknown_op", nil},
	StatusVersion:         {"version", "version", nil},
	StatusUnauthorized:    {"unauthorized", "unauthorized", poolerr.ErrUnknownAllocation},
	StatusNoSession:       {"no session", "no_session", nil},
	StatusBusy:            {"busy", "busy", nil},
	StatusPending:         {"pending", "pending", poolerr.ErrPending},
	StatusUnknownStream:   {"unknown stream", "unknown_stream", poolerr.ErrUnknownStream},
	StatusDuplicateStream: {"duplicate stream", "duplicate_stream", poolerr.ErrDuplicateStream},
	StatusPageCount:       {"page count", "page_count", poolerr.ErrPageCount},
	StatusOutOfRange:      {"out of range", "out_of_range", poolerr.ErrOutOfRange},
	StatusDuplicateIndex:  {"duplicate index", "duplicate_index", poolerr.ErrDuplicateIndex},
	StatusBadSize:         {"bad size", "bad_size", poolerr.ErrBadSize},
	StatusBadName:         {"bad name", "bad_name", poolerr.ErrBadName},
	StatusBadFence:        {"bad fence", "bad_fence", poolerr.ErrBadFence},
	StatusClosed:          {"closed", "closed", poolerr.ErrClosed},
	StatusNoCapacity:      {"no capacity", "no_capacity", poolerr.ErrNoCapacity},
	StatusUnexpectedFDs:   {"unexpected fds", "unexpected_fds", nil},
	StatusInternal:        {"internal", "internal", nil},
	StatusUnknownGPU:      {"unknown gpu", "unknown_gpu", poolerr.ErrUnknownGPU},
	StatusNoGPUChunks:     {"no chunks of this gpu", "no_gpu_chunks", poolerr.ErrNoGPUChunks},
	StatusLimit:           {"limit", "limit", nil},
	StatusUnavailable:     {"unavailable, retry", "unavailable", poolerr.ErrNotReady},
}

// StatusOf is the status a client gets for err: the status whose error
// err is (errors.Is; a *pool.PendingError is StatusPending), else
// StatusInternal. The pool errors that never reach a client (a full pool,
// an offload of no pages: both an offload answered ok=false; the chunk and
// grant errors of the device plugin) are StatusInternal too.
func StatusOf(err error) Status {
	if err == nil {
		return StatusOK
	}
	for st, e := range statusTable {
		if e.err != nil && errors.Is(err, e.err) {
			return Status(st)
		}
	}
	return StatusInternal
}

// ErrUnknownStatus is what ErrorOf gives for a status code this version
// does not know (a newer agent's).
var ErrUnknownStatus = errors.New("status code unknown to this protocol version")

// ErrorOf is the error a reply with status st means: the pkg/poolerr error
// of the same meaning; nil for StatusOK and for the statuses that name no
// pool error (bad request, busy, limit, ...: the status and its message
// say it all); an error wrapping ErrUnknownStatus for a code this version
// does not know.
func ErrorOf(st Status) error {
	if int(st) >= len(statusTable) || statusTable[st].kind == "" {
		return fmt.Errorf("%w: %d", ErrUnknownStatus, uint8(st))
	}
	return statusTable[st].err
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
