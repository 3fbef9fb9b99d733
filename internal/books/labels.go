package books

import "slices"

// A replay finds a request's stream by its label for every reload and
// discard it applies, and checks each offload's label against the
// request's streams. A walk of the request's list did, and a removal
// shifted the streams after it down: both cost as many streams as the
// request holds, so a request of n streams replayed in time n², and one of
// a session's 131,072 streams would have held a restart (and every
// compaction) up for seconds. A request of more than indexFrom streams
// gets, the first time a replay looks in it, a map from label to place in
// its list (big), and a removal from it leaves a hole where the stream
// was, noted in a bitmap, until holes are as many as streams, or the
// request is down to indexFrom: then the list is closed up again. The
// replay closes every list up before it returns the state, and every walk
// of the streams (the snapshot, the image, the count) does first, so none
// of them sees a hole; a state without holes is only read by them, so the
// image and the fresh books' snapshot may walk it side by side.

// indexFrom is the most streams a request's list holds that a replay walks
// to find one by its label.
const indexFrom = 8

// bigRequest is the label index of one request of more than indexFrom
// streams, and the holes of its list.
type bigRequest struct {
	at    map[string]int // label -> place in the list, for the streams held
	holes []uint64       // bitmap over the list: the places whose stream is gone
	n     int            // holes
}

func (b *bigRequest) hole(i int) bool { return i/64 < len(b.holes) && b.holes[i/64]&(1<<(i%64)) != 0 }

// big returns rid's label index (its list is list), made when the list is
// longer than indexFrom and none is; nil for a shorter list.
func (s *Session) big(rid string, list []stream) *bigRequest {
	if len(list) <= indexFrom {
		return nil
	}
	if b := s.bigs[rid]; b != nil {
		return b
	}
	b := &bigRequest{at: make(map[string]int, len(list))}
	for i, x := range list {
		b.at[x.Label] = i
	}
	if s.bigs == nil {
		s.bigs = map[string]*bigRequest{}
	}
	s.bigs[rid] = b
	return b
}

// find is the place of label's stream in rid's list, or -1.
func (s *Session) find(rid, label string) int { return s.findIn(rid, s.reqs.get(rid), label) }

// findIn is find in rid's list, list.
func (s *Session) findIn(rid string, list []stream, label string) int {
	if b := s.big(rid, list); b != nil {
		if i, ok := b.at[label]; ok {
			return i
		}
		return -1
	}
	return indexOf(list, label)
}

// indexOf is the place of label's stream in a short list, or -1.
func indexOf(list []stream, label string) int {
	for i, x := range list {
		if x.Label == label {
			return i
		}
	}
	return -1
}

// added notes the stream just appended to rid's list.
func (s *Session) added(rid string, list []stream) {
	if b := s.bigs[rid]; b != nil {
		b.at[list[len(list)-1].Label] = len(list) - 1
	}
}

// drop removes the stream at place i of rid's list: the places after it
// move down in a short list; in a long one it leaves a hole.
func (s *Session) drop(rid string, list []stream, i int) {
	b := s.bigs[rid]
	if b == nil {
		s.reqs.set(rid, slices.Delete(list, i, i+1))
		return
	}
	delete(b.at, list[i].Label)
	list[i] = stream{}
	if w := i / 64; w >= len(b.holes) {
		b.holes = append(b.holes, make([]uint64, w+1-len(b.holes))...)
	}
	b.holes[i/64] |= 1 << (i % 64)
	b.n++
	end := len(list)
	for end > 0 && b.hole(end-1) { // holes at the end go at once
		end--
		b.holes[end/64] &^= 1 << (end % 64)
		b.n--
	}
	list = list[:end]
	if live := len(list) - b.n; live <= indexFrom || b.n > live {
		s.closeUp(rid, list, b)
		return
	}
	s.reqs.set(rid, list)
}

// closeUp moves rid's streams over the holes of its list, keeping their
// order, and drops the label index where the request is down to indexFrom.
func (s *Session) closeUp(rid string, list []stream, b *bigRequest) {
	j := 0
	for i, x := range list {
		if !b.hole(i) {
			list[j] = x
			j++
		}
	}
	clear(list[j:])
	list = list[:j]
	clear(b.holes)
	b.n = 0
	if j <= indexFrom {
		delete(s.bigs, rid)
	} else {
		for i, x := range list {
			b.at[x.Label] = i
		}
	}
	s.reqs.set(rid, list)
}

// closeUpAll closes up every list with holes, before a walk of them.
func (s *Session) closeUpAll() {
	for rid, b := range s.bigs {
		if b.n > 0 {
			s.closeUp(rid, s.reqs.get(rid), b)
		}
	}
}
