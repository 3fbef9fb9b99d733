// Package pool is the agent's bookkeeping of host KV pages.
//
// Memory arrives as chunks: byte regions the agent allocated, each sized
// under one GPU's share of the pool and lying on one NUMA node. An
// allocation (the chunks kubelet assigned to one pod) groups chunks;
// sessions (one per client process and GPU, for example one per
// tensor-parallel rank) open on an allocation, bind whole chunks from it by
// closeness to their GPU (bind.go: locality, not identity; the ranks share
// fairly), and carve them into pages of the session's own size. A session then keeps the
// stream table of the seed API: streams keyed by (rid, label), each holding
// host pages and the metadata that must survive the round trip.
//
// The pool never touches the bytes; clients copy them. What the pool
// guarantees is that a page belongs to at most one stream, that a page read
// by a pending reload copy is not handed out again until the client confirms
// the copy is complete (Fence), and that every failed call changes nothing.
//
// Pool methods are safe for concurrent use; so are Session methods, and
// sessions do not contend with one another on the hot path.
package pool

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpool/kvpool/pkg/poolerr"
)

// Chunk is a region of host memory that the pool may hand out.
type Chunk struct {
	ID   string // stable, unique name, e.g. "gpu0-numa1-7"
	GPU  int    // index of the GPU whose share of the pool the chunk was sized under; binding does not depend on it
	NUMA int    // NUMA node the memory is on, -1 when unknown
	Size int64  // bytes
}

// ChunkState is where a chunk stands in its life cycle.
type ChunkState uint8

const (
	ChunkFree    ChunkState = iota // scrubbed and unallocated
	ChunkGranted                   // part of an allocation
	ChunkDirty                     // was granted, must be scrubbed before reuse
)

func (s ChunkState) String() string {
	switch s {
	case ChunkFree:
		return "free"
	case ChunkGranted:
		return "granted"
	case ChunkDirty:
		return "dirty"
	}
	return fmt.Sprintf("ChunkState(%d)", uint8(s))
}

// Spec is a session's geometry.
type Spec struct {
	GPU         int   // host index of the GPU the session copies to and from
	PageSize    int64 // bytes per host page
	DevicePages int   // valid device page indices are [0, DevicePages)
	MaxPages    int   // host pages wanted; 0 binds the session's fair share of the allocation (OpenNear)
}

// Pool tracks chunks, allocations and sessions.
type Pool struct {
	mu      sync.Mutex
	chunks  map[string]*chunk
	order   []*chunk // in AddChunk order, for stable listings
	allocs  map[string]*allocation
	lastID  uint64  // the last session ID handed out; New starts it at sessionEpoch
	journal Journal // nil: no books
	// maxPages bounds the open sessions' pages together; 0: the default
	// (SetMaxPages).
	maxPages int64

	// streams and names total the sessions' stream tables: streams, and
	// bytes of request IDs and labels (StreamTotals).
	streams, names atomic.Int64
}

type chunk struct {
	Chunk
	state   ChunkState
	alloc   *allocation
	session *Session // bound session, nil when unbound
}

type allocation struct {
	id       string
	chunks   []*chunk
	sessions map[*Session]struct{}
}

// New returns an empty pool. Its session IDs start above sessionEpoch,
// the microseconds since 1970 when it was made, so that a fresh pool (one
// that could not be restored after an agent restart) never hands out an ID
// that an earlier pool gave a client which may still hold it.
func New() *Pool {
	return &Pool{chunks: make(map[string]*chunk), allocs: make(map[string]*allocation), lastID: sessionEpoch()}
}

// sessionEpoch is where a fresh pool's session IDs start: the clock in
// microseconds. An earlier pool could reach it only by handing out more
// than one session per microsecond of its life; the IDs stay below 2^53,
// exact in JSON and in a float64.
func sessionEpoch() uint64 { return uint64(time.Now().UnixMicro()) }

// AddChunk makes a freshly allocated (zeroed) chunk available.
func (p *Pool) AddChunk(c Chunk) error {
	if c.ID == "" {
		return fmt.Errorf("add chunk: %w: empty ID", poolerr.ErrBadSize)
	}
	if c.Size <= 0 {
		return fmt.Errorf("add chunk %s: %w: size %d", c.ID, poolerr.ErrBadSize, c.Size)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.chunks[c.ID]; ok {
		return fmt.Errorf("add chunk %s: %w", c.ID, poolerr.ErrDuplicateChunk)
	}
	ch := &chunk{Chunk: c}
	p.chunks[c.ID] = ch
	p.order = append(p.order, ch)
	p.record(Event{Kind: EventAddChunk, Chunk: c})
	return nil
}

// RemoveChunk forgets a chunk that no allocation holds (it failed, or the
// agent is shrinking the pool).
func (p *Pool) RemoveChunk(id string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	ch, ok := p.chunks[id]
	if !ok {
		return fmt.Errorf("remove chunk %s: %w", id, poolerr.ErrUnknownChunk)
	}
	if ch.state == ChunkGranted {
		return fmt.Errorf("remove chunk %s: %w: granted to allocation %s", id, poolerr.ErrChunkBusy, ch.alloc.id)
	}
	delete(p.chunks, id)
	for i, c := range p.order {
		if c == ch {
			p.order = append(p.order[:i], p.order[i+1:]...)
			break
		}
	}
	p.record(Event{Kind: EventRemoveChunk, Chunk: ch.Chunk})
	return nil
}

// Scrubbed marks a dirty chunk clean again: its bytes have been zeroed and it
// may go to another allocation.
func (p *Pool) Scrubbed(id string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	ch, ok := p.chunks[id]
	if !ok {
		return fmt.Errorf("scrubbed %s: %w", id, poolerr.ErrUnknownChunk)
	}
	if ch.state == ChunkGranted {
		return fmt.Errorf("scrubbed %s: %w: granted to allocation %s", id, poolerr.ErrChunkBusy, ch.alloc.id)
	}
	ch.state = ChunkFree
	p.record(Event{Kind: EventScrubbed, Chunk: ch.Chunk})
	return nil
}

// Grant gives the named chunks to an allocation. Granting the same set to the
// same allocation again is a no-op, so a repeated kubelet Allocate is safe.
func (p *Pool) Grant(alloc string, ids []string) error {
	if alloc == "" {
		return fmt.Errorf("grant: %w: empty allocation ID", poolerr.ErrBadSize)
	}
	if len(ids) == 0 {
		return fmt.Errorf("grant %s: %w: no chunks", alloc, poolerr.ErrBadSize)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if a, ok := p.allocs[alloc]; ok && sameOrder(a.chunks, ids) {
		// Granted already, in this order: a restart's standalone tokens
		// grant every restored allocation again (no table built for
		// thousands of chunks).
		return nil
	}
	chunks := make([]*chunk, len(ids))
	seen := make(map[string]bool, len(ids))
	for i, id := range ids {
		ch, ok := p.chunks[id]
		if !ok {
			return fmt.Errorf("grant %s: %w: %s", alloc, poolerr.ErrUnknownChunk, id)
		}
		if seen[id] {
			return fmt.Errorf("grant %s: %w: chunk %s named twice", alloc, poolerr.ErrDuplicateIndex, id)
		}
		seen[id] = true
		chunks[i] = ch
	}
	if a, ok := p.allocs[alloc]; ok {
		if sameChunks(a.chunks, chunks) {
			return nil
		}
		return fmt.Errorf("grant %s: %w", alloc, poolerr.ErrAllocationExists)
	}
	for _, ch := range chunks {
		switch ch.state {
		case ChunkGranted:
			return fmt.Errorf("grant %s: %w: %s is granted to allocation %s", alloc, poolerr.ErrChunkBusy, ch.ID, ch.alloc.id)
		case ChunkDirty:
			return fmt.Errorf("grant %s: %w: %s", alloc, poolerr.ErrChunkDirty, ch.ID)
		}
	}
	a := &allocation{id: alloc, chunks: chunks, sessions: make(map[*Session]struct{})}
	for _, ch := range chunks {
		ch.state = ChunkGranted
		ch.alloc = a
	}
	p.allocs[alloc] = a
	p.record(Event{Kind: EventGrant, Allocation: alloc, Chunks: append([]string(nil), ids...)})
	return nil
}

// sameOrder says whether chunks are the chunks ids names, in that order.
func sameOrder(chunks []*chunk, ids []string) bool {
	if len(chunks) != len(ids) {
		return false
	}
	for i, ch := range chunks {
		if ch.ID != ids[i] {
			return false
		}
	}
	return true
}

func sameChunks(a, b []*chunk) bool {
	if len(a) != len(b) {
		return false
	}
	set := make(map[*chunk]bool, len(a))
	for _, c := range a {
		set[c] = true
	}
	for _, c := range b {
		if !set[c] {
			return false
		}
	}
	return true
}

// Revoke ends an allocation: its sessions are closed, its streams dropped,
// and its chunks become dirty until Scrubbed. It returns the chunks, which the
// caller must zero before calling Scrubbed.
func (p *Pool) Revoke(alloc string) ([]Chunk, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	a, ok := p.allocs[alloc]
	if !ok {
		return nil, fmt.Errorf("revoke %s: %w", alloc, poolerr.ErrUnknownAllocation)
	}
	for s := range a.sessions {
		p.closeLocked(s)
	}
	out := make([]Chunk, len(a.chunks))
	for i, ch := range a.chunks {
		ch.state = ChunkDirty
		ch.alloc = nil
		out[i] = ch.Chunk
	}
	delete(p.allocs, alloc)
	p.record(Event{Kind: EventRevoke, Allocation: alloc})
	return out, nil
}

// Open starts a session on an allocation for a GPU whose NUMA node the pool
// takes from that GPU's own chunks, shared as Near's zero Ranks says: see
// OpenNear.
func (p *Pool) Open(alloc string, spec Spec) (*Session, error) {
	p.mu.Lock()
	near := Near{NUMA: p.homeNUMA(spec.GPU)}
	p.mu.Unlock()
	return p.OpenNear(alloc, spec, near)
}

// OpenNear starts a session on an allocation for spec.GPU, which sits where
// near says. It binds unbound chunks of the allocation by closeness to the
// GPU, never by the GPU they were sized under: chunks on the GPU's NUMA
// node first (the GPU's own first among them), then chunks whose node is
// unknown, then other nodes. With spec.MaxPages 0 it binds its fair share:
// the unbound chunks divided among the ranks (near.Ranks) that have no
// session yet, this one included, rounded up. An explicit MaxPages binds
// the chunks that many pages need, as long as every other rank without a
// session is left its equal part (rounded down); else, and when every
// chunk is bound, poolerr.ErrNoCapacity. A session whose pages would pass
// the bound on the open sessions' pages (SetMaxPages) is refused with a
// *PageBoundError.
func (p *Pool) OpenNear(alloc string, spec Spec, near Near) (*Session, error) {
	return p.ReplaceNear(nil, alloc, spec, near)
}

// ReplaceNear opens a session as OpenNear does, in place of old, an open
// session of the same allocation (nil or closed: none): old's chunks and
// pages count as free for the new one, and old is closed only once the
// new session is open. A refusal leaves old as it was, its streams and
// chunks with it.
func (p *Pool) ReplaceNear(old *Session, alloc string, spec Spec, near Near) (*Session, error) {
	switch {
	case spec.PageSize <= 0:
		return nil, fmt.Errorf("open: %w: page size %d", poolerr.ErrBadSize, spec.PageSize)
	case spec.DevicePages <= 0:
		return nil, fmt.Errorf("open: %w: device page count %d", poolerr.ErrBadSize, spec.DevicePages)
	case spec.MaxPages < 0:
		return nil, fmt.Errorf("open: %w: max pages %d", poolerr.ErrBadSize, spec.MaxPages)
	case near.Ranks < 0:
		return nil, fmt.Errorf("open: %w: %d ranks", poolerr.ErrBadSize, near.Ranks)
	}
	if near.NUMA < 0 {
		near.NUMA = -1
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	a, ok := p.allocs[alloc]
	if !ok {
		return nil, fmt.Errorf("open on %s: %w", alloc, poolerr.ErrUnknownAllocation)
	}
	if old != nil && old.Closed() {
		old = nil
	}
	if old != nil {
		if old.alloc != a {
			return nil, fmt.Errorf("open on %s: the session it would replace, %d, is of another allocation", alloc, old.id)
		}
		// Set old aside for the choice and the bound: under p.mu nobody
		// sees it, and a refusal puts it back.
		delete(a.sessions, old)
		for _, ch := range old.chunks {
			ch.session = nil
		}
	}
	refuse := func(err error) (*Session, error) {
		if old != nil {
			a.sessions[old] = struct{}{}
			for _, ch := range old.chunks {
				ch.session = old
			}
		}
		return nil, err
	}
	chosen, ppc, sh, err := choose(a, alloc, spec, near)
	if err != nil {
		return refuse(err)
	}
	capacity := len(chosen) * ppc
	if spec.MaxPages > 0 {
		capacity = spec.MaxPages
	}
	if held, bound := p.pagesLocked(); held+int64(capacity) > bound {
		return refuse(&PageBoundError{Allocation: alloc, GPU: spec.GPU, Pages: int64(capacity), PageSize: spec.PageSize, Held: held, Bound: bound})
	}
	if old != nil {
		p.closeLocked(old)
	}
	near.Ranks, near.Peers = sh.ranks, nil
	s := newSession(p, a, spec, chosen, ppc, capacity)
	s.near = near
	p.lastID++
	s.id = p.lastID
	for _, ch := range chosen {
		ch.session = s
	}
	a.sessions[s] = struct{}{}
	return s, nil
}

// Close ends a session: its streams are dropped and its chunks go back to the
// allocation for another session to bind. Closing twice is a no-op.
func (p *Pool) Close(s *Session) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closeLocked(s)
}

func (p *Pool) closeLocked(s *Session) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.closed = true
	for _, ch := range s.chunks {
		ch.session = nil
	}
	delete(s.alloc.sessions, s)
	s.dropAll()
}

// StreamTotals is what every open session's stream table holds together:
// its streams, and the bytes of their request IDs and labels (counted once
// per stream). The server bounds them across sessions. It takes no lock.
func (p *Pool) StreamTotals() (streams int, nameBytes int64) {
	return int(p.streams.Load()), p.names.Load()
}

// ChunkInfo is a chunk as Chunks lists it.
type ChunkInfo struct {
	Chunk
	State      ChunkState
	Allocation string // "" unless granted
	Bound      bool   // bound to a session
}

// Chunks lists every chunk in the order they were added.
func (p *Pool) Chunks() []ChunkInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]ChunkInfo, len(p.order))
	for i, ch := range p.order {
		out[i] = ChunkInfo{Chunk: ch.Chunk, State: ch.state, Bound: ch.session != nil}
		if ch.alloc != nil {
			out[i].Allocation = ch.alloc.id
		}
	}
	return out
}

// Allocations lists the pool's allocations, sorted.
func (p *Pool) Allocations() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	ids := make([]string, 0, len(p.allocs))
	for id := range p.allocs {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// Dirty lists the dirty chunks, in the pool's order.
func (p *Pool) Dirty() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var ids []string
	for _, ch := range p.order {
		if ch.state == ChunkDirty {
			ids = append(ids, ch.ID)
		}
	}
	return ids
}

// Allocation returns the IDs of the chunks granted to alloc.
func (p *Pool) Allocation(alloc string) ([]string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	a, ok := p.allocs[alloc]
	if !ok {
		return nil, fmt.Errorf("allocation %s: %w", alloc, poolerr.ErrUnknownAllocation)
	}
	ids := make([]string, len(a.chunks))
	for i, ch := range a.chunks {
		ids[i] = ch.ID
	}
	return ids, nil
}

// Sessions returns the open sessions of alloc.
func (p *Pool) Sessions(alloc string) []*Session {
	p.mu.Lock()
	defer p.mu.Unlock()
	a, ok := p.allocs[alloc]
	if !ok {
		return nil
	}
	out := make([]*Session, 0, len(a.sessions))
	for s := range a.sessions {
		out = append(out, s)
	}
	return out
}
