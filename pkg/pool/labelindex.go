package pool

import "hash/maphash"

// labelIndex finds, by its label, a stream of a request that holds more
// than indexFrom of them (below that a walk of the request's list is
// faster). It is one index for the whole session (tables) keyed by the
// request's place in the request index and the label, each entry the place
// and the stream's slot: no pointers for the collector to trace and no
// allocation per request. It replaced a Go map of labels for each such
// request, which for four sessions of 131,072 streams in requests of 9 made
// each collection take 19-27 ms instead of 1-2, and took 175 bytes a stream
// instead of 74 (docs/benchmarks.md).
//
// An entry's key is found again from its stream (keyAt): the index of an
// interned label, else the label's own bytes, hashed with ridSeed (a
// tenant chooses them). A label is interned, or not, for good (the intern
// table only grows), so both ways of reaching a key agree.
type labelIndex struct {
	tables // entries: place<<32 | slot+1 (labelEntry)
}

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

// labelKey is the key of a label index entry.
func (s *Session) labelKey(e uint64) uint64 { return s.keyAt(entryPlace(e), entrySlot(e)) }

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
	for i := home(k, mask); ; i = (i + 1) & mask {
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
	k := s.keyAt(place, slot)
	if x.needsRoom(x.tabOf(k)) {
		x.makeRoom(k, s.labelKey)
	}
	x.addEntry(k, labelEntry(place, slot))
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
	i := home(k, mask)
	for ; tab[i] != want; i = (i + 1) & mask {
		if tab[i] == 0 {
			return
		}
	}
	x.removeAt(t, i, s.labelKey)
}
