package pool

import (
	"encoding/binary"
	"fmt"
	"hash/maphash"
	"iter"
	"unsafe"

	"github.com/kvpool/kvpool/pkg/poolerr"
)

// reqIndex maps a session's request IDs to their lists of streams. It is a
// table of its own (open addressing, linear probing, backward-shift
// deletion) rather than a Go map, for the restore: a restarted agent
// indexes every request of a session at once, and a map took them one
// cache miss after the other (about half of a large session's rebuild),
// where indexAll computes a batch of hashes and reads their slots
// together before it fills them.
//
// Nothing in it is a pointer: the request IDs (never empty: checkNames)
// lie back to back in blocks of bytes, names, each place saying where its
// own is (span), so that a session's index is a few flat slices however
// many requests it holds. The collector has none of them to trace, a
// request costs its ID's bytes and 8 more, not a string's 16-byte header
// and its own allocation, and an offload of a new request copies its ID
// instead of keeping the caller's string. A removed request's bytes go on
// a list of free spans of their length, which the next ID of that length
// takes (engines' IDs come and go at a few lengths, so names stops
// growing); should more than half of names lie dead all the same (IDs of
// ever new lengths), the live IDs are packed again (pack), each byte of ID
// copied about once per byte removed.
type reqIndex struct {
	slots []uint64   // 0: empty; else the upper half of the ID's hash, then place+1 (entry)
	names nameBlocks // the request IDs, back to back, with the dead ones' bytes
	spans []nameSpan // place -> where its ID lies in names; none for a free place
	lists []ridList  // place -> the request's streams
	free  []int32    // free places, reused first
	n     int
	dead  int // bytes of names no request holds
	// freed: by length, the first of the free spans of that length in
	// names (offset+1; 0: none), each holding the next one's in its
	// first 4 bytes; IDs shorter than that are not reused. Made at the
	// first removal.
	freed []uint32
	// touched keeps indexAll's early reads from being optimised away.
	touched uint64
}

// nameSpan is where a request ID lies in names; n is 0 for a free place.
type nameSpan struct{ off, n uint32 }

// nameShift makes a block of names 64 KiB: an ID (at most MaxNameLen
// bytes) never spans two, and its offset is its block's index shifted by
// nameShift, plus where it lies in the block.
const (
	nameShift = 16
	nameBlock = 1 << nameShift
	// firstNames is the least room of a session's first block, which
	// grows as it fills (a session of a few requests takes little); every
	// later block is made whole.
	firstNames = 64
)

// nameBlocks holds a session's request IDs in blocks of nameBlock bytes.
// Held in one byte slice, names grew by a quarter at a time, each time
// copying every ID into fresh memory in the call of the offload that
// found it full: filling a session to its bound with 128-byte IDs, the
// slowest offload took 93-129 ms (BenchmarkFillToTheBound; 7 ms with the
// blocks). A block is never moved: the first grows to nameBlock, and the
// next ID that does not fit in the last block starts a new one.
type nameBlocks struct {
	b    [][]byte
	size int // bytes in the blocks (the IDs', the dead ones' included)
	// spare is memory set aside for the next blocks (newNameBlocks): a
	// restore or a pack, which know how many bytes they will add, take
	// their blocks from one allocation.
	spare []byte
}

// newNameBlocks is a store made for n bytes of IDs, and the ends of
// blocks they leave unused.
func newNameBlocks(n int) nameBlocks {
	if n <= 0 {
		return nameBlocks{}
	}
	if n <= nameBlock {
		return nameBlocks{b: [][]byte{make([]byte, 0, max(n, firstNames))}}
	}
	// A block ends where the next ID does not fit: at most MaxNameLen-1
	// of its bytes stay unused.
	const least = nameBlock - MaxNameLen + 1
	return nameBlocks{spare: make([]byte, (n+least-1)/least*nameBlock)}
}

// fits reports whether an ID of n bytes can be added without passing
// maxNames bytes, or the blocks an offset can name.
func (nb *nameBlocks) fits(n int) bool {
	if nb.size+n > maxNames {
		return false
	}
	k := len(nb.b) - 1
	return k >= 0 && len(nb.b[k])+n <= nameBlock || len(nb.b) < 1<<(32-nameShift)
}

// add copies rid into the store and returns its offset. The caller
// checked that it fits.
func (nb *nameBlocks) add(rid string) uint32 {
	k := len(nb.b) - 1
	if k >= 0 {
		if b := nb.b[k]; len(b)+len(rid) <= nameBlock {
			nb.b[k] = append(b, rid...)
			nb.size += len(rid)
			return uint32(k)<<nameShift | uint32(len(b))
		}
	}
	return nb.addBlock(rid)
}

// addBlock is add where the last block cannot take rid (or there is
// none): rid starts a new one.
func (nb *nameBlocks) addBlock(rid string) uint32 {
	var b []byte
	switch {
	case len(nb.spare) >= nameBlock:
		b, nb.spare = nb.spare[:0:nameBlock], nb.spare[nameBlock:]
	case len(nb.b) == 0:
		b = make([]byte, 0, max(firstNames, len(rid)))
	default:
		b = make([]byte, 0, nameBlock)
	}
	nb.b = append(nb.b, append(b, rid...))
	nb.size += len(rid)
	return uint32(len(nb.b)-1) << nameShift
}

// maxBlocked is the most bytes of IDs that the blocks an offset can name
// surely hold, however IDs of up to MaxNameLen bytes leave their ends
// unused.
const maxBlocked = (1 << (32 - nameShift)) * (nameBlock - MaxNameLen + 1)

// at is the n bytes at off.
func (nb *nameBlocks) at(off, n uint32) []byte {
	w := off & (nameBlock - 1)
	return nb.b[off>>nameShift][w : w+n]
}

// within reports whether the n bytes at off lie in the store.
func (nb *nameBlocks) within(off, n uint32) bool {
	k, w := int(off>>nameShift), int(off&(nameBlock-1))
	return k < len(nb.b) && w+int(n) <= len(nb.b[k])
}

// packFrom is the least dead bytes worth packing names for.
const packFrom = 64 << 10

// maxNames bounds the bytes of names (its offsets are 32 bits). An
// offload of a new request that would take it past the bound is refused
// (full), after packing; the server's limits on name bytes hold a session
// far below it.
// A variable for tests.
var maxNames = 1<<32 - 1

// minFreed is the shortest ID whose bytes are reused (a free span holds
// the next one's offset).
const minFreed = 4

// reusable reports whether a removed ID of n bytes left its bytes free.
func (x *reqIndex) reusable(n int) bool {
	return n >= minFreed && n < len(x.freed) && x.freed[n] != 0
}

// rid is the ID at place p, as bytes of names (valid until names changes).
func (x *reqIndex) rid(p int) []byte {
	sp := x.spans[p]
	return x.names.at(sp.off, sp.n)
}

// full reports whether an ID of n more bytes does not fit in names, even
// once the dead ones are packed away.
func (x *reqIndex) full(n int) bool {
	if x.names.fits(n) || x.reusable(n) {
		return false
	}
	x.pack()
	return !x.names.fits(n)
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
	return reqIndex{slots: make([]uint64, indexSlots(n)), spans: make([]nameSpan, 0, n), lists: make([]ridList, 0, n)}
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
		if e>>32 == h>>32 && string(x.rid(placeOf(e))) == rid {
			return i, true
		}
	}
}

// find returns rid's list and its place.
func (x *reqIndex) find(rid string) (ridList, int, bool) {
	if s, ok := x.lookup(rid, ridHash(rid)); ok {
		p := placeOf(x.slots[s])
		return x.lists[p], p, true
	}
	return ridList{}, -1, false
}

// get returns rid's list.
func (x *reqIndex) get(rid string) (ridList, bool) {
	l, _, ok := x.find(rid)
	return l, ok
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

// add gives rid (a copy of it) and l a place, a free one first, and
// returns it. The caller has made sure the ID fits (full).
func (x *reqIndex) add(rid string, l ridList) int {
	sp := nameSpan{n: uint32(len(rid))}
	if n := len(rid); x.reusable(n) {
		sp.off = x.freed[n] - 1
		b := x.names.at(sp.off, sp.n)
		x.freed[n] = binary.LittleEndian.Uint32(b)
		copy(b, rid)
		x.dead -= n
	} else {
		sp.off = x.names.add(rid)
	}
	if k := len(x.free); k > 0 {
		p := int(x.free[k-1])
		x.free = x.free[:k-1]
		x.spans[p], x.lists[p] = sp, l
		return p
	}
	x.spans = append(x.spans, sp)
	x.lists = append(x.lists, l)
	return len(x.spans) - 1
}

// del removes rid, and reports whether it was held.
func (x *reqIndex) del(rid string) bool {
	s, ok := x.lookup(rid, ridHash(rid))
	if !ok {
		return false
	}
	p := placeOf(x.slots[s])
	if sp := x.spans[p]; sp.n >= minFreed && sp.n <= MaxNameLen {
		if x.freed == nil {
			x.freed = make([]uint32, MaxNameLen+1)
		}
		binary.LittleEndian.PutUint32(x.names.at(sp.off, sp.n), x.freed[sp.n])
		x.freed[sp.n] = sp.off + 1
	}
	x.dead += int(x.spans[p].n)
	x.spans[p], x.lists[p] = nameSpan{}, ridList{}
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
	if x.dead >= packFrom && 2*x.dead > x.names.size {
		x.pack()
	}
	return true
}

// pack copies the live request IDs back to back into fresh blocks, in
// place order, dropping the dead bytes.
func (x *reqIndex) pack() {
	names := newNameBlocks(x.names.size - x.dead)
	for p, sp := range x.spans {
		if sp.n == 0 {
			continue
		}
		x.spans[p].off = names.add(unsafe.String(&x.names.at(sp.off, sp.n)[0], sp.n))
	}
	x.names, x.dead = names, 0
	clear(x.freed)
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

// all yields every request held (its ID a string of its own) and its
// list, in no particular order.
func (x *reqIndex) all() iter.Seq2[string, ridList] {
	return func(yield func(string, ridList) bool) {
		for p, sp := range x.spans {
			if sp.n != 0 && !yield(string(x.rid(p)), x.lists[p]) {
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
// them). It refuses a request listed twice, and IDs of more bytes in all
// than names holds.
// A table of a large session is larger than the caches: one request at a
// time, each new one missed them in turn; here a batch's first reads,
// independent of each other, miss them together.
func (x *reqIndex) indexAll(reqs []RequestImage) error {
	var hs [indexBatch]uint64
	var rs [indexBatch]string
	bytes := 0
	for i := range reqs {
		if len(reqs[i].Streams) > 0 {
			bytes += len(reqs[i].Rid)
		}
	}
	if bytes > maxNames || bytes > maxBlocked {
		return fmt.Errorf("%w: the request IDs take %d bytes, more than a session's %d", poolerr.ErrFull, bytes, min(maxNames, maxBlocked))
	}
	x.names = newNameBlocks(bytes)
	mask := len(x.slots) - 1
	var touched uint64
	slot := int32(0)
	for i := 0; i < len(reqs); {
		lo := len(x.spans)
		for ; i < len(reqs) && len(x.spans)-lo < indexBatch; i++ {
			q := &reqs[i]
			n := int32(len(q.Streams))
			if n == 0 {
				continue
			}
			h := ridHash(q.Rid)
			hs[len(x.spans)-lo], rs[len(x.spans)-lo] = h, q.Rid
			touched |= x.slots[home(h, mask)]
			x.spans = append(x.spans, nameSpan{off: x.names.add(q.Rid), n: uint32(len(q.Rid))})
			x.lists = append(x.lists, ridList{first: slot, last: slot + n - 1, n: n})
			slot += n
		}
		for p := lo; p < len(x.spans); p++ {
			h, rid := hs[p-lo], rs[p-lo]
			s, found := x.lookup(rid, h)
			if found {
				return fmt.Errorf("request %q: %w", rid, errListedTwice)
			}
			x.slots[s] = entry(h, p)
			x.n++
		}
	}
	x.touched = touched
	return nil
}
