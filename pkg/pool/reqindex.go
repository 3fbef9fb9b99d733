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
// own is (span), so that a session's index is a few tables and blocks of
// flat values however many requests it holds. The collector has none of
// them to trace, a request costs its ID's bytes and its place (20 bytes:
// the span and its list), not a string's 16-byte header and its own
// allocation besides, and an offload of a new request copies its ID
// instead of keeping the caller's string. A removed request's bytes go on
// a list of free spans of their length, which the next ID of that length
// takes (engines' IDs come and go at a few lengths, so names stops
// growing); should more than half of names lie dead all the same (IDs of
// ever new lengths) when an ID needs a new block, the live IDs are packed
// again first (pack), each byte of ID copied about once per byte removed.
// Not at a removal: packed there, a session at its bound draining its
// requests one by one copied what it still held into fresh blocks each
// time half of names had died (8 MiB of 128-byte IDs: a removal of 24-52
// ms on a VM whose first touch of a page costs 11 us, then 12-16, 4-8 ...);
// a drained session packs, if ever, when it grows again, little as it then
// holds, and until then keeps no more than it held.
type reqIndex struct {
	// tables is the index, keyed by the ID's hash, each entry its upper
	// half and the place (entry): the entry is its own key (a nil
	// keyFunc).
	tables
	names nameBlocks // the request IDs, back to back, with the dead ones' bytes
	// places: place -> where its ID lies in names and its streams (none
	// for a free place), in blocks that never move.
	places blocks[place]
	free   blocks[int32] // free places, reused first (a stack)
	dead   int           // bytes of names no request holds
	// freed: by length, the first of the free spans of that length in
	// names (offset+1; 0: none), each holding the next one's in its
	// first 4 bytes; IDs shorter than that are not reused. Made at the
	// first removal.
	freed []uint32
	// touched keeps indexAll's early reads from being optimised away.
	touched uint64
}

// place is a request's ID and its streams: the two a lookup that finds the
// request reads, side by side.
type place struct {
	span nameSpan
	list ridList
}

// blockShift makes a block of places 4,096 of them (80 KiB).
const (
	blockShift = 12
	blockLen   = 1 << blockShift
)

// blocks is an array that grows without moving what it holds: its first
// block grows as it fills (a session of a few requests takes little),
// every later one is made whole. A slice grown by append copied every
// element into fresh memory in the call that found it full (the places of
// a session at its bound: 4.4 and 8.8 ms at 99,669 and 110,592 requests on
// the VM above).
type blocks[T any] struct {
	b     [][]T
	n     int
	spare []T // room set aside for the next blocks (sized)
}

// sized is an empty array whose first n elements take their blocks from
// one allocation (a restore knows how many it adds).
func sized[T any](n int) blocks[T] {
	if n <= blockLen {
		return blocks[T]{b: [][]T{make([]T, 0, n)}}
	}
	return blocks[T]{spare: make([]T, (n+blockLen-1)&^(blockLen-1))}
}

func (a *blocks[T]) at(i int) *T { return &a.b[i>>blockShift][i&(blockLen-1)] }

func (a *blocks[T]) len() int { return a.n }

// push appends v and returns its index.
func (a *blocks[T]) push(v T) int {
	k, i := a.n>>blockShift, a.n&(blockLen-1)
	if k == len(a.b) {
		var b []T
		switch {
		case len(a.spare) >= blockLen:
			b, a.spare = a.spare[:0:blockLen], a.spare[blockLen:]
		case k > 0:
			b = make([]T, 0, blockLen)
		}
		a.b = append(a.b, b)
	}
	if i < len(a.b[k]) {
		a.b[k][i] = v // a place pop left
	} else {
		a.b[k] = append(a.b[k], v)
	}
	a.n++
	return a.n - 1
}

// pop removes the last element and returns it; its block stays for the
// next push.
func (a *blocks[T]) pop() T {
	a.n--
	return *a.at(a.n)
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

// fitsLast reports whether an ID of n bytes fits in the last block, so
// that adding it makes no block.
func (nb *nameBlocks) fitsLast(n int) bool {
	k := len(nb.b) - 1
	return k >= 0 && len(nb.b[k])+n <= nameBlock
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

// packFrom is the least dead bytes worth packing names for (add).
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
	sp := x.places.at(p).span
	return x.names.at(sp.off, sp.n)
}

// list is the streams of the request at place p.
func (x *reqIndex) list(p int) ridList { return x.places.at(p).list }

// setList sets the streams of the request at place p.
func (x *reqIndex) setList(p int, l ridList) { x.places.at(p).list = l }

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

// newReqIndex is an empty index made for n requests. From splitAt the
// tables are left for indexAll to make, each for the requests it takes.
func newReqIndex(n int) reqIndex {
	x := reqIndex{places: sized[place](n)}
	if n < splitAt {
		x.makeFor(n)
	}
	return x
}

// entry is the index's entry for the request at place, its ID's hash h:
// the upper half of h, which chooses its table and its home, then place+1.
func entry(h uint64, place int) uint64 { return h&^(1<<32-1) | uint64(place+1) }

func placeOf(e uint64) int { return int(uint32(e)) - 1 }

// lookup returns the table and the slot that hold rid (hash h), or the
// empty slot where it would go.
func (x *reqIndex) lookup(rid string, h uint64) (t, slot int, found bool) {
	if len(x.tabs) == 0 {
		return 0, 0, false // the zero index (a dropped session's): put makes it first
	}
	t = x.tabOf(h)
	tab := x.tabs[t]
	mask := len(tab) - 1
	for i := home(h, mask); ; i = (i + 1) & mask {
		e := tab[i]
		if e == 0 {
			return t, i, false
		}
		if e>>32 == h>>32 && string(x.rid(placeOf(e))) == rid {
			return t, i, true
		}
	}
}

// find returns rid's list and its place.
func (x *reqIndex) find(rid string) (ridList, int, bool) {
	if t, s, ok := x.lookup(rid, ridHash(rid)); ok {
		p := placeOf(x.tabs[t][s])
		return x.list(p), p, true
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
	t, s, ok := x.lookup(rid, h)
	if ok {
		x.setList(placeOf(x.tabs[t][s]), l)
		return
	}
	if x.needsRoom(t) {
		x.makeRoom(h, nil)
		t, s, _ = x.lookup(rid, h)
	}
	x.tabs[t][s] = entry(h, x.add(rid, l))
	x.tabN[t]++
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
		if !x.names.fitsLast(len(rid)) && x.dead >= packFrom && 2*x.dead > x.names.size {
			x.pack()
		}
		sp.off = x.names.add(rid)
	}
	if x.free.len() > 0 {
		p := int(x.free.pop())
		*x.places.at(p) = place{sp, l}
		return p
	}
	return x.places.push(place{sp, l})
}

// del removes rid, and reports whether it was held.
func (x *reqIndex) del(rid string) bool {
	t, s, ok := x.lookup(rid, ridHash(rid))
	if !ok {
		return false
	}
	p := placeOf(x.tabs[t][s])
	pl := x.places.at(p)
	if sp := pl.span; sp.n >= minFreed && sp.n <= MaxNameLen {
		if x.freed == nil {
			x.freed = make([]uint32, MaxNameLen+1)
		}
		binary.LittleEndian.PutUint32(x.names.at(sp.off, sp.n), x.freed[sp.n])
		x.freed[sp.n] = sp.off + 1
	}
	x.dead += int(pl.span.n)
	*pl = place{}
	x.free.push(int32(p))
	x.removeAt(t, s, nil)
	return true
}

// pack copies the live request IDs back to back into fresh blocks, in
// place order, dropping the dead bytes.
func (x *reqIndex) pack() {
	names := newNameBlocks(x.names.size - x.dead)
	for p := range x.places.len() {
		pl := x.places.at(p)
		if sp := pl.span; sp.n != 0 {
			pl.span.off = names.add(unsafe.String(&x.names.at(sp.off, sp.n)[0], sp.n))
		}
	}
	x.names, x.dead = names, 0
	clear(x.freed)
}

// all yields every request held (its ID a string of its own) and its
// list, in no particular order.
func (x *reqIndex) all() iter.Seq2[string, ridList] {
	return func(yield func(string, ridList) bool) {
		for p := range x.places.len() {
			if pl := x.places.at(p); pl.span.n != 0 && !yield(string(x.rid(p)), pl.list) {
				return
			}
		}
	}
}

// indexBatch is how many entries indexAll reads the home slots of before
// it fills them.
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
	bytes, n := 0, 0
	for i := range reqs {
		if len(reqs[i].Streams) > 0 {
			bytes += len(reqs[i].Rid)
			n++
		}
	}
	if bytes > maxNames || bytes > maxBlocked {
		return fmt.Errorf("%w: the request IDs take %d bytes, more than a session's %d", poolerr.ErrFull, bytes, min(maxNames, maxBlocked))
	}
	x.names = newNameBlocks(bytes)
	// Each request hashed once, its entry kept until the tables are
	// made: split (newReqIndex left none), each for as many as it takes.
	shift := x.shift
	if len(x.tabs) == 0 {
		shift = 64 - tabBits
	}
	entries := make([]uint64, 0, n)
	var counts [1 << tabBits]int32
	slot := int32(0)
	for i := range reqs {
		q := &reqs[i]
		k := int32(len(q.Streams))
		if k == 0 {
			continue
		}
		h := ridHash(q.Rid)
		p := x.places.push(place{nameSpan{off: x.names.add(q.Rid), n: uint32(len(q.Rid))}, ridList{first: slot, last: slot + k - 1, n: k}})
		entries = append(entries, entry(h, p))
		counts[h>>shift]++
		slot += k
	}
	if len(x.tabs) == 0 {
		sizes := make([]int, 1<<tabBits)
		for t := range sizes {
			sizes[t] = indexSlots(int(counts[t]))
		}
		x.make(1<<tabBits, sizes)
	}
	var touched uint64
	for lo := 0; lo < len(entries); lo += indexBatch {
		batch := entries[lo:min(lo+indexBatch, len(entries))]
		for _, e := range batch {
			tab := x.tabs[x.tabOf(e)]
			touched |= tab[home(e, len(tab)-1)]
		}
		for _, e := range batch {
			if err := x.insertNew(e); err != nil {
				return err
			}
		}
	}
	x.touched = touched
	return nil
}

// insertNew adds entry e to an index being filled by indexAll, refusing
// an ID another entry holds.
func (x *reqIndex) insertNew(e uint64) error {
	if x.needsRoom(x.tabOf(e)) {
		x.makeRoom(e, nil) // not made for this many
	}
	t := x.tabOf(e)
	tab := x.tabs[t]
	mask := len(tab) - 1
	rid := x.rid(placeOf(e))
	i := home(e, mask)
	for ; tab[i] != 0; i = (i + 1) & mask {
		if o := tab[i]; o>>32 == e>>32 && string(x.rid(placeOf(o))) == string(rid) {
			return fmt.Errorf("request %q: %w", rid, errListedTwice)
		}
	}
	tab[i] = e
	x.tabN[t]++
	x.n++
	return nil
}
