package pool

import (
	"fmt"
	"strings"
	"sync"

	"github.com/kvpool/kvpool/pkg/poolerr"
)

// Meta is the stream metadata the seed API saves at offload and returns at
// reload (OffloadedStream without its page indices).
type Meta struct {
	StoredLen int64
	Position  int64
	Released  int64
}

func (m Meta) validate() error {
	if m.StoredLen < 0 || m.Position < 0 || m.Released < 0 {
		return fmt.Errorf("%w: stored_len %d, position %d, released %d must not be negative",
			poolerr.ErrBadSize, m.StoredLen, m.Position, m.Released)
	}
	return nil
}

// Reloaded is what Reload returns: the stream's host pages (in the order of
// the device pages they were offloaded from), its metadata, and the ticket to
// pass to Fence once the copy reading those pages is complete. Ticket is 0
// when the stream had no pages and nothing is pending.
type Reloaded struct {
	Pages  []int32
	Meta   Meta
	Ticket uint64
}

const (
	nilPage = -1
	// maxPages bounds a session's pages so that indices fit in int32.
	maxPages = 1<<31 - 2
	// MaxNameLen bounds request IDs and labels, in bytes.
	MaxNameLen = 1024
)

// Session is one client's view of the pool: its pages and its stream table.
type Session struct {
	id       uint64
	pool     *Pool
	alloc    *allocation
	spec     Spec
	chunks   []*chunk // bound, in page order: page p lives in chunks[p/ppc]
	ppc      int
	capacity int
	near     Near // where the GPU sits, and the ranks the allocation was shared among (no peers)

	mu     sync.Mutex
	closed bool

	// next threads every page below fresh onto exactly one list: the
	// free list, a stream's page chain, or a pending release. nilPage
	// ends a list. The pages from fresh up have never been handed out:
	// they are free, on no list, and their entries of next unwritten: a
	// large session's table is a mapping of its own, whose pages are
	// made when first written (links.go). nfree counts both kinds of
	// free page.
	next     []int32
	links    *links // next's mapping, where it has one (links.go)
	freeHead int32
	fresh    int32
	nfree    int

	pending  []release // FIFO of reloads awaiting their fence; live from phead
	phead    int
	npending int
	ticket   uint64 // last ticket issued

	reqs reqIndex // request ID -> its streams, in offload order
	// byLabel indexes the streams of each request that holds more than
	// indexFrom of them: (the request's place, label) -> slot, one table
	// for the session (labelindex.go). Kept out of ridList so that the
	// entry every request has stays 12 bytes.
	byLabel  labelIndex
	slab     []*slabBlock
	freeSlot int32 // free slots, linked through stream.next
	nstreams int
	used     int
	names    int64 // bytes of request IDs and labels, counted once per stream

	seen []uint64 // scratch bitmap over device pages for duplicate checks

	// labels interns stream labels: an engine uses a handful (one per KV
	// group) across all its streams, so each is stored once and a stream
	// keeps its index (4 bytes, not a 16-byte string header). Labels
	// beyond maxInterned are kept in ownLabels by slot.
	labels    []string
	labelIdx  map[string]int32
	ownLabels map[int32]string
}

// maxInterned bounds the label intern table; labels beyond it are stored
// per stream (ownLabels).
const maxInterned = 256

// ownLabel marks a stream whose label is in ownLabels, not interned.
const ownLabel = -1

// intern returns label's index in the intern table, adding it while the
// table has room; ownLabel when it is full.
func (s *Session) intern(label string) int32 {
	if i, ok := s.labelIdx[label]; ok {
		return i
	}
	if len(s.labels) < maxInterned {
		label = strings.Clone(label)
		i := int32(len(s.labels))
		s.labels = append(s.labels, label)
		s.labelIdx[label] = i
		return i
	}
	return ownLabel
}

// setLabel gives the stream in slot its label.
func (s *Session) setLabel(slot int32, label string) {
	st := s.at(slot)
	if st.label = s.intern(label); st.label == ownLabel {
		s.ownLabels[slot] = label
	}
}

// labelOf is the label of the stream in slot.
func (s *Session) labelOf(slot int32) string {
	if i := s.at(slot).label; i != ownLabel {
		return s.labels[i]
	}
	return s.ownLabels[slot]
}

type release struct {
	ticket     uint64
	head, tail int32
	n          int32
}

// stream is one (rid, label) entry. Streams of one request are linked
// through next and prev in the order they were offloaded, so that labels
// come in that order while finding and removing a stream stays O(1) however
// many streams a request has.
type stream struct {
	meta       Meta
	label      int32 // index in the intern table, or ownLabel
	head, tail int32 // host page chain
	n          int32 // pages
	next       int32 // next stream of the same request, or next free slot
	prev       int32 // previous stream of the same request
}

// ridList is a request's list of streams. A request with more than
// indexFrom streams also indexes them by label (Session.byLabel), so that
// finding one stays O(1) however many a request has; below that a walk of
// the list is faster than the table and costs the hot path nothing.
type ridList struct {
	first, last int32
	n           int32
}

const indexFrom = 8

const slabShift = 9

type slabBlock [1 << slabShift]stream

func newSession(p *Pool, a *allocation, spec Spec, chunks []*chunk, ppc, capacity int) *Session {
	s := &Session{
		pool: p, alloc: a, spec: spec, chunks: chunks, ppc: ppc, capacity: capacity, near: Near{NUMA: -1},
		freeHead:  nilPage,
		nfree:     capacity,
		reqs:      newReqIndex(0),
		freeSlot:  nilPage,
		seen:      make([]uint64, (spec.DevicePages+63)/64),
		labelIdx:  make(map[string]int32),
		ownLabels: make(map[int32]string),
	}
	s.makeLinks()
	return s
}

// ID is the session's number, unique in the pool (and across a restore).
func (s *Session) ID() uint64 { return s.id }

// Spec returns the geometry the session was opened with.
func (s *Session) Spec() Spec { return s.spec }

// Capacity is the number of host pages the session may hold.
func (s *Session) Capacity() int { return s.capacity }

// PagesPerChunk is how many pages each bound chunk holds: page p lives in
// Chunks()[p/PagesPerChunk()] at byte offset (p%PagesPerChunk())*PageSize.
func (s *Session) PagesPerChunk() int { return s.ppc }

// Chunks returns the chunks bound to the session, in page order.
func (s *Session) Chunks() []Chunk {
	out := make([]Chunk, len(s.chunks))
	for i, ch := range s.chunks {
		out[i] = ch.Chunk
	}
	return out
}

// Allocation returns the ID of the allocation the session draws from.
func (s *Session) Allocation() string { return s.alloc.id }

func (s *Session) at(slot int32) *stream {
	return &s.slab[slot>>slabShift][slot&(1<<slabShift-1)]
}

func (s *Session) newSlot() int32 {
	if s.freeSlot == nilPage {
		base := int32(len(s.slab)) << slabShift
		s.slab = append(s.slab, new(slabBlock))
		for i := int32(1<<slabShift) - 1; i >= 0; i-- {
			st := s.at(base + i)
			st.next = s.freeSlot
			s.freeSlot = base + i
		}
	}
	slot := s.freeSlot
	s.freeSlot = s.at(slot).next
	return slot
}

func (s *Session) freeSlotAt(slot int32) {
	st := s.at(slot)
	if st.label == ownLabel {
		delete(s.ownLabels, slot)
	}
	*st = stream{next: s.freeSlot}
	s.freeSlot = slot
}

// find returns the slot of (rid, label), or nilPage when there is none,
// rid's list and its place in the request index (-1 when rid holds no
// stream).
func (s *Session) find(rid, label string) (int32, ridList, int) {
	l, place, ok := s.reqs.find(rid)
	if !ok {
		return nilPage, l, -1
	}
	return s.findIn(place, l, label), l, place
}

// findIn is the slot of label's stream in the list l of the request at
// place, or nilPage.
func (s *Session) findIn(place int, l ridList, label string) int32 {
	if l.n > indexFrom {
		return s.findLabel(place, label)
	}
	for slot := l.first; slot != nilPage; slot = s.at(slot).next {
		if s.labelOf(slot) == label {
			return slot
		}
	}
	return nilPage
}

// link appends a new stream in slot to rid's list l, the request at place
// (zero and -1 when rid has no stream yet).
func (s *Session) link(rid string, l ridList, place int, slot int32) {
	l = s.linkOnly(place, l, slot)
	if place < 0 {
		s.reqs.put(rid, l)
	} else {
		s.reqs.setList(place, l)
	}
	s.pool.streams.Add(1)
}

// linkOnly is link but for storing the list (it returns it) and for the
// pool's count of streams (its caller adds them).
func (s *Session) linkOnly(place int, l ridList, slot int32) ridList {
	st := s.at(slot)
	st.next = nilPage
	if l.n > 0 {
		st.prev = l.last
		s.at(l.last).next = slot
		l.last = slot
	} else {
		st.prev = nilPage
		l.first, l.last = slot, slot
	}
	l.n++
	switch {
	case l.n > indexFrom+1:
		s.indexLabel(place, slot)
	case l.n > indexFrom:
		for x := l.first; x != nilPage; x = s.at(x).next {
			s.indexLabel(place, x)
		}
	}
	s.nstreams++
	s.used += int(st.n)
	return l
}

// unlink removes slot from rid's list l, the request at place, and frees
// the slot.
func (s *Session) unlink(rid string, place int, l ridList, slot int32) {
	switch {
	case l.n > indexFrom+1:
		s.unindexLabel(place, slot)
	case l.n == indexFrom+1: // the request's streams are walked from now on
		for x := l.first; x != nilPage; x = s.at(x).next {
			s.unindexLabel(place, x)
		}
	}
	st := s.at(slot)
	if st.prev != nilPage {
		s.at(st.prev).next = st.next
	} else {
		l.first = st.next
	}
	if st.next != nilPage {
		s.at(st.next).prev = st.prev
	} else {
		l.last = st.prev
	}
	label := s.labelOf(slot)
	l.n--
	if l.n == 0 {
		s.reqs.del(rid)
	} else {
		s.reqs.setList(place, l)
	}
	s.used -= int(st.n)
	s.nstreams--
	s.names -= int64(len(rid) + len(label))
	s.pool.streams.Add(-1)
	s.pool.names.Add(-int64(len(rid) + len(label)))
	s.freeSlotAt(slot)
}

func checkNames(rid, label string) error {
	if rid == "" || len(rid) > MaxNameLen || len(label) > MaxNameLen {
		return fmt.Errorf("%w: request ID of %d bytes, label of %d bytes (request ID must be 1 to %d bytes, label at most %d)",
			poolerr.ErrBadName, len(rid), len(label), MaxNameLen, MaxNameLen)
	}
	return nil
}

// checkDevicePages rejects device page indices out of range or named twice.
func (s *Session) checkDevicePages(pages []int32) error {
	if len(pages) > s.spec.DevicePages {
		return fmt.Errorf("%w: %d device pages named, the device has %d", poolerr.ErrPageCount, len(pages), s.spec.DevicePages)
	}
	var err error
	i := 0
	for ; i < len(pages); i++ {
		p := pages[i]
		if p < 0 || int(p) >= s.spec.DevicePages {
			err = fmt.Errorf("%w: device page %d is not in [0, %d)", poolerr.ErrOutOfRange, p, s.spec.DevicePages)
			break
		}
		w, b := p>>6, uint64(1)<<(p&63)
		if s.seen[w]&b != 0 {
			err = fmt.Errorf("%w: device page %d named twice", poolerr.ErrDuplicateIndex, p)
			break
		}
		s.seen[w] |= b
	}
	for _, p := range pages[:i] {
		s.seen[p>>6] &^= uint64(1) << (p & 63)
	}
	return err
}

// Offload records a new stream (rid, label) holding one fresh host page per
// device page in gpuPages, and appends the host pages to dst in the same
// order. It is all or nothing: when the pool cannot hold every page it returns
// poolerr.ErrFull (or a *PendingError when pages pending release would make room) and
// nothing changes. An offload of zero pages returns poolerr.ErrNoPages and records
// nothing (the seed's engine treats it as "offload returned False"). A second
// offload of an existing (rid, label) is poolerr.ErrDuplicateStream: the old stream
// stays as it was.
func (s *Session) Offload(rid, label string, gpuPages []int32, m Meta, dst []int32) ([]int32, error) {
	if err := checkNames(rid, label); err != nil {
		return dst, streamErr("offload", rid, label, err)
	}
	if err := m.validate(); err != nil {
		return dst, streamErr("offload", rid, label, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return dst, streamErr("offload", rid, label, poolerr.ErrClosed)
	}
	if err := s.checkDevicePages(gpuPages); err != nil {
		return dst, streamErr("offload", rid, label, err)
	}
	found, list, place := s.find(rid, label)
	if found != nilPage {
		return dst, streamErr("offload", rid, label, poolerr.ErrDuplicateStream)
	}
	n := len(gpuPages)
	if n == 0 {
		return dst, streamErr("offload", rid, label, poolerr.ErrNoPages)
	}
	if n > s.nfree {
		if n > s.nfree+s.npending {
			return dst, streamErr("offload", rid, label,
				fmt.Errorf("%w: need %d, %d free of %d", poolerr.ErrFull, n, s.nfree+s.npending, s.capacity))
		}
		return dst, s.pendingErr(n)
	}
	if list.n == 0 && s.reqs.full(len(rid)) {
		return dst, streamErr("offload", rid, label,
			fmt.Errorf("%w: the session's request IDs take %d bytes, no room for %d more", poolerr.ErrFull, s.reqs.names.size, len(rid)))
	}

	head, tail := s.freeHead, int32(nilPage)
	p := head
	listed := min(n, s.listedFree())
	for range listed {
		dst = append(dst, p)
		tail, p = p, s.next[p]
	}
	s.freeHead = p
	// The rest from the pages never handed out, in ascending order, so
	// that a fresh session hands out contiguous runs.
	for range n - listed {
		p = s.fresh
		s.fresh++
		dst = append(dst, p)
		if tail == nilPage {
			head = p
		} else {
			s.next[tail] = p
		}
		tail = p
	}
	s.next[tail] = nilPage
	s.nfree -= n

	slot := s.newSlot()
	*s.at(slot) = stream{meta: m, head: head, tail: tail, n: int32(n)}
	s.setLabel(slot, label)
	s.link(rid, list, place, slot)
	s.names += int64(len(rid) + len(label))
	s.pool.names.Add(int64(len(rid) + len(label)))
	return dst, nil
}

// listedFree is how many free pages are on the free list (the others lie
// from fresh up).
func (s *Session) listedFree() int { return s.nfree - (s.capacity - int(s.fresh)) }

// pendingErr names the oldest pending reload whose completion frees enough
// pages for an offload of n.
func (s *Session) pendingErr(n int) error {
	have := s.nfree
	for _, r := range s.pending[s.phead:] {
		have += int(r.n)
		if have >= n {
			return &PendingError{Ticket: r.ticket, Need: n, Free: s.nfree}
		}
	}
	panic("pool: pendingErr called without enough pending pages")
}

// Reload removes the stream (rid, label) and returns its host pages, appended
// to dst, and its metadata. gpuPages names the device pages the client will
// copy onto; there must be exactly one per host page. The host pages are not
// reused until Fence is called with the returned ticket.
func (s *Session) Reload(rid, label string, gpuPages []int32, dst []int32) (Reloaded, error) {
	if err := checkNames(rid, label); err != nil {
		return Reloaded{Pages: dst}, streamErr("reload", rid, label, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return Reloaded{Pages: dst}, streamErr("reload", rid, label, poolerr.ErrClosed)
	}
	if err := s.checkDevicePages(gpuPages); err != nil {
		return Reloaded{Pages: dst}, streamErr("reload", rid, label, err)
	}
	slot, list, place := s.find(rid, label)
	if slot == nilPage {
		return Reloaded{Pages: dst}, streamErr("reload", rid, label, poolerr.ErrUnknownStream)
	}
	st := s.at(slot)
	if len(gpuPages) != int(st.n) {
		return Reloaded{Pages: dst}, streamErr("reload", rid, label,
			fmt.Errorf("%w: stream holds %d pages, %d device pages given", poolerr.ErrPageCount, st.n, len(gpuPages)))
	}
	for p := st.head; p != nilPage; p = s.next[p] {
		dst = append(dst, p)
	}
	out := Reloaded{Pages: dst, Meta: st.meta}
	if st.n > 0 {
		s.ticket++
		out.Ticket = s.ticket
		s.pending = append(s.pending, release{ticket: s.ticket, head: st.head, tail: st.tail, n: st.n})
		s.npending += int(st.n)
	}
	s.unlink(rid, place, list, slot)
	return out, nil
}

// Fence reports that the copies of every reload up to and including ticket
// have completed, so their pages may be handed out again.
func (s *Session) Fence(ticket uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("fence %d: %w", ticket, poolerr.ErrClosed)
	}
	if ticket > s.ticket {
		return fmt.Errorf("fence %d: %w (last issued %d)", ticket, poolerr.ErrBadFence, s.ticket)
	}
	for s.phead < len(s.pending) && s.pending[s.phead].ticket <= ticket {
		r := s.pending[s.phead]
		s.next[r.tail] = s.freeHead
		s.freeHead = r.head
		s.nfree += int(r.n)
		s.npending -= int(r.n)
		s.phead++
	}
	if s.phead == len(s.pending) {
		s.pending, s.phead = s.pending[:0], 0
	} else if s.phead > 64 && s.phead*2 > len(s.pending) {
		s.pending = append(s.pending[:0], s.pending[s.phead:]...)
		s.phead = 0
	}
	return nil
}

// freeChain returns a stream's pages to the free list at once. It is safe for
// streams whose pages were only ever written by offload copies: a later copy
// into a reused page is ordered behind them on the client's offload stream.
func (s *Session) freeChain(st *stream) {
	if st.n == 0 {
		return
	}
	s.next[st.tail] = s.freeHead
	s.freeHead = st.head
	s.nfree += int(st.n)
}

// Discard drops a stream whose offload was abandoned after the copy; its host
// pages return to the pool at once. Discarding a stream that does not exist
// is a no-op: the seed's engine discards every label it claimed after an
// offload returned false, including the one that was refused.
func (s *Session) Discard(rid, label string) error {
	if err := checkNames(rid, label); err != nil {
		return streamErr("discard", rid, label, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return streamErr("discard", rid, label, poolerr.ErrClosed)
	}
	slot, list, place := s.find(rid, label)
	if slot == nilPage {
		return nil
	}
	s.freeChain(s.at(slot))
	s.unlink(rid, place, list, slot)
	return nil
}

// RemoveRequest drops every stream of rid and returns how many there were.
// Removing a request with no streams is not an error: engines call it for
// every finished request.
func (s *Session) RemoveRequest(rid string) (int, error) {
	if err := checkNames(rid, ""); err != nil {
		return 0, fmt.Errorf("remove_request %q: %w", rid, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, fmt.Errorf("remove_request %q: %w", rid, poolerr.ErrClosed)
	}
	l, place, ok := s.reqs.find(rid)
	if !ok {
		return 0, nil
	}
	if l.n > indexFrom {
		for slot := l.first; slot != nilPage; slot = s.at(slot).next {
			s.unindexLabel(place, slot)
		}
	}
	removed := 0
	for slot := l.first; slot != nilPage; {
		st := s.at(slot)
		next := st.next
		s.freeChain(st)
		s.used -= int(st.n)
		s.nstreams--
		label := len(s.labelOf(slot))
		s.names -= int64(len(rid) + label)
		s.pool.streams.Add(-1)
		s.pool.names.Add(-int64(len(rid) + label))
		s.freeSlotAt(slot)
		removed++
		slot = next
	}
	s.reqs.del(rid)
	return removed, nil
}

// IsOffloaded reports whether rid has any stream.
func (s *Session) IsOffloaded(rid string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.reqs.get(rid)
	return ok
}

// Labels returns rid's labels in the order they were offloaded.
func (s *Session) Labels(rid string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for slot := s.first(rid); slot != nilPage; slot = s.at(slot).next {
		out = append(out, s.labelOf(slot))
	}
	return out
}

// first returns the slot of rid's first stream, or nilPage.
func (s *Session) first(rid string) int32 {
	if l, ok := s.reqs.get(rid); ok {
		return l.first
	}
	return nilPage
}

// NumPages returns the number of host pages the stream holds: 0 for a
// stream that does not exist, as in the seed.
func (s *Session) NumPages(rid, label string) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, streamErr("num_pages", rid, label, poolerr.ErrClosed)
	}
	slot, _, _ := s.find(rid, label)
	if slot == nilPage {
		return 0, nil
	}
	return int(s.at(slot).n), nil
}

// Usage is a session's page accounting.
type Usage struct {
	Capacity int // pages the session may hold
	Used     int // pages held by streams
	Pending  int // released by reloads, waiting for their fence
	Streams  int
	Requests int
	// NameBytes is the length of every stream's request ID plus label,
	// summed over its streams: what the server bounds per session.
	NameBytes int64
}

// Free is what the seed API calls num_free_pages: the pages no stream holds,
// counting those whose release is pending (an offload that needs them waits
// for the fence rather than failing).
func (u Usage) Free() int { return u.Capacity - u.Used }

// Usage returns the session's page accounting.
func (s *Session) Usage() Usage {
	s.mu.Lock()
	defer s.mu.Unlock()
	return Usage{Capacity: s.capacity, Used: s.used, Pending: s.npending, Streams: s.nstreams, Requests: s.reqs.n, NameBytes: s.names}
}

// NumFreePages is the seed API's num_free_pages (see Usage.Free).
func (s *Session) NumFreePages() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.capacity - s.used
}

// Closed reports whether the session has been closed.
func (s *Session) Closed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// dropAll forgets every stream and pending release. Called with s.mu held.
func (s *Session) dropAll() {
	s.pool.streams.Add(-int64(s.nstreams))
	s.pool.names.Add(-s.names)
	s.reqs = reqIndex{}
	s.byLabel = labelIndex{}
	s.slab, s.freeSlot = nil, nilPage
	s.pending, s.phead = nil, 0
	s.used, s.nstreams, s.npending, s.nfree, s.names = 0, 0, 0, 0, 0
	s.seen = nil
	s.releaseLinks()
	s.freeHead, s.fresh = nilPage, int32(s.capacity)
	s.labels, s.labelIdx, s.ownLabels = nil, nil, nil
}
