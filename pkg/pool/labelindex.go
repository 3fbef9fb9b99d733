package pool

import "hash/maphash"

// labelIndex finds, by its label, a stream of a request that holds more
// than indexFrom of them (below that a walk of the request's list is
// faster). It is one table for the whole session (open addressing, linear
// probing, backward-shift deletion) keyed by the request's place in the
// request index and the label, each entry the place and the stream's
// slot: no pointers for the collector to trace and no allocation per
// request. It replaced a Go map of labels for each such request, which
// for four sessions of 131,072 streams in requests of 9 made each
// collection take 19-27 ms instead of 1-2, and took 175 bytes a stream
// instead of 74 (docs/benchmarks.md).
//
// An entry's key is found again from its stream (labelKey): the index of
// an interned label, else the label's own bytes, hashed with ridSeed (a
// tenant chooses them). A label is interned, or not, for good (the intern
// table only grows), so both ways of reaching a key agree.
//
// As the request index, it is one table until it holds splitAt entries,
// then 1<<tabBits, an entry in the one the top bits of its key's hash
// name (tabOf), each growing alone: one table doubling held an offload up
// for 8.5 ms at 65,536 streams in requests of 80 on a VM whose first touch
// of a page costs 11 us.
type labelIndex struct {
	tabs  [][]uint64 // 0: empty; else place<<32 | slot+1 (labelEntry)
	tabN  []int32
	shift uint // 64 with one table (tabOf is then 0), 64-tabBits once split
	n     int
}

// tabOf is the table of the entries whose key hashes to k.
func (x *labelIndex) tabOf(k uint64) int { return int(k >> x.shift) }

func labelEntry(place int, slot int32) uint64 {
	return uint64(uint32(place))<<32 | uint64(uint32(slot+1))
}

func entryPlace(e uint64) int { return int(e >> 32) }

func entrySlot(e uint64) int32 { return int32(uint32(e)) - 1 }

// labelHash is the hash of the key (place, label): interned labels by
// their index in the intern table (i >= 0), the others by h, their bytes'
// hash.
func labelHash(place int, i int32, h uint64) uint64 {
	k := uint64(uint32(place))<<32 | uint64(uint32(i))
	if i == ownLabel {
		k ^= h
	}
	// A finaliser (MurmurHash3's) spreads keys that differ in a few bits
	// over the table.
	k ^= k >> 33
	k *= 0xff51afd7ed558ccd
	k ^= k >> 33
	k *= 0xc4ceb9fe1a85ec53
	return k ^ k>>33
}

// keyOf is the hash of (place, label) for a label as a caller names it.
func (s *Session) keyOf(place int, label string) uint64 {
	if i, ok := s.labelIdx[label]; ok {
		return labelHash(place, i, 0)
	}
	return labelHash(place, ownLabel, maphash.String(ridSeed, label))
}

// keyAt is the hash of the key of the stream in slot, of the request at
// place.
func (s *Session) keyAt(place int, slot int32) uint64 {
	if i := s.at(slot).label; i != ownLabel {
		return labelHash(place, i, 0)
	}
	return labelHash(place, ownLabel, maphash.String(ridSeed, s.ownLabels[slot]))
}

// findLabel returns the slot of label's stream of the request at place,
// or nilPage.
func (s *Session) findLabel(place int, label string) int32 {
	x := &s.byLabel
	if x.n == 0 {
		return nilPage
	}
	k := s.keyOf(place, label)
	tab := x.tabs[x.tabOf(k)]
	mask := len(tab) - 1
	for i := int(k) & mask; ; i = (i + 1) & mask {
		e := tab[i]
		if e == 0 {
			return nilPage
		}
		if entryPlace(e) == place && s.labelOf(entrySlot(e)) == label {
			return entrySlot(e)
		}
	}
}

// indexLabel adds the stream in slot, of the request at place, to the
// label index.
func (s *Session) indexLabel(place int, slot int32) {
	x := &s.byLabel
	switch {
	case len(x.tabs) == 0:
		s.makeLabels(1, 0)
	case x.shift == 64 && x.n+1 >= splitAt:
		s.makeLabels(1<<tabBits, x.n+1)
	}
	k := s.keyAt(place, slot)
	t := x.tabOf(k)
	if over(int(x.tabN[t])+1, len(x.tabs[t])) {
		s.growLabels(t)
	}
	insertLabel(x.tabs[t], k, labelEntry(place, slot))
	x.tabN[t]++
	x.n++
}

// unindexLabel removes the stream in slot, of the request at place, from
// the label index (nothing when it is not there).
func (s *Session) unindexLabel(place int, slot int32) {
	x := &s.byLabel
	if x.n == 0 {
		return
	}
	k := s.keyAt(place, slot)
	t := x.tabOf(k)
	tab := x.tabs[t]
	mask := len(tab) - 1
	want := labelEntry(place, slot)
	i := int(k) & mask
	for ; tab[i] != want; i = (i + 1) & mask {
		if tab[i] == 0 {
			return
		}
	}
	x.tabN[t]--
	x.n--
	// Backward-shift deletion, as in the request index.
	for j := (i + 1) & mask; tab[j] != 0; j = (j + 1) & mask {
		e := tab[j]
		at := int(s.keyAt(entryPlace(e), entrySlot(e))) & mask
		if (i < j && i < at && at <= j) || (i > j && (i < at || at <= j)) {
			continue
		}
		tab[i] = e
		i = j
	}
	tab[i] = 0
}

// makeLabels makes the label index k tables (1, or 1<<tabBits), each
// sized for its share of n entries, and places its entries again. A table
// that gets more than it was sized for grows as it fills.
func (s *Session) makeLabels(k, n int) {
	x := &s.byLabel
	old := x.tabs
	x.tabN, x.shift = make([]int32, k), 64
	if k > 1 {
		x.shift = 64 - tabBits
	}
	sizes := make([]int, k)
	for t := range sizes {
		sizes[t] = indexSlots(n / k)
	}
	x.tabs = carve(sizes)
	for _, tab := range old {
		for _, e := range tab {
			if e == 0 {
				continue
			}
			key := s.keyAt(entryPlace(e), entrySlot(e))
			t := x.tabOf(key)
			if over(int(x.tabN[t])+1, len(x.tabs[t])) {
				s.growLabels(t)
			}
			insertLabel(x.tabs[t], key, e)
			x.tabN[t]++
		}
	}
}

// growLabels makes table t of the label index twice its slots.
func (s *Session) growLabels(t int) {
	x := &s.byLabel
	old := x.tabs[t]
	x.tabs[t] = make([]uint64, 2*len(old))
	for _, e := range old {
		if e != 0 {
			insertLabel(x.tabs[t], s.keyAt(entryPlace(e), entrySlot(e)), e)
		}
	}
}

// insertLabel puts entry e, whose key hashes to k, in the first empty
// slot of tab from its home.
func insertLabel(tab []uint64, k, e uint64) {
	mask := len(tab) - 1
	i := int(k) & mask
	for tab[i] != 0 {
		i = (i + 1) & mask
	}
	tab[i] = e
}
