package pool

import (
	"cmp"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sort"

	"golang.org/x/sync/errgroup"

	"github.com/kvpool/kvpool/pkg/poolerr"
)

// EventKind names a change of the pool's chunk and allocation table.
type EventKind uint8

const (
	EventAddChunk EventKind = iota + 1
	EventRemoveChunk
	EventScrubbed
	EventGrant
	EventRevoke // the allocation's sessions close with it
)

// Event is one change of the pool's chunk and allocation table, as a
// Journal receives it. Session changes (streams, pages, tickets) are not
// events: whoever drives a session records them with the answer it gives.
type Event struct {
	Kind       EventKind
	Chunk      Chunk    // AddChunk, RemoveChunk, Scrubbed
	Allocation string   // Grant, Revoke
	Chunks     []string // Grant: the chunk IDs, in order
}

// Journal receives every change of the chunk and allocation table after it
// is made, under the pool's lock, in the order the changes happen. It must
// not call back into the pool, and it cannot refuse: a journal that can no
// longer write must stop the process.
type Journal interface {
	Record(Event)
}

// SetJournal makes j receive the pool's events from now on (nil: none).
func (p *Pool) SetJournal(j Journal) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.journal = j
}

func (p *Pool) record(ev Event) {
	if p.journal != nil {
		p.journal.Record(ev)
	}
}

// Image is the pool's whole state in plain values: what Export returns and
// Restore rebuilds. Page lists name host pages of the session.
type Image struct {
	Chunks      []ChunkImage // in AddChunk order
	Allocations []AllocationImage
	Sessions    []SessionImage
	LastSession uint64 // the last session ID handed out
}

// ChunkImage is a chunk and where it stands.
type ChunkImage struct {
	Chunk
	State ChunkState
}

// AllocationImage is an allocation and its chunks, in grant order.
type AllocationImage struct {
	ID     string
	Chunks []string
}

// SessionImage is one open session.
type SessionImage struct {
	ID         uint64
	Allocation string
	Spec       Spec
	Chunks     []string // bound, in page order
	PPC        int      // pages per chunk
	Capacity   int
	Ticket     uint64         // the last reload ticket issued
	Requests   []RequestImage // each request once (Restore refuses one listed twice)
	Pending    []PendingImage // oldest first
}

// RequestImage is one request and its streams, in the order they were
// offloaded. Restore skips a request without streams, so that whoever keeps
// its requests in a list with holes (the books) hands the list as it is.
type RequestImage struct {
	Rid     string
	Streams []StreamImage
}

// StreamImage is one (rid, label) stream of a request.
type StreamImage struct {
	Label string
	Meta  Meta
	Pages []int32
}

// PendingImage is a reload whose pages wait for their fence.
type PendingImage struct {
	Ticket uint64
	Pages  []int32
}

// Export returns the pool's state. Sessions are ordered by ID and streams
// by request ID, then in offload order.
func (p *Pool) Export() Image {
	p.mu.Lock()
	defer p.mu.Unlock()
	img := Image{LastSession: p.lastID}
	for _, ch := range p.order {
		img.Chunks = append(img.Chunks, ChunkImage{Chunk: ch.Chunk, State: ch.state})
	}
	ids := make([]string, 0, len(p.allocs))
	for id := range p.allocs {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		a := p.allocs[id]
		ai := AllocationImage{ID: id}
		for _, ch := range a.chunks {
			ai.Chunks = append(ai.Chunks, ch.ID)
		}
		img.Allocations = append(img.Allocations, ai)
		for s := range a.sessions {
			img.Sessions = append(img.Sessions, s.Image())
		}
	}
	slices.SortFunc(img.Sessions, func(a, b SessionImage) int { return cmp.Compare(a.ID, b.ID) })
	return img
}

// Image returns the session as Export lists it: its geometry, chunks and
// tickets, streams and pending reloads.
func (s *Session) Image() SessionImage {
	s.mu.Lock()
	defer s.mu.Unlock()
	si := SessionImage{ID: s.id, Allocation: s.alloc.id, Spec: s.spec, PPC: s.ppc, Capacity: s.capacity, Ticket: s.ticket}
	for _, ch := range s.chunks {
		si.Chunks = append(si.Chunks, ch.ID)
	}
	chain := func(head int32) []int32 {
		out := []int32{}
		for p := head; p != nilPage; p = s.next[p] {
			out = append(out, p)
		}
		return out
	}
	rids := make([]string, 0, s.reqs.n)
	for rid := range s.reqs.all() {
		rids = append(rids, rid)
	}
	sort.Strings(rids)
	si.Requests = make([]RequestImage, 0, len(rids))
	for _, rid := range rids {
		l, _ := s.reqs.get(rid)
		q := RequestImage{Rid: rid, Streams: make([]StreamImage, 0, l.n)}
		for slot := l.first; slot != nilPage; slot = s.at(slot).next {
			st := s.at(slot)
			q.Streams = append(q.Streams, StreamImage{Label: s.labelOf(slot), Meta: st.meta, Pages: chain(st.head)})
		}
		si.Requests = append(si.Requests, q)
	}
	for _, r := range s.pending[s.phead:] {
		si.Pending = append(si.Pending, PendingImage{Ticket: r.ticket, Pages: chain(r.head)})
	}
	return si
}

// Restore rebuilds an empty pool from img and returns its sessions in the
// order img lists them. It checks every invariant the pool keeps (a page
// on one list, a chunk in one allocation and bound to one session, counts
// within capacity); on any error the pool stays empty.
func (p *Pool) Restore(img Image) ([]*Session, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.chunks) != 0 || len(p.allocs) != 0 {
		return nil, errors.New("restore: the pool is not empty")
	}
	out, err := p.restoreLocked(img)
	if err != nil {
		p.chunks, p.order, p.allocs, p.lastID = make(map[string]*chunk), nil, make(map[string]*allocation), sessionEpoch()
		p.streams.Store(0)
		p.names.Store(0)
		return nil, fmt.Errorf("restore: %w", err)
	}
	return out, nil
}

func (p *Pool) restoreLocked(img Image) ([]*Session, error) {
	if len(p.chunks) == 0 {
		// Sized once, not grown chunk by chunk: a large node restores
		// thousands (each table's growth is heap the restart faults in).
		p.chunks = make(map[string]*chunk, len(img.Chunks))
	}
	p.order = slices.Grow(p.order, len(img.Chunks))
	for _, c := range img.Chunks {
		if c.ID == "" || c.Size <= 0 {
			return nil, fmt.Errorf("%w: chunk %q of %d bytes", poolerr.ErrBadSize, c.ID, c.Size)
		}
		if c.State > ChunkDirty {
			return nil, fmt.Errorf("chunk %s: bad state %d", c.ID, c.State)
		}
		// A chunk listed twice leaves the table one short (one lookup a
		// chunk, not two; on an error the pool is emptied).
		ch, n := &chunk{Chunk: c.Chunk, state: c.State}, len(p.chunks)
		if p.chunks[c.ID] = ch; len(p.chunks) == n {
			return nil, fmt.Errorf("chunk %s: %w", c.ID, poolerr.ErrDuplicateChunk)
		}
		p.order = append(p.order, ch)
	}
	for _, ai := range img.Allocations {
		if ai.ID == "" || len(ai.Chunks) == 0 {
			return nil, fmt.Errorf("%w: allocation %q of %d chunks", poolerr.ErrBadSize, ai.ID, len(ai.Chunks))
		}
		if _, ok := p.allocs[ai.ID]; ok {
			return nil, fmt.Errorf("allocation %s: %w", ai.ID, poolerr.ErrAllocationExists)
		}
		a := &allocation{id: ai.ID, sessions: make(map[*Session]struct{}), chunks: make([]*chunk, 0, len(ai.Chunks))}
		for _, id := range ai.Chunks {
			ch, ok := p.chunks[id]
			if !ok {
				return nil, fmt.Errorf("allocation %s: %w: %s", ai.ID, poolerr.ErrUnknownChunk, id)
			}
			if ch.state != ChunkGranted || ch.alloc != nil {
				return nil, fmt.Errorf("allocation %s: chunk %s is %s or in another allocation", ai.ID, id, ch.state)
			}
			ch.alloc = a
			a.chunks = append(a.chunks, ch)
		}
		p.allocs[ai.ID] = a
	}
	for _, ch := range p.order {
		if ch.state == ChunkGranted && ch.alloc == nil {
			return nil, fmt.Errorf("chunk %s is granted but in no allocation", ch.ID)
		}
	}
	if img.LastSession > 0 {
		// The image's IDs go on from its last one; an image that never
		// opened a session keeps this pool's epoch.
		p.lastID = img.LastSession
	}
	out := make([]*Session, 0, len(img.Sessions))
	seen := map[uint64]bool{}
	for _, si := range img.Sessions {
		if si.ID == 0 || si.ID > img.LastSession || seen[si.ID] {
			return nil, fmt.Errorf("session %d: ID zero, repeated or above the last issued %d", si.ID, img.LastSession)
		}
		seen[si.ID] = true
		s, err := p.restoreSession(si)
		if err != nil {
			return nil, fmt.Errorf("session %d: %w", si.ID, err)
		}
		out = append(out, s)
	}
	// Each session's tables are its own: they are rebuilt side by side,
	// one goroutine a session up to GOMAXPROCS (a node's sessions restore
	// on all its CPUs). Of their errors, the first session's is told.
	errs := make([]error, len(out))
	var g errgroup.Group
	procs := runtime.GOMAXPROCS(0)
	g.SetLimit(procs)
	// With CPUs to spare, a large session's request index is built on a
	// CPU of its own (restoreStreams).
	spare := len(out) < procs
	for i, s := range out {
		g.Go(func() error { errs[i] = s.restoreTables(img.Sessions[i], spare); return nil })
	}
	_ = g.Wait()
	for i, err := range errs {
		if err != nil {
			return nil, fmt.Errorf("session %d: %w", out[i].id, err)
		}
	}
	return out, nil
}

// restoreSession makes one session of an image on its chunks, its tables
// empty (restoreTables fills them).
func (p *Pool) restoreSession(si SessionImage) (*Session, error) {
	a, ok := p.allocs[si.Allocation]
	if !ok {
		return nil, fmt.Errorf("%w: %s", poolerr.ErrUnknownAllocation, si.Allocation)
	}
	chunks, err := p.restoreChunks(a, si)
	if err != nil {
		return nil, err
	}
	s := newSession(p, a, si.Spec, chunks, si.PPC, si.Capacity)
	s.id, s.ticket = si.ID, si.Ticket
	s.near.NUMA = p.homeNUMA(si.Spec.GPU)
	for _, ch := range chunks {
		ch.session = s
	}
	a.sessions[s] = struct{}{}
	return s, nil
}

// restoreTables rebuilds a restored session's streams, pending reloads and
// free list from its image. It touches the session alone (and the pool's
// atomic counts); spare: a CPU is free for it besides the caller's.
func (s *Session) restoreTables(si SessionImage, spare bool) error {
	var used pageSet
	if err := s.restoreStreams(si.Requests, &used, spare); err != nil {
		return err
	}
	if err := s.restorePending(si, &used); err != nil {
		return err
	}
	s.restoreFree(&used)
	// The pool's counts once a session, not once a stream: sessions
	// restore side by side.
	s.pool.streams.Add(int64(s.nstreams))
	s.pool.names.Add(s.names)
	return nil
}

// restoreChunks checks an image's geometry and returns its chunks, each of
// allocation a, unbound, and large enough.
func (p *Pool) restoreChunks(a *allocation, si SessionImage) ([]*chunk, error) {
	spec := si.Spec
	if spec.PageSize <= 0 || spec.DevicePages <= 0 || spec.MaxPages < 0 || si.PPC <= 0 || si.Capacity < 0 ||
		len(si.Chunks) == 0 || int64(si.Capacity) > int64(len(si.Chunks))*int64(si.PPC) || si.Capacity > maxPages {
		return nil, fmt.Errorf("%w: page size %d, %d device pages, %d pages per chunk, capacity %d over %d chunks",
			poolerr.ErrBadSize, spec.PageSize, spec.DevicePages, si.PPC, si.Capacity, len(si.Chunks))
	}
	chunks := make([]*chunk, 0, len(si.Chunks))
	// A chunk listed twice is found by the mark its first listing left
	// (not by searching the list: a session of 16,384 chunks would take
	// 10^8 comparisons); the caller binds them all, or a failure here
	// takes the marks back.
	unmark := func() {
		for _, ch := range chunks {
			ch.session = nil
		}
	}
	for _, id := range si.Chunks {
		ch, ok := p.chunks[id]
		if !ok || ch.alloc != a {
			unmark()
			return nil, fmt.Errorf("chunk %s is not in allocation %s", id, a.id)
		}
		if ch.session != nil {
			unmark()
			return nil, fmt.Errorf("chunk %s is bound twice", id)
		}
		if int64(si.PPC)*spec.PageSize > ch.Size {
			unmark()
			return nil, fmt.Errorf("%w: chunk %s of %d bytes cannot hold %d pages of %d", poolerr.ErrBadSize, id, ch.Size, si.PPC, spec.PageSize)
		}
		ch.session = restoring
		chunks = append(chunks, ch)
	}
	return chunks, nil
}

// restoring marks the chunks restoreChunks has taken for a session until
// restoreSession binds them to it.
var restoring = new(Session)

// pageSet marks the pages a restore has linked, in bits, growing with
// the highest (the pages above it are the untouched ones).
type pageSet []uint64

// add marks page p and says whether it was unmarked.
func (u *pageSet) add(p int32) bool {
	w, bit := int(p>>6), uint64(1)<<(p&63)
	if w >= len(*u) {
		*u = append(*u, make([]uint64, w+1-len(*u))...)
	}
	if (*u)[w]&bit != 0 {
		return false
	}
	(*u)[w] |= bit
	return true
}

func (u pageSet) has(p int32) bool {
	w := int(p >> 6)
	return w < len(u) && u[w]&(1<<(p&63)) != 0
}

// linkPages chains pages into a list, marking them used; a page outside
// the capacity or already used is an error.
func (s *Session) linkPages(pages []int32, used *pageSet) (head, tail int32, err error) {
	head, tail = nilPage, nilPage
	for _, pg := range pages {
		if pg < 0 || int(pg) >= s.capacity {
			return 0, 0, fmt.Errorf("%w: host page %d outside [0, %d)", poolerr.ErrOutOfRange, pg, s.capacity)
		}
		if !used.add(pg) {
			return 0, 0, fmt.Errorf("%w: host page %d held twice", poolerr.ErrDuplicateIndex, pg)
		}
		s.fresh = max(s.fresh, pg+1)
		if tail == nilPage {
			head = pg
		} else {
			s.next[tail] = pg
		}
		tail = pg
	}
	if tail != nilPage {
		s.next[tail] = nilPage
	}
	return head, tail, nil
}

// restoreStreams rebuilds the stream table from an image's requests: the
// table is sized for the requests first, and each request costs one map
// assignment, not one a stream. A request listed twice is refused.
//
// With a CPU to spare, a large session's slots are filled in a goroutine
// of its own while this one builds the request index: on a fresh session
// the slots are handed out in order, so the requests name their slots
// before they are made. The index was half of a large session's rebuild.
func (s *Session) restoreStreams(reqs []RequestImage, used *pageSet, spare bool) error {
	requests, streams := 0, 0
	for i := range reqs {
		if n := len(reqs[i].Streams); n > 0 {
			requests++
			streams += n
		}
	}
	if streams >= maxPages {
		return fmt.Errorf("%w: %d streams, more than a session's %d pages", poolerr.ErrPageCount, streams, maxPages)
	}
	if spare && streams >= splitFrom {
		// The index, the longer of the two, runs here: a goroutine
		// started now may wait for a CPU until another one yields (a
		// restarted agent writes its fresh books meanwhile), and the
		// index in it began 5-10 ms late.
		fill := make(chan error, 1)
		go func() { fill <- s.fillRequests(reqs, used) }()
		err := s.indexRequests(reqs, requests)
		if ferr := <-fill; ferr != nil {
			err = ferr
		}
		return err
	}
	if err := s.fillRequests(reqs, used); err != nil {
		return err
	}
	return s.indexRequests(reqs, requests)
}

// splitFrom is the session size from which restoreStreams builds the index
// on a CPU of its own (a goroutine costs more than a small session's index).
const splitFrom = 4096

// indexRequests makes the request index of a fresh session whose streams
// fillRequests puts in slots 0, 1, ... in order.
func (s *Session) indexRequests(reqs []RequestImage, requests int) error {
	s.reqs = newReqIndex(requests)
	return s.reqs.indexAll(reqs)
}

var errListedTwice = errors.New("listed twice (an image lists each request once, with its streams)")

// fillRequests rebuilds the streams of each request, in order, each in
// the slot after the last (a fresh session's slots come so); the index is
// indexRequests'.
func (s *Session) fillRequests(reqs []RequestImage, used *pageSet) error {
	k := int32(0)
	place := -1 // the request's place in the index: indexAll gives them in this order
	// The label index made for the streams it will hold, so that it does
	// not grow while it fills.
	indexed := 0
	for i := range reqs {
		if n := len(reqs[i].Streams); n > indexFrom {
			indexed += n
		}
	}
	if indexed > 0 {
		s.byLabel.makeFor(indexed)
	}
	for i := range reqs {
		q := &reqs[i]
		if len(q.Streams) == 0 {
			continue
		}
		place++
		rid := q.Rid
		if err := checkNames(rid, ""); err != nil {
			return err
		}
		l := ridList{first: nilPage, last: nilPage}
		for j := range q.Streams {
			st := &q.Streams[j]
			if err := checkNames(rid, st.Label); err != nil {
				return err
			}
			if err := st.Meta.validate(); err != nil {
				return err
			}
			if s.findIn(place, l, st.Label) != nilPage {
				return fmt.Errorf("%q/%q: %w", rid, st.Label, poolerr.ErrDuplicateStream)
			}
			head, tail, err := s.linkPages(st.Pages, used)
			if err != nil {
				return fmt.Errorf("%q/%q: %w", rid, st.Label, err)
			}
			if slot := s.newSlot(); slot != k {
				return fmt.Errorf("restore: stream %d took slot %d", k, slot) // a fresh session's slots come in order
			}
			*s.at(k) = stream{meta: st.Meta, head: head, tail: tail, n: int32(len(st.Pages))}
			s.setLabel(k, st.Label)
			l = s.linkOnly(place, l, k)
			s.names += int64(len(rid) + len(st.Label))
			k++
		}
	}
	return nil
}

// restorePending rebuilds the reloads waiting for their fence, oldest
// first.
func (s *Session) restorePending(si SessionImage, used *pageSet) error {
	var last uint64
	for _, r := range si.Pending {
		if r.Ticket <= last || r.Ticket > si.Ticket || len(r.Pages) == 0 {
			return fmt.Errorf("%w: pending reload %d (last issued %d, previous %d, %d pages)", poolerr.ErrBadFence, r.Ticket, si.Ticket, last, len(r.Pages))
		}
		last = r.Ticket
		head, tail, err := s.linkPages(r.Pages, used)
		if err != nil {
			return fmt.Errorf("pending reload %d: %w", r.Ticket, err)
		}
		s.pending = append(s.pending, release{ticket: r.Ticket, head: head, tail: tail, n: int32(len(r.Pages))})
		s.npending += len(r.Pages)
	}
	return nil
}

// restoreFree makes every page not used the free list, ascending, up to
// the last page used (linkPages moved fresh past it); the pages above it
// stay untouched, free from fresh up.
func (s *Session) restoreFree(used *pageSet) {
	s.freeHead, s.nfree = nilPage, s.capacity-int(s.fresh)
	prev := int32(nilPage)
	for pg := range s.fresh {
		if used.has(pg) {
			continue
		}
		if prev == nilPage {
			s.freeHead = pg
		} else {
			s.next[prev] = pg
		}
		prev = pg
		s.nfree++
	}
	if prev != nilPage {
		s.next[prev] = nilPage
	}
}
