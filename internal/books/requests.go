package books

import (
	"hash/maphash"
	"iter"
	"slices"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/wire"
)

// requests is a session's streams by request, kept in the order the
// requests were first offloaded (since they were last removed). A replay
// decodes and allocates the streams in that order, so walking them so (the
// image, pool.Restore, the snapshot writer) reads memory in the order it
// was written; walking a map's order instead missed the cache on nearly
// every stream and took twice as long (131,072 streams: pool.Restore 70-99
// ms from map order, 38-56 from this one).
//
// The index from request ID to place in the list is a table of its own
// (open addressing, linear probing) rather than a Go map: an offload of a
// new request finds its empty slot in the one probe that looked the ID up,
// where a map looked up and then inserted (two hashes, two probes: the
// larger part of a replay), and a slot is 8 bytes, not a map's 24 and its
// control byte.
type requests struct {
	list   []request // a removed request leaves a hole (no streams)
	slots  []uint64  // the index: 0 empty, else tag<<32 | place+1 (slotOf)
	holes  int
	sized  int // the requests the index was made for
	remade int // times reserve made the index again
	// slab hands a request opened empty room for its first stream: most
	// requests hold one stream a session (one a layer is still one a
	// label), and one allocation a request was a tenth of a replay.
	slab []stream
	// prefetched keeps prefetch's reads from being optimised away.
	prefetched uint64
}

// slabStreams is how many first streams one allocation of the slab holds.
const slabStreams = 512

// request is a request and its streams in offload order (no streams: a
// hole). It is the pool's own type, so that the image of a session hands
// the pool this list as it is (State.Image).
type request = pool.RequestImage

// ridSeed keys the index's hash: request IDs come from tenants, so where
// they land is not theirs to choose.
var ridSeed = maphash.MakeSeed()

// slotsFor is the index's size for n requests: the least power of two
// (8 at least) that is at least twice n, so that probes stay short. (It
// was twice that for a power of two: 4 MiB, not 2, for a session at its
// bound, each page of it written by a replay.)
func slotsFor(n int) int {
	s := 8
	for s < 2*n {
		s <<= 1
	}
	return s
}

func newRequests(n int) requests {
	return requests{list: make([]request, 0, n), slots: make([]uint64, slotsFor(n)), sized: n}
}

func slotOf(h uint64, place int) uint64 { return h&^(1<<32-1) | uint64(place+1) }

// lookup returns where rid is in the index, or the empty slot where it
// would go, and its hash.
func (r *requests) lookup(rid string) (slot int, h uint64, found bool) {
	return r.lookupHashed(rid, ridHash(rid))
}

// ridHash is rid's hash in the index.
func ridHash(rid string) uint64 { return maphash.String(ridSeed, rid) }

// offloadHash is the hash an offload's request ID is looked up by
// (ridHash); other ops look theirs up themselves, and get 0.
func offloadHash(op server.SessionOp) uint64 {
	if op.Op != wire.OpOffload {
		return 0
	}
	return ridHash(op.Rid)
}

// lookupHashed is lookup of rid, whose hash is h.
func (r *requests) lookupHashed(rid string, h uint64) (slot int, _ uint64, found bool) {
	mask := len(r.slots) - 1
	for i := int(h) & mask; ; i = (i + 1) & mask {
		e := r.slots[i]
		if e == 0 {
			return i, h, false
		}
		if e>>32 == h>>32 && r.list[uint32(e)-1].Rid == rid {
			return i, h, true
		}
	}
}

// place is the list index of the index's entry e.
func place(e uint64) int { return int(uint32(e)) - 1 }

// len is the number of requests held.
func (r *requests) len() int { return len(r.list) - r.holes }

// get is rid's streams (none for a request not held).
func (r *requests) get(rid string) []stream {
	if s, _, ok := r.lookup(rid); ok {
		return r.list[place(r.slots[s])].Streams
	}
	return nil
}

// open is rid's streams to append to, a request not held going last. The
// pointer holds until the next open of another request.
func (r *requests) open(rid string) *[]stream { return r.openHashed(rid, ridHash(rid)) }

// openHashed is open of rid, whose hash is h.
func (r *requests) openHashed(rid string, h uint64) *[]stream {
	s, _, ok := r.lookupHashed(rid, h)
	if ok {
		return &r.list[place(r.slots[s])].Streams
	}
	if n := r.len() + 1; 2*n > len(r.slots) {
		r.rebuild(slotsFor(n))
		s, h, _ = r.lookup(rid)
	}
	i := len(r.list)
	r.slots[s] = slotOf(h, i)
	if len(r.slab) == 0 {
		r.slab = make([]stream, slabStreams)
	}
	// Room for one stream: a second one's append moves them out.
	r.list = append(r.list, request{Rid: rid, Streams: r.slab[:0:1]})
	r.slab = r.slab[1:]
	return &r.list[i].Streams
}

// set replaces the streams of rid, a request held, removing it when none
// are left.
func (r *requests) set(rid string, streams []stream) {
	s, _, ok := r.lookup(rid)
	switch {
	case !ok:
	case len(streams) == 0:
		r.remove(rid)
	default:
		r.list[place(r.slots[s])].Streams = streams
	}
}

// remove drops rid and its streams (nothing when it is not held). Holes
// are closed up once they are over half the list, so a long replay of
// requests coming and going holds no more than twice what it keeps.
func (r *requests) remove(rid string) {
	s, _, ok := r.lookup(rid)
	if !ok {
		return
	}
	r.list[place(r.slots[s])] = request{}
	r.unslot(s)
	r.holes++
	if r.holes < 64 || r.holes*2 < len(r.list) {
		return
	}
	kept := r.list[:0]
	for _, q := range r.list {
		if len(q.Streams) > 0 {
			kept = append(kept, q)
		}
	}
	clear(r.list[len(kept):])
	r.list, r.holes = kept, 0
	r.rebuild(len(r.slots))
}

// unslot empties slot s of the index, moving back the entries after it
// that would no longer be found past the gap (backward-shift deletion: no
// tombstones, so probes stay as short as the table is full).
func (r *requests) unslot(s int) {
	mask := len(r.slots) - 1
	for j := (s + 1) & mask; r.slots[j] != 0; j = (j + 1) & mask {
		e := r.slots[j]
		home := int(maphash.String(ridSeed, r.list[place(e)].Rid)) & mask
		// e stays where it is when its home lies cyclically in (s, j].
		if (s < j && s < home && home <= j) || (s > j && (s < home || home <= j)) {
			continue
		}
		r.slots[s] = e
		s = j
	}
	r.slots[s] = 0
}

// prefetch reads the index's slots where the requests of hashes hs
// begin, one after the other, before a batch of offloads looks them up: a
// table of a large session is larger than the caches, each lookup of a new
// request missed them in turn (about 30 % of the replay of one session of
// 131,072 streams, in process), and these reads, independent of each
// other, miss them together.
func (r *requests) prefetch(hs []uint64) {
	mask := len(r.slots) - 1
	var x uint64
	for _, h := range hs {
		x |= r.slots[int(h)&mask]
	}
	r.prefetched = x
}

// rebuild makes the index again with n slots, from the list.
func (r *requests) rebuild(n int) {
	if n == len(r.slots) {
		clear(r.slots)
	} else {
		r.slots = make([]uint64, n)
	}
	mask := n - 1
	for i, q := range r.list {
		if len(q.Streams) == 0 {
			continue
		}
		h := maphash.String(ridSeed, q.Rid)
		j := int(h) & mask
		for r.slots[j] != 0 {
			j = (j + 1) & mask
		}
		r.slots[j] = slotOf(h, i)
	}
}

// reserve makes room for n more requests than are held, without a
// rebuild as they come (a table made for fewer is made again and again).
func (r *requests) reserve(n int) {
	if r.len()+n <= r.sized {
		return
	}
	r.sized = r.len() + n
	r.remade++
	r.rebuild(slotsFor(r.sized))
	r.list = slices.Grow(r.list, n)
}

// all yields each request held and its streams, in first-offload order.
func (r *requests) all() iter.Seq2[string, []stream] {
	return func(yield func(string, []stream) bool) {
		for _, q := range r.list {
			if len(q.Streams) > 0 && !yield(q.Rid, q.Streams) {
				return
			}
		}
	}
}
