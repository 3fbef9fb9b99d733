package report

import (
	"errors"
	"sync"
	"time"

	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/poolerr"
	"github.com/kvpool/kvpool/pkg/wire"
)

// Kinder is implemented by errors that name their own kind (for example the
// server's protocol errors). Kind must return a short, stable, snake_case word.
type Kinder interface {
	Kind() string
}

// agentKinds names the pool errors that never reach a client, so have no
// status of their own: the device plugin's and the agent's (grants,
// revokes, renewals) and the full-pool refusal (an offload answered
// ok=false). Every other pool error's kind is its status's (wire's table,
// through wire.StatusOf).
var agentKinds = []struct {
	err  error
	kind string
}{
	{poolerr.ErrFull, "full"},
	{poolerr.ErrUnknownChunk, "unknown_chunk"},
	{poolerr.ErrDuplicateChunk, "duplicate_chunk"},
	{poolerr.ErrChunkBusy, "chunk_busy"},
	{poolerr.ErrChunkDirty, "chunk_dirty"},
	{poolerr.ErrAllocationExists, "allocation_exists"},
}

// Kind classifies err for metrics labels and the error ring (both call it,
// so one failure has one kind in both): "" for nil; the error's own Kind
// when it has one (the server's *RequestError: its status's kind; the
// device plugin's *AllocateError: its result); for a pool error, the kind
// of the status a client gets for it (wire.StatusOf, wire.Status.Kind) or
// one of agentKinds; else "other".
func Kind(err error) string {
	if err == nil {
		return ""
	}
	var k Kinder
	if errors.As(err, &k) {
		return k.Kind()
	}
	for _, ak := range agentKinds {
		if errors.Is(err, ak.err) {
			return ak.kind
		}
	}
	if st := wire.StatusOf(err); st != wire.StatusInternal {
		return st.Kind()
	}
	return "other"
}

// Rejected reports whether err is the seed API's "offload returned False"
// (the pool is full, or full until a pending reload is fenced): normal flow
// control, counted but not logged as an error.
func Rejected(err error) bool {
	return errors.Is(err, poolerr.ErrFull) || errors.Is(err, poolerr.ErrPending)
}

// Entry is one recorded error.
type Entry struct {
	Time      time.Time `json:"time"`
	Component string    `json:"component"` // "server", "plugin", "sizing", ...
	Op        string    `json:"op,omitempty"`
	Kind      string    `json:"kind"`
	Session   string    `json:"session,omitempty"`
	// Allocation is the pool allocation the failed call was for (never a
	// token).
	Allocation string `json:"allocation,omitempty"`
	// Message is the error's text; for a socket call, exactly the message
	// the client got.
	Message string `json:"message"`
}

// Ring keeps the most recent errors, a bounded number of them. The zero
// value is not usable; call NewRing.
type Ring struct {
	mu    sync.Mutex
	buf   []Entry
	next  int
	total uint64
	now   func() time.Time
}

// NewRing returns a ring that keeps the last n entries (n < 1 keeps one).
func NewRing(n int) *Ring {
	return &Ring{buf: make([]Entry, 0, max(n, 1)), now: time.Now}
}

// Add records e; a zero Time is set to now and an empty Kind to "other".
func (r *Ring) Add(e Entry) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e.Time.IsZero() {
		e.Time = r.now()
	}
	if e.Kind == "" {
		e.Kind = "other"
	}
	r.total++
	if len(r.buf) < cap(r.buf) {
		r.buf = append(r.buf, e)
		return
	}
	r.buf[r.next] = e
	r.next = (r.next + 1) % len(r.buf)
}

// Error records err from component; nil is ignored.
func (r *Ring) Error(component string, err error) {
	if err == nil {
		return
	}
	r.Add(Entry{Component: component, Kind: Kind(err), Message: err.Error()})
}

// Op records a failed operation, so a Ring can be one of the observers of
// the server and the device plugin. Successes and full-pool rejects are not
// errors and are skipped.
func (r *Ring) Op(op observe.Op) {
	if op.Err == nil || Rejected(op.Err) {
		return
	}
	r.Add(Entry{Component: Component(op), Op: op.Name, Kind: Kind(op.Err), Session: op.Session,
		Allocation: op.Allocation, Message: op.Err.Error()})
}

// Component is op's component: observe.ComponentServer when it names none.
func Component(op observe.Op) string {
	if op.Component == "" {
		return observe.ComponentServer
	}
	return op.Component
}

// Entries returns the kept entries, oldest first.
func (r *Ring) Entries() []Entry {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Entry, 0, len(r.buf))
	out = append(out, r.buf[r.next:]...)
	return append(out, r.buf[:r.next]...)
}

// Total is the number of entries ever added, kept or not.
func (r *Ring) Total() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.total
}
