package pool

import (
	"encoding/binary"
	"fmt"
	"slices"
)

// Check verifies the session's invariants: every page is on exactly one list
// (free, a stream, or a pending release), the counts add up to the capacity,
// and every page lies inside the session's bound chunks. It is meant for
// tests and debugging; it walks every page.
func (s *Session) Check() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	if s.capacity > len(s.chunks)*s.ppc {
		return fmt.Errorf("capacity %d exceeds %d chunks of %d pages", s.capacity, len(s.chunks), s.ppc)
	}
	if err := s.reqs.check(); err != nil {
		return fmt.Errorf("request index: %w", err)
	}
	if s.fresh < 0 || int(s.fresh) > s.capacity {
		return fmt.Errorf("untouched pages from %d, outside [0, %d]", s.fresh, s.capacity)
	}
	if s.listedFree() < 0 {
		return fmt.Errorf("%d free pages, fewer than the %d untouched ones", s.nfree, s.capacity-int(s.fresh))
	}
	owner := make([]byte, s.capacity) // 0 unseen, 1 seen
	for p := s.fresh; int(p) < s.capacity; p++ {
		owner[p] = 1 // free, on no list: a list that holds one holds it twice
	}
	if err := s.checkList(owner, "free list", s.freeHead, nilPage, s.listedFree()); err != nil {
		return err
	}
	if err := s.checkStreams(owner); err != nil {
		return err
	}
	if err := s.checkPending(owner); err != nil {
		return err
	}
	if s.nfree+s.used+s.npending != s.capacity {
		return fmt.Errorf("free %d + used %d + pending %d != capacity %d", s.nfree, s.used, s.npending, s.capacity)
	}
	for i, w := range s.seen {
		if w != 0 {
			return fmt.Errorf("duplicate-check scratch word %d not cleared", i)
		}
	}
	return nil
}

// checkList walks the page list from head: n pages inside the capacity,
// none seen on another list (owner marks them), ending at tail (nilPage:
// the list keeps no tail).
func (s *Session) checkList(owner []byte, what string, head, tail int32, n int) error {
	count, last := 0, int32(nilPage)
	for p := head; p != nilPage; p = s.next[p] {
		if p < 0 || int(p) >= s.capacity {
			return fmt.Errorf("%s: page %d outside [0, %d)", what, p, s.capacity)
		}
		if owner[p] != 0 {
			return fmt.Errorf("%s: page %d is on two lists", what, p)
		}
		owner[p] = 1
		count++
		last = p
		if count > s.capacity {
			return fmt.Errorf("%s: cycle", what)
		}
	}
	if count != n {
		return fmt.Errorf("%s: %d pages linked, %d recorded", what, count, n)
	}
	if tail != nilPage && tail != last {
		return fmt.Errorf("%s: tail %d, last page %d", what, tail, last)
	}
	return nil
}

// checkStreams checks every request's list of streams, their label index
// and their pages, and the stream and page counters.
func (s *Session) checkStreams(owner []byte) error {
	used, streams, own, indexed := 0, 0, 0, 0
	placeOfSlot := map[int32]int{}
	for rid, l := range s.reqs.all() {
		if l.first == nilPage || l.last == nilPage {
			return fmt.Errorf("request %q has no streams", rid)
		}
		_, place, _ := s.reqs.find(rid)
		labels := map[string]bool{}
		prev := int32(nilPage)
		for slot := l.first; slot != nilPage; slot = s.at(slot).next {
			st := s.at(slot)
			label, err := s.checkLabel(slot)
			if err != nil {
				return fmt.Errorf("request %q: %w", rid, err)
			}
			if st.label == ownLabel {
				own++
			}
			if labels[label] {
				return fmt.Errorf("stream %q/%q listed twice", rid, label)
			}
			labels[label] = true
			if st.prev != prev {
				return fmt.Errorf("stream %q/%q: back link %d, want %d", rid, label, st.prev, prev)
			}
			if l.n > indexFrom {
				if got := s.findLabel(place, label); got != slot {
					return fmt.Errorf("stream %q/%q: the label index finds slot %d, not %d", rid, label, got, slot)
				}
				placeOfSlot[slot] = place
				indexed++
			}
			if err := s.checkList(owner, fmt.Sprintf("stream %q/%q", rid, label), st.head, st.tail, int(st.n)); err != nil {
				return err
			}
			used += int(st.n)
			streams++
			prev = slot
		}
		if prev != l.last || int(l.n) != len(labels) {
			return fmt.Errorf("request %q: last stream %d, count %d; list ends at %d after %d", rid, l.last, l.n, prev, len(labels))
		}
	}
	if used != s.used || streams != s.nstreams {
		return fmt.Errorf("streams hold %d pages in %d streams, counters say %d in %d", used, streams, s.used, s.nstreams)
	}
	if own != len(s.ownLabels) {
		return fmt.Errorf("%d streams keep their own label, %d own labels kept", own, len(s.ownLabels))
	}
	return s.checkLabelIndex(indexed, placeOfSlot)
}

// checkLabelIndex checks that the label index holds the indexed streams
// of the requests of more than indexFrom (placeOfSlot: each one's
// request's place) and nothing else, within its load.
func (s *Session) checkLabelIndex(indexed int, placeOfSlot map[int32]int) error {
	n, err := s.byLabel.checkTables("label index", s.labelKey, func(e uint64) error {
		if p, ok := placeOfSlot[entrySlot(e)]; !ok || p != entryPlace(e) {
			return fmt.Errorf("the label index holds slot %d at place %d, which is no indexed stream of that request", entrySlot(e), entryPlace(e))
		}
		return nil
	})
	if err == nil && n != indexed {
		err = fmt.Errorf("the label index holds %d entries for %d indexed streams", n, indexed)
	}
	return err
}

// checkLabel returns the label of the stream in slot: an index into the
// intern table, or a label of its own that the table does not hold.
func (s *Session) checkLabel(slot int32) (string, error) {
	i := s.at(slot).label
	if i == ownLabel {
		l, ok := s.ownLabels[slot]
		if _, interned := s.labelIdx[l]; !ok || interned || len(s.labels) < maxInterned {
			return "", fmt.Errorf("slot %d: own label %q kept %v, interned %v, table of %d", slot, l, ok, interned, len(s.labels))
		}
		return l, nil
	}
	if i < 0 || int(i) >= len(s.labels) || s.labelIdx[s.labels[i]] != i {
		return "", fmt.Errorf("slot %d: label index %d, table of %d", slot, i, len(s.labels))
	}
	return s.labels[i], nil
}

// checkPending checks the pending releases: tickets in order, their pages,
// and the pending counter.
func (s *Session) checkPending(owner []byte) error {
	pending := 0
	var lastTicket uint64
	for _, r := range s.pending[s.phead:] {
		if r.ticket <= lastTicket || r.ticket > s.ticket {
			return fmt.Errorf("pending ticket %d out of order (after %d, last issued %d)", r.ticket, lastTicket, s.ticket)
		}
		lastTicket = r.ticket
		if err := s.checkList(owner, fmt.Sprintf("pending release %d", r.ticket), r.head, r.tail, int(r.n)); err != nil {
			return err
		}
		pending += int(r.n)
	}
	if pending != s.npending {
		return fmt.Errorf("pending releases hold %d pages, counter says %d", pending, s.npending)
	}
	return nil
}

// Check verifies the pool's invariants: chunk states agree with allocations,
// each chunk is bound to at most one session, and that session is open and
// belongs to the chunk's allocation. It also checks every open session.
func (p *Pool) Check() error {
	p.mu.Lock()
	var sessions []*Session
	err := func() error {
		if len(p.order) != len(p.chunks) {
			return fmt.Errorf("%d chunks listed, %d indexed", len(p.order), len(p.chunks))
		}
		for _, ch := range p.order {
			if p.chunks[ch.ID] != ch {
				return fmt.Errorf("chunk %s listed but not indexed", ch.ID)
			}
			switch {
			case ch.state == ChunkGranted && (ch.alloc == nil || p.allocs[ch.alloc.id] != ch.alloc):
				return fmt.Errorf("chunk %s granted to no live allocation", ch.ID)
			case ch.state != ChunkGranted && ch.alloc != nil:
				return fmt.Errorf("chunk %s is %s but names allocation %s", ch.ID, ch.state, ch.alloc.id)
			case ch.session != nil && ch.alloc != ch.session.alloc:
				return fmt.Errorf("chunk %s bound to a session of another allocation", ch.ID)
			}
		}
		for id, a := range p.allocs {
			for _, ch := range a.chunks {
				if ch.alloc != a || ch.state != ChunkGranted {
					return fmt.Errorf("allocation %s holds chunk %s in state %s", id, ch.ID, ch.state)
				}
			}
			for s := range a.sessions {
				for _, ch := range s.chunks {
					if ch.session != s {
						return fmt.Errorf("session on %s lists chunk %s bound elsewhere", id, ch.ID)
					}
				}
				sessions = append(sessions, s)
			}
		}
		return nil
	}()
	p.mu.Unlock()
	if err != nil {
		return err
	}
	for _, s := range sessions {
		if err := s.Check(); err != nil {
			return err
		}
	}
	return nil
}

// check verifies the request index: every request held is found at its
// place, every slot names a place held once, the counts agree with the
// free places, and the IDs' spans lie in names without overlapping, the
// bytes between them counted dead.
func (x *reqIndex) check() error {
	if err := x.checkPlaces(); err != nil {
		return err
	}
	held, live := 0, 0
	type span struct{ off, end int }
	var spans []span
	for p := range x.places.len() {
		sp := x.places.at(p).span
		if sp.n == 0 {
			continue
		}
		held++
		if !x.names.within(sp.off, sp.n) {
			return fmt.Errorf("the ID at place %d lies at %d+%d, outside the %d blocks of names", p, sp.off, sp.n, len(x.names.b))
		}
		live += int(sp.n)
		spans = append(spans, span{int(sp.off), int(sp.off + sp.n)})
		rid := string(x.rid(p))
		t, s, ok := x.lookup(rid, ridHash(rid))
		if !ok || placeOf(x.tabs[t][s]) != p {
			return fmt.Errorf("request %q at place %d is not found there", rid, p)
		}
	}
	// The free spans, by length: each within names, as long as its list
	// says; with the IDs', none overlapping another (so no list loops).
	free := 0
	for n, next := range x.freed {
		for k := 0; next != 0; k++ {
			off := int(next - 1)
			if n < minFreed || !x.names.within(uint32(off), uint32(n)) || k > x.names.size/minFreed {
				return fmt.Errorf("a free span of %d bytes at %d, outside the %d blocks of names", n, off, len(x.names.b))
			}
			spans = append(spans, span{off, off + n})
			free += n
			next = binary.LittleEndian.Uint32(x.names.at(uint32(off), uint32(n)))
		}
	}
	slices.SortFunc(spans, func(a, b span) int { return a.off - b.off })
	for i := 1; i < len(spans); i++ {
		if spans[i].off < spans[i-1].end {
			return fmt.Errorf("two spans of names (request IDs or free) share bytes %d-%d", spans[i].off, spans[i-1].end)
		}
	}
	if free > x.dead {
		return fmt.Errorf("%d bytes of names in free spans, %d counted dead", free, x.dead)
	}
	inBlocks := 0
	for _, b := range x.names.b {
		inBlocks += len(b)
	}
	if live+x.dead != x.names.size || inBlocks != x.names.size {
		return fmt.Errorf("names holds %d bytes (%d in its blocks): %d of IDs held and %d dead", x.names.size, inBlocks, live, x.dead)
	}
	used, err := x.checkTables("request index", nil, func(e uint64) error {
		if p := placeOf(e); p >= x.places.len() || x.places.at(p).span.n == 0 {
			return fmt.Errorf("a slot names place %d, which holds no request", p)
		}
		return nil
	})
	if err != nil {
		return err
	}
	freed := make(map[int32]bool, x.free.len())
	for i := range x.free.len() {
		p := *x.free.at(i)
		if p < 0 || int(p) >= x.places.len() || x.places.at(int(p)).span.n != 0 || freed[p] {
			return fmt.Errorf("the free places list place %d, which is not a free place of the %d, or twice", p, x.places.len())
		}
		freed[p] = true
	}
	if held != x.n || used != x.n || x.free.len() != x.places.len()-x.n {
		return fmt.Errorf("%d requests held, %d slots used, %d places free of %d; the count says %d",
			held, used, x.free.len(), x.places.len(), x.n)
	}
	return nil
}

// checkPlaces checks that the blocks of places hold as many as they count,
// every block but the first whole and none moved out of its length.
func (x *reqIndex) checkPlaces() error {
	a := &x.places
	k := (a.n + blockLen - 1) >> blockShift
	if len(a.b) != k && !(a.n == 0 && len(a.b) <= 1) {
		return fmt.Errorf("%d places in %d blocks", a.n, len(a.b))
	}
	in := 0
	for i, b := range a.b {
		if i < len(a.b)-1 && len(b) != blockLen {
			return fmt.Errorf("block %d of places holds %d, not %d", i, len(b), blockLen)
		}
		in += len(b)
	}
	if in != a.n {
		return fmt.Errorf("the blocks of places hold %d; the count says %d", in, a.n)
	}
	return nil
}
