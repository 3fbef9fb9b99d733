package pool

import "fmt"

// tables is the hash index under both of a session's indexes, the request
// index (reqIndex) and the label index (labelIndex): open addressing,
// linear probing, backward-shift deletion, entries of one word (0 marks an
// empty slot) and nothing the collector traces. It is one table until it
// holds splitAt entries, then 1<<tabBits, an entry in the one the top bits
// of its key name (tabOf), each doubling alone when one more entry would
// fill it past 9/16 (over). One table doubling rehashed every entry into
// fresh memory in the call that found it full (6.3 ms at 65,536 requests,
// 8.5 ms at 65,536 labelled streams, on a VM whose first touch of a page
// costs 11 us); a table of the split index holds about 1/64 of them.
//
// An entry's key is the 64-bit hash it was placed by: the top bits choose
// its table, bits 32 up its home slot (home). The index that owns the
// entries says how to find an entry's key again (a keyFunc): the label
// index hashes the stream's label again; the request index keeps the key's
// upper half in the entry itself, which is then its own key (a nil
// keyFunc, so that its removals call no function for the entries they
// shift: 8 ns of an offload and removal's 190 when they did).
type tables struct {
	tabs  [][]uint64
	tabN  []int32 // entries in each table
	shift uint    // 64 with one table (tabOf is then 0), 64-tabBits once split
	n     int
}

// The split index: tabBits of the key choose the table, from splitAt
// entries. The home slot is taken from the key's bits 32 up, which the
// table's choice (its top bits) leaves alone up to 1<<(32-tabBits) slots a
// table (past that the homes would crowd into part of a table: slower,
// still right; the server's limits keep a session's tables far below it).
const (
	tabBits = 6
	splitAt = 4096
)

// keyFunc returns the key an entry was placed by; nil: the entry is its
// own key.
type keyFunc func(e uint64) uint64

// of is entry e's key.
func (key keyFunc) of(e uint64) uint64 {
	if key == nil {
		return e
	}
	return key(e)
}

// tabOf is the table of key k.
func (x *tables) tabOf(k uint64) int { return int(k >> x.shift) }

// home is the slot where the probe for key k starts in a table of mask+1
// slots.
func home(k uint64, mask int) int { return int(k>>32) & mask }

// indexSlots is a table's size for n entries: the least power of two (8
// at least) that they fill to at most 9/16 (over), so that probes stay
// short. (The bound was 1/2: a split index at a session's bound, 131,072
// requests, holds 2,048 a table on average, give or take 45, so half its
// tables were made or grew to twice the slots a table of 2,048 needs: 1.5
// times the one table's memory, every page of it written by a restore.)
func indexSlots(n int) int {
	s := 8
	for over(n, s) {
		s <<= 1
	}
	return s
}

// over reports whether n entries fill a table of slots past 9/16.
func over(n, slots int) bool { return 16*n > 9*slots }

// needsRoom reports whether one more entry for table t (tabOf) needs room
// made first (makeRoom): no tables yet, the one table at splitAt entries,
// or table t over with it.
func (x *tables) needsRoom(t int) bool {
	return len(x.tabs) == 0 || x.shift == 64 && x.n+1 >= splitAt || over(int(x.tabN[t])+1, len(x.tabs[t]))
}

// makeRoom makes room for one more entry of key k (needsRoom): the first
// table, the split, or k's table twice the slots.
func (x *tables) makeRoom(k uint64, key keyFunc) {
	switch {
	case len(x.tabs) == 0:
		x.makeFor(0)
	case x.shift == 64 && x.n+1 >= splitAt:
		x.split(key)
	default:
		t := x.tabOf(k)
		old := x.tabs[t]
		x.tabs[t] = make([]uint64, 2*len(old))
		for _, e := range old {
			if e != 0 {
				insert(x.tabs[t], key.of(e), e)
			}
		}
	}
}

// make makes the index k empty tables (1, or 1<<tabBits) of the given
// sizes.
func (x *tables) make(k int, sizes []int) {
	x.tabs, x.tabN, x.shift, x.n = carve(sizes), make([]int32, k), 64, 0
	if k > 1 {
		x.shift = 64 - tabBits
	}
}

// makeFor makes the index empty tables for n entries: one below splitAt,
// else 1<<tabBits, each sized for an even share (a table that gets more
// grows as it fills).
func (x *tables) makeFor(n int) {
	k := 1
	if n >= splitAt {
		k = 1 << tabBits
	}
	sizes := make([]int, k)
	for t := range sizes {
		sizes[t] = indexSlots(n / k)
	}
	x.make(k, sizes)
}

// split makes the one table 1<<tabBits, each sized for the entries it
// takes and one more.
func (x *tables) split(key keyFunc) {
	old := x.tabs[0]
	shift := uint(64 - tabBits)
	counts := make([]int, 1<<tabBits)
	for _, e := range old {
		if e != 0 {
			counts[key.of(e)>>shift]++
		}
	}
	for t, c := range counts {
		counts[t] = indexSlots(c + 1)
	}
	x.make(1<<tabBits, counts)
	for _, e := range old {
		if e != 0 {
			x.addEntry(key.of(e), e)
		}
	}
}

// addEntry puts entry e, of key k, in its table, which has room for it.
func (x *tables) addEntry(k, e uint64) {
	t := x.tabOf(k)
	insert(x.tabs[t], k, e)
	x.tabN[t]++
	x.n++
}

// carve makes tables of the given sizes in one allocation, each capped at
// its own length: the collector sweeps one object where a split index had
// 64 (a full collection with four sessions of 131,072 streams in requests
// of nine took 0.4-0.8 ms longer with a span a table). A table that grows
// later takes memory of its own; the block goes once the last has.
func carve(sizes []int) [][]uint64 {
	total := 0
	for _, n := range sizes {
		total += n
	}
	block := make([]uint64, total)
	tabs := make([][]uint64, len(sizes))
	for t, n := range sizes {
		tabs[t], block = block[:n:n], block[n:]
	}
	return tabs
}

// insert puts entry e, of key k, in the first empty slot of tab from its
// home.
func insert(tab []uint64, k, e uint64) {
	mask := len(tab) - 1
	i := home(k, mask)
	for tab[i] != 0 {
		i = (i + 1) & mask
	}
	tab[i] = e
}

// removeAt empties slot s of table t. Backward-shift deletion: the entries
// after the gap that would no longer be found past it move back (no
// tombstones, so probes stay as short as the table is full).
func (x *tables) removeAt(t, s int, key keyFunc) {
	tab := x.tabs[t]
	x.tabN[t]--
	x.n--
	mask := len(tab) - 1
	for j := (s + 1) & mask; tab[j] != 0; j = (j + 1) & mask {
		e := tab[j]
		// e stays where it is when its home lies cyclically in (s, j].
		if at := home(key.of(e), mask); (s < j && s < at && at <= j) || (s > j && (s < at || at <= j)) {
			continue
		}
		tab[s] = e
		s = j
	}
	tab[s] = 0
}

// checkTables checks the tables' shape (one table below splitAt entries,
// 1<<tabBits from it, each a power of two from 8 slots, at most over full,
// counting its entries) and that every entry lies in its key's table and
// passes ok; it returns the entries. what names the index in errors.
func (x *tables) checkTables(what string, key keyFunc, ok func(e uint64) error) (int, error) {
	if len(x.tabs) != len(x.tabN) || (len(x.tabs) > 0 && len(x.tabs) != 1<<(64-x.shift)) {
		return 0, fmt.Errorf("the %s has %d tables and %d counts (shift %d)", what, len(x.tabs), len(x.tabN), x.shift)
	}
	if len(x.tabs) == 1 && x.n >= splitAt {
		return 0, fmt.Errorf("the %s is one table of %d entries; it splits at %d", what, x.n, splitAt)
	}
	entries := 0
	for t, tab := range x.tabs {
		if len(tab) < 8 || len(tab)&(len(tab)-1) != 0 {
			return 0, fmt.Errorf("table %d of the %s has %d slots, not a power of two from 8", t, what, len(tab))
		}
		n := 0
		for _, e := range tab {
			if e == 0 {
				continue
			}
			n++
			if k := x.tabOf(key.of(e)); k != t {
				return 0, fmt.Errorf("table %d of the %s holds an entry of table %d", t, what, k)
			}
			if err := ok(e); err != nil {
				return 0, err
			}
		}
		if n != int(x.tabN[t]) || over(n, len(tab)) {
			return 0, fmt.Errorf("table %d of the %s holds %d entries in %d slots; its count says %d", t, what, n, len(tab), x.tabN[t])
		}
		entries += n
	}
	if entries != x.n {
		return 0, fmt.Errorf("the %s holds %d entries; its count says %d", what, entries, x.n)
	}
	return entries, nil
}
