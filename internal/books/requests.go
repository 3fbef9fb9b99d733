package books

import (
	"iter"
	"slices"
)

// requests is a session's streams by request, kept in the order the
// requests were first offloaded (since they were last removed). A replay
// decodes and allocates the streams in that order, so walking them so (the
// image, pool.Restore, the snapshot writer) reads memory in the order it
// was written; walking a map's order instead missed the cache on nearly
// every stream and took twice as long (131,072 streams: pool.Restore 70-99
// ms from map order, 38-56 from this one).
type requests struct {
	list   []request        // a removed request leaves a hole (no streams)
	index  map[string]int32 // a request's place in list
	holes  int
	sized  int // the requests index was made for
	remade int // times reserve made the index again
	// slab hands a request opened empty room for its first stream: most
	// requests hold one stream a session (one a layer is still one a
	// label), and one allocation a request was a tenth of a replay.
	slab []stream
}

// slabStreams is how many first streams one allocation of the slab holds.
const slabStreams = 512

type request struct {
	rid     string
	streams []stream // in offload order; empty: a hole
}

func newRequests(n int) requests {
	return requests{list: make([]request, 0, n), index: make(map[string]int32, n), sized: n}
}

// len is the number of requests held.
func (r *requests) len() int { return len(r.index) }

// get is rid's streams (none for a request not held).
func (r *requests) get(rid string) []stream {
	if i, ok := r.index[rid]; ok {
		return r.list[i].streams
	}
	return nil
}

// open is rid's streams to append to, a request not held going last. The
// pointer holds until the next open of another request.
func (r *requests) open(rid string) *[]stream {
	i, ok := r.index[rid]
	if !ok {
		i = int32(len(r.list))
		r.index[rid] = i
		if len(r.slab) == 0 {
			r.slab = make([]stream, slabStreams)
		}
		// Room for one stream: a second one's append moves them out.
		r.list = append(r.list, request{rid: rid, streams: r.slab[:0:1]})
		r.slab = r.slab[1:]
	}
	return &r.list[i].streams
}

// set replaces the streams of rid, a request held, removing it when none
// are left.
func (r *requests) set(rid string, streams []stream) {
	i, ok := r.index[rid]
	switch {
	case !ok:
	case len(streams) == 0:
		r.remove(rid)
	default:
		r.list[i].streams = streams
	}
}

// remove drops rid and its streams (nothing when it is not held). Holes
// are closed up once they are over half the list, so a long replay of
// requests coming and going holds no more than twice what it keeps.
func (r *requests) remove(rid string) {
	i, ok := r.index[rid]
	if !ok {
		return
	}
	delete(r.index, rid)
	r.list[i] = request{}
	r.holes++
	if r.holes < 64 || r.holes*2 < len(r.list) {
		return
	}
	kept := r.list[:0]
	for _, q := range r.list {
		if len(q.streams) > 0 {
			r.index[q.rid] = int32(len(kept))
			kept = append(kept, q)
		}
	}
	clear(r.list[len(kept):])
	r.list, r.holes = kept, 0
}

// reserve makes room for n more requests than are held, without a
// rehash as they come (a table made for fewer splits again and again).
func (r *requests) reserve(n int) {
	if len(r.index)+n <= r.sized {
		return
	}
	r.sized = len(r.index) + n
	r.remade++
	index := make(map[string]int32, r.sized)
	for rid, i := range r.index {
		index[rid] = i
	}
	r.index = index
	r.list = slices.Grow(r.list, n)
}

// all yields each request held and its streams, in first-offload order.
func (r *requests) all() iter.Seq2[string, []stream] {
	return func(yield func(string, []stream) bool) {
		for _, q := range r.list {
			if len(q.streams) > 0 && !yield(q.rid, q.streams) {
				return
			}
		}
	}
}
