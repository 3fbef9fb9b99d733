package status

import (
	"errors"
	"sync"
	"time"

	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/pool"
)

// Kinder is implemented by errors that name their own kind (for example the
// server's protocol errors). Kind must return a short, stable, snake_case word.
type Kinder interface {
	Kind() string
}

var poolKinds = []struct {
	err  error
	kind string
}{
	{pool.ErrFull, "full"},
	{pool.ErrPending, "pending"},
	{pool.ErrUnknownStream, "unknown_stream"},
	{pool.ErrDuplicateStream, "duplicate_stream"},
	{pool.ErrPageCount, "page_count"},
	{pool.ErrBadSize, "bad_size"},
	{pool.ErrOutOfRange, "out_of_range"},
	{pool.ErrDuplicateIndex, "duplicate_index"},
	{pool.ErrBadFence, "bad_fence"},
	{pool.ErrClosed, "closed"},
	{pool.ErrBadName, "bad_name"},
	{pool.ErrUnknownChunk, "unknown_chunk"},
	{pool.ErrDuplicateChunk, "duplicate_chunk"},
	{pool.ErrChunkBusy, "chunk_busy"},
	{pool.ErrChunkDirty, "chunk_dirty"},
	{pool.ErrUnknownAllocation, "unknown_allocation"},
	{pool.ErrAllocationExists, "allocation_exists"},
	{pool.ErrNoCapacity, "no_capacity"},
}

// Kind classifies err for metrics labels and the error log: "" for nil, the
// error's own Kind when it has one, the pool error it wraps, or "other".
func Kind(err error) string {
	if err == nil {
		return ""
	}
	var k Kinder
	if errors.As(err, &k) {
		return k.Kind()
	}
	for _, pk := range poolKinds {
		if errors.Is(err, pk.err) {
			return pk.kind
		}
	}
	return "other"
}

// Rejected reports whether err is the seed API's "offload returned False"
// (the pool is full, or full until a pending reload is fenced): normal flow
// control, counted but not logged as an error.
func Rejected(err error) bool {
	return errors.Is(err, pool.ErrFull) || errors.Is(err, pool.ErrPending)
}

// Entry is one recorded error.
type Entry struct {
	Time      time.Time `json:"time"`
	Component string    `json:"component"` // "server", "plugin", "sizing", ...
	Op        string    `json:"op,omitempty"`
	Kind      string    `json:"kind"`
	Session   string    `json:"session,omitempty"`
	Message   string    `json:"message"`
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

// Op records a failed server operation, so a Ring can be one of the server's
// observers. Successes and full-pool rejects are not errors and are skipped.
func (r *Ring) Op(op observe.Op) {
	if op.Err == nil || Rejected(op.Err) {
		return
	}
	r.Add(Entry{Component: "server", Op: op.Name, Kind: Kind(op.Err), Session: op.Session, Message: op.Err.Error()})
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
