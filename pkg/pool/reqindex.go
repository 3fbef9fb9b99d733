package pool

import (
	"hash/maphash"
	"iter"
)

// reqIndex maps a session's request IDs to their lists of streams. It is a
// table of its own (open addressing, linear probing, backward-shift
// deletion) rather than a Go map, for the restore: a restarted agent
// indexes every request of a session at once, and a map took them one
// cache miss after the other (about half of a large session's rebuild),
// where indexAll computes a batch of hashes and reads their slots
// together before it fills them. The table holds no pointers; a request's
// ID (never empty: checkNames) and list live at its place in two slices
// beside it.
type reqIndex struct {
	slots []uint64  // 0: empty; else the upper half of the ID's hash, then place+1 (entry)
	rids  []string  // place -> request ID; "" for a free place
	lists []ridList // place -> the request's streams
	free  []int32   // free places, reused first
	n     int
	// touched keeps indexAll's early reads from being optimised away.
	touched uint64
}

// ridSeed keys the index's hash: request IDs come from tenants, so where
// they land is not theirs to choose.
var ridSeed = maphash.MakeSeed()

func ridHash(rid string) uint64 { return maphash.String(ridSeed, rid) }

// indexSlots is the table's size for n requests: the least power of two
// (8 at least) that is at least twice n, so that probes stay short.
func indexSlots(n int) int {
	s := 8
	for s < 2*n {
		s <<= 1
	}
	return s
}

func newReqIndex(n int) reqIndex {
	return reqIndex{slots: make([]uint64, indexSlots(n)), rids: make([]string, 0, n), lists: make([]ridList, 0, n)}
}

func entry(h uint64, place int) uint64 { return h&^(1<<32-1) | uint64(place+1) }

func placeOf(e uint64) int { return int(uint32(e)) - 1 }

// home is the slot where the probe for hash h (or for the entry made of
// it: the upper half is the same) starts. It takes the upper half, which
// an entry keeps, so that moving entries (del, grow) needs no ID hashed
// again.
func home(h uint64, mask int) int { return int(h>>32) & mask }

// lookup returns the slot that holds rid (hash h), or the empty slot where
// it would go.
func (x *reqIndex) lookup(rid string, h uint64) (slot int, found bool) {
	if len(x.slots) == 0 {
		return 0, false // the zero index (a dropped session's): put grows it first
	}
	mask := len(x.slots) - 1
	for i := home(h, mask); ; i = (i + 1) & mask {
		e := x.slots[i]
		if e == 0 {
			return i, false
		}
		if e>>32 == h>>32 && x.rids[placeOf(e)] == rid {
			return i, true
		}
	}
}

// get returns rid's list.
func (x *reqIndex) get(rid string) (ridList, bool) {
	if s, ok := x.lookup(rid, ridHash(rid)); ok {
		return x.lists[placeOf(x.slots[s])], true
	}
	return ridList{}, false
}

// put sets rid's list, adding rid when it is not held.
func (x *reqIndex) put(rid string, l ridList) {
	h := ridHash(rid)
	s, ok := x.lookup(rid, h)
	if ok {
		x.lists[placeOf(x.slots[s])] = l
		return
	}
	if 2*(x.n+1) > len(x.slots) {
		x.grow(indexSlots(x.n + 1))
		s, _ = x.lookup(rid, h)
	}
	x.slots[s] = entry(h, x.add(rid, l))
	x.n++
}

// add gives rid and l a place, a free one first, and returns it.
func (x *reqIndex) add(rid string, l ridList) int {
	if k := len(x.free); k > 0 {
		p := int(x.free[k-1])
		x.free = x.free[:k-1]
		x.rids[p], x.lists[p] = rid, l
		return p
	}
	x.rids = append(x.rids, rid)
	x.lists = append(x.lists, l)
	return len(x.rids) - 1
}

// del removes rid, and reports whether it was held.
func (x *reqIndex) del(rid string) bool {
	s, ok := x.lookup(rid, ridHash(rid))
	if !ok {
		return false
	}
	p := placeOf(x.slots[s])
	x.rids[p], x.lists[p] = "", ridList{}
	x.free = append(x.free, int32(p))
	x.n--
	// Backward-shift deletion: the entries after the gap that would no
	// longer be found past it move back (no tombstones, so probes stay as
	// short as the table is full).
	mask := len(x.slots) - 1
	for j := (s + 1) & mask; x.slots[j] != 0; j = (j + 1) & mask {
		e := x.slots[j]
		// e stays where it is when its home lies cyclically in (s, j].
		if at := home(e, mask); (s < j && s < at && at <= j) || (s > j && (s < at || at <= j)) {
			continue
		}
		x.slots[s] = e
		s = j
	}
	x.slots[s] = 0
	return true
}

// grow makes the table again with n slots.
func (x *reqIndex) grow(n int) {
	old := x.slots
	x.slots = make([]uint64, n)
	mask := n - 1
	for _, e := range old {
		if e == 0 {
			continue
		}
		i := home(e, mask)
		for x.slots[i] != 0 {
			i = (i + 1) & mask
		}
		x.slots[i] = e
	}
}

// all yields every request held and its list, in no particular order.
func (x *reqIndex) all() iter.Seq2[string, ridList] {
	return func(yield func(string, ridList) bool) {
		for p, rid := range x.rids {
			if rid != "" && !yield(rid, x.lists[p]) {
				return
			}
		}
	}
}

// indexBatch is how many requests indexAll hashes, and whose slots it
// reads, before it fills them.
const indexBatch = 16

// indexAll indexes the requests of a fresh session's image, those with
// streams, into an empty index made for them: place i is the i-th, and its
// streams take the slots after the previous one's (as fillRequests fills
// them). It returns the first ID listed twice, if any ("" and true: none).
// A table of a large session is larger than the caches: one request at a
// time, each new one missed them in turn; here a batch's first reads,
// independent of each other, miss them together.
func (x *reqIndex) indexAll(reqs []RequestImage) (string, bool) {
	var hs [indexBatch]uint64
	mask := len(x.slots) - 1
	var touched uint64
	slot := int32(0)
	for i := 0; i < len(reqs); {
		lo := len(x.rids)
		for ; i < len(reqs) && len(x.rids)-lo < indexBatch; i++ {
			q := &reqs[i]
			n := int32(len(q.Streams))
			if n == 0 {
				continue
			}
			h := ridHash(q.Rid)
			hs[len(x.rids)-lo] = h
			touched |= x.slots[home(h, mask)]
			x.rids = append(x.rids, q.Rid)
			x.lists = append(x.lists, ridList{first: slot, last: slot + n - 1, n: n})
			slot += n
		}
		for p := lo; p < len(x.rids); p++ {
			h := hs[p-lo]
			s, found := x.lookup(x.rids[p], h)
			if found {
				return x.rids[p], false
			}
			x.slots[s] = entry(h, p)
			x.n++
		}
	}
	x.touched = touched
	return "", true
}
