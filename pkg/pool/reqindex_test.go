package pool

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"unsafe"
)

// TestReqIndexAgainstMap puts, replaces and deletes request IDs at random
// in the index and in a Go map, over sizes that make the table grow and
// deletions shift entries across its end, and checks that both hold the
// same lists and that the index's invariants hold.
func TestReqIndexAgainstMap(t *testing.T) {
	for _, keys := range []int{3, 40, 3000, 3 * splitAt} {
		t.Run(fmt.Sprintf("keys=%d", keys), func(t *testing.T) {
			r := rand.New(rand.NewPCG(uint64(keys), 11))
			var x reqIndex // the zero index: a dropped session's
			want := map[string]ridList{}
			for i := range 20 * keys {
				rid := fmt.Sprintf("req-%d", r.IntN(keys))
				switch r.IntN(5) {
				case 0, 1, 2:
					l := ridList{first: int32(i), last: int32(i + 1), n: int32(r.IntN(9) + 1)}
					x.put(rid, l)
					want[rid] = l
				case 3:
					_, held := want[rid]
					if got := x.del(rid); got != held {
						t.Fatalf("step %d: del(%q) = %v, the map held it: %v", i, rid, got, held)
					}
					delete(want, rid)
				case 4:
					l, ok := x.get(rid)
					if wl, wok := want[rid]; ok != wok || l != wl {
						t.Fatalf("step %d: get(%q) = %v, %v; want %v, %v", i, rid, l, ok, wl, wok)
					}
				}
				if i%max(97, keys) == 0 || i == 20*keys-1 {
					if err := x.check(); err != nil {
						t.Fatalf("step %d: %v", i, err)
					}
				}
			}
			if x.n != len(want) {
				t.Fatalf("index holds %d, the map %d", x.n, len(want))
			}
			seen := 0
			for rid, l := range x.all() {
				if want[rid] != l {
					t.Fatalf("all yields %q: %v; the map has %v", rid, l, want[rid])
				}
				seen++
			}
			if seen != len(want) {
				t.Fatalf("all yields %d requests, the map holds %d", seen, len(want))
			}
		})
	}
}

// TestReqIndexAll: indexAll places the requests with streams in the order
// listed, skipping those without, gives each the slots after the previous
// one's, finds each of them, and names the first ID listed twice.
func TestReqIndexAll(t *testing.T) {
	// Request i holds i%3 streams: every third one none (a hole).
	reqs := func(n int, more ...string) []RequestImage {
		out := make([]RequestImage, 0, n+len(more))
		for i := range n {
			out = append(out, RequestImage{Rid: fmt.Sprintf("r%04d", i), Streams: make([]StreamImage, i%3)})
		}
		for _, rid := range more {
			out = append(out, RequestImage{Rid: rid, Streams: make([]StreamImage, 1)})
		}
		return out
	}
	for _, tc := range []struct {
		name string
		reqs []RequestImage
		dup  string
	}{
		{"none", nil, ""},
		{"a hole alone", reqs(1), ""},
		{"one", reqs(2)[1:], ""},
		{"a batch and a half", reqs(3 * (indexBatch + indexBatch/2) / 2), ""},
		{"many", reqs(1000), ""},
		{"a hole's ID again, with streams", reqs(5, "r0003"), ""},
		{"twice in a batch", reqs(5, "r0002"), "r0002"},
		{"twice across batches", reqs(3*indexBatch, "r0001", "r0007"), "r0001"},
		{"split", reqs(2 * splitAt), ""},
		{"split, twice", reqs(2*splitAt, "r5000"), "r5000"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n, withStreams := 0, map[string]bool{}
			for _, q := range tc.reqs {
				if len(q.Streams) > 0 {
					n++
					withStreams[q.Rid] = true
				}
			}
			x := newReqIndex(n)
			err := x.indexAll(tc.reqs)
			if tc.dup != "" {
				if !errors.Is(err, errListedTwice) || !strings.Contains(err.Error(), strconv.Quote(tc.dup)) {
					t.Fatalf("indexAll = %v; want %q listed twice", err, tc.dup)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := x.check(); err != nil {
				t.Fatal(err)
			}
			place, slot := 0, int32(0)
			for _, q := range tc.reqs {
				l, held := x.get(q.Rid)
				k := int32(len(q.Streams))
				if k == 0 {
					if held != withStreams[q.Rid] {
						t.Fatalf("%q, listed without streams: held %v", q.Rid, held)
					}
					continue
				}
				if want := (ridList{first: slot, last: slot + k - 1, n: k}); !held || l != want || string(x.rid(place)) != q.Rid {
					t.Fatalf("%q: %v, %v at place %d (%q); want %v", q.Rid, l, held, place, x.rid(place), want)
				}
				place, slot = place+1, slot+k
			}
			if x.n != n {
				t.Fatalf("%d requests held, %d listed with streams", x.n, n)
			}
		})
	}
}

// TestReqIndexGrowsInPieces: filling an index one request at a time, no
// put moves more than a sixty-fourth of the entries or so once the index
// holds splitAt requests (the one table it had until then is split, each
// table growing alone), and no whole block of places ever moves; with one
// table doubling, or places in one slice, the put that found it full moved
// them all.
func TestReqIndexGrowsInPieces(t *testing.T) {
	const n = 40 * splitAt
	var x reqIndex
	firsts := map[int]*place{}
	most := 0
	for i := range n {
		before := make([]*uint64, len(x.tabs))
		for t, tab := range x.tabs {
			before[t] = unsafe.SliceData(tab)
		}
		x.put(fmt.Sprintf("request-%07d", i), ridList{n: int32(i + 1)})
		moved := 0
		for t, tab := range x.tabs {
			if len(before) != len(x.tabs) || before[t] != unsafe.SliceData(tab) {
				moved += int(x.tabN[t])
			}
		}
		if i+1 == splitAt {
			if len(x.tabs) != 1<<tabBits {
				t.Fatalf("%d tables at %d requests", len(x.tabs), i+1)
			}
			continue // the split: every entry moves, once
		}
		if i+1 > splitAt {
			most = max(most, moved)
		}
		// The first block grows as it fills; the later ones stay put.
		for k := 1; k < len(x.places.b); k++ {
			if p, ok := firsts[k]; !ok {
				firsts[k] = &x.places.b[k][0]
			} else if p != &x.places.b[k][0] {
				t.Fatalf("after %d requests block %d of places moved", i+1, k)
			}
		}
	}
	if bound := 4 * n >> tabBits; most > bound {
		t.Fatalf("a put moved %d entries (of %d); want at most %d", most, n, bound)
	}
	if err := x.check(); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if l, ok := x.get(fmt.Sprintf("request-%07d", i)); !ok || l.n != int32(i+1) {
			t.Fatalf("request %d: %v %v", i, l, ok)
		}
	}
	t.Logf("%d requests: a put moved at most %d entries", n, most)
}

// TestReqIndexNames: the index keeps its own copy of each request ID (the
// caller's bytes may change after); an ID takes the bytes a removed one of
// its length left, so that requests coming and going at one length keep
// names at the size the live ones need; and IDs of ever new lengths, whose
// removed bytes no later ID takes, are packed once more than half of names
// is dead, which keeps names within twice what the live IDs take (and
// packFrom). Every request held is found throughout.
func TestReqIndexNames(t *testing.T) {
	var x reqIndex
	buf := []byte("caller-owned-id")
	x.put(unsafe.String(&buf[0], len(buf)), ridList{first: 1, last: 1, n: 1})
	copy(buf, "overwritten-xyz")
	if _, ok := x.get("caller-owned-id"); !ok {
		t.Fatal("the index lost a request ID whose caller's bytes changed after the put")
	}
	if _, ok := x.get("overwritten-xyz"); ok {
		t.Fatal("the index found an ID it was never given: it kept the caller's bytes")
	}
	x.del("caller-owned-id")

	t.Run("one length", func(t *testing.T) {
		var x reqIndex
		var held []string
		for i := range 1000 {
			held = append(held, fmt.Sprintf("request-%012d", i))
			x.put(held[i], ridList{n: 1})
		}
		size := x.names.size
		r := rand.New(rand.NewPCG(1, 2))
		for i := range 20_000 {
			k := r.IntN(len(held))
			if !x.del(held[k]) {
				t.Fatalf("step %d: %q not held", i, held[k])
			}
			held[k] = fmt.Sprintf("request-%012d", 1000+i)
			x.put(held[k], ridList{n: 1})
			if x.names.size != size {
				t.Fatalf("step %d: names grew from %d to %d bytes with 1,000 IDs of one length held", i, size, x.names.size)
			}
		}
		if err := x.check(); err != nil {
			t.Fatal(err)
		}
		for _, rid := range held {
			if _, ok := x.get(rid); !ok {
				t.Fatalf("%q lost", rid)
			}
		}
	})
	t.Run("new lengths", func(t *testing.T) {
		var x reqIndex
		held := map[string]bool{}
		next, packs := 0, 0
		for round := range 12 {
			long := strings.Repeat("r", 100+7*round) // a length no earlier round used
			for range 1000 {
				rid := fmt.Sprintf("%s-%06d", long, next)
				next++
				before, blocks := x.names.size, len(x.names.b)
				x.put(rid, ridList{n: 1})
				held[rid] = true
				if x.names.size < before {
					packs++
				}
				// Wherever a put made a block, names is at most twice
				// what is held, or what is held and packFrom.
				if live := x.names.size - x.dead; len(x.names.b) != blocks && x.names.size > max(2*live, live+packFrom) {
					t.Fatalf("round %d: names is %d bytes for %d live", round, x.names.size, live)
				}
			}
			k := 0
			for rid := range held {
				if k == 1000-round%3*100 {
					break
				}
				if !x.del(rid) {
					t.Fatalf("round %d: %q not held", round, rid)
				}
				delete(held, rid)
				k++
			}
			if err := x.check(); err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
			for rid := range held {
				if _, ok := x.get(rid); !ok {
					t.Fatalf("round %d: %q lost", round, rid)
				}
			}
		}
		if packs < 3 {
			t.Fatalf("names packed %d times over 12 rounds of new lengths", packs)
		}
	})
}

// TestNameBlocks: request IDs of every length up to MaxNameLen fill blocks
// of names, none spanning two; a block, once made, is never moved (an
// offload copies its own ID and no other), the first starts small, and
// every ID reads back whole through removals, reuse of their bytes and
// a pack.
func TestNameBlocks(t *testing.T) {
	var x reqIndex
	x.put("r", ridList{n: 1})
	if c := cap(x.names.b[0]); c >= nameBlock {
		t.Fatalf("one request of 1 byte took a block of %d bytes", c)
	}
	x.del("r")
	var held []string
	first := map[int]*byte{} // a block's first byte, as it was made
	for i := 0; len(x.names.b) < 6; i++ {
		n := 8 + i*37%(MaxNameLen-7)
		rid := fmt.Sprintf("%0*d", n, i)
		x.put(rid, ridList{n: int32(i)})
		held = append(held, rid)
		for k := 1; k < len(x.names.b); k++ {
			if p, ok := first[k]; !ok {
				first[k] = unsafe.SliceData(x.names.b[k])
			} else if p != unsafe.SliceData(x.names.b[k]) {
				t.Fatalf("after %d IDs block %d moved", i+1, k)
			}
		}
	}
	for p := range x.places.len() {
		if sp := x.places.at(p).span; sp.n != 0 && int(sp.off&(nameBlock-1))+int(sp.n) > nameBlock {
			t.Fatalf("the ID at place %d spans two blocks (%d+%d)", p, sp.off, sp.n)
		}
	}
	check := func(when string) {
		t.Helper()
		if err := x.check(); err != nil {
			t.Fatalf("%s: %v", when, err)
		}
		for i, rid := range held {
			if rid == "" {
				continue
			}
			if l, ok := x.get(rid); !ok || l.n != int32(i) {
				t.Fatalf("%s: %q (%d bytes): %v %+v", when, rid[:8], len(rid), ok, l)
			}
		}
	}
	check("filled")
	// Every other ID removed and replaced by one of its length: their
	// bytes are reused in place.
	size := x.names.size
	for i := 0; i < len(held); i += 2 {
		x.del(held[i])
		held[i] = strings.Repeat("z", len(held[i])-8) + fmt.Sprintf("%08d", i)
		x.put(held[i], ridList{n: int32(i)})
	}
	if x.names.size != size {
		t.Fatalf("names grew from %d to %d bytes replacing IDs by IDs of their lengths", size, x.names.size)
	}
	check("replaced")
	// Most removed: nothing moves until an ID needs a new block, and
	// then the rest are packed into fewer blocks first.
	blocks := len(x.names.b)
	for i := range held {
		if i%7 != 0 {
			x.del(held[i])
			held[i] = ""
		}
	}
	if len(x.names.b) != blocks || x.names.size != size {
		t.Fatalf("after removing 6 in 7: %d blocks of %d, %d bytes of %d", len(x.names.b), blocks, x.names.size, size)
	}
	check("removed")
	for i := 0; x.names.fitsLast(MaxNameLen); i++ {
		rid := fmt.Sprintf("new-%0*d", 40, i) // a length no removed ID had
		x.put(rid, ridList{n: int32(len(held))})
		held = append(held, rid)
	}
	x.put(strings.Repeat("n", MaxNameLen), ridList{n: int32(len(held))}) // needs a new block
	held = append(held, strings.Repeat("n", MaxNameLen))
	if len(x.names.b) >= blocks || x.dead != 0 {
		t.Fatalf("after a new block: %d blocks of %d, %d bytes dead", len(x.names.b), blocks, x.dead)
	}
	check("packed")
}

// TestReqIndexDrainsWithoutPacking: removing every request of a large
// index one at a time copies no ID (names keeps its blocks and its size:
// packed at a removal, each time half of names had died, the removals
// that did it took 24-52 ms, then 12-16, 4-8 ... at a session's bound on a
// VM); the first ID that needs a new block afterwards packs the few held
// then.
func TestReqIndexDrainsWithoutPacking(t *testing.T) {
	var x reqIndex
	const n = 3 * nameBlock / 128
	rids := make([]string, n)
	for i := range rids {
		rids[i] = fmt.Sprintf("%0128d", i)
		x.put(rids[i], ridList{n: 1})
	}
	blocks, size := len(x.names.b), x.names.size
	first := unsafe.SliceData(x.names.b[1])
	for i, rid := range rids {
		if !x.del(rid) {
			t.Fatalf("%q not held", rid)
		}
		if len(x.names.b) != blocks || x.names.size != size || unsafe.SliceData(x.names.b[1]) != first {
			t.Fatalf("after %d removals: %d blocks of %d, %d bytes of %d, moved %v", i+1, len(x.names.b), blocks, x.names.size, size, unsafe.SliceData(x.names.b[1]) != first)
		}
	}
	if err := x.check(); err != nil {
		t.Fatal(err)
	}
	// IDs of another length take no freed span: the last block fills,
	// then the next ID packs the blocks, keeping only what is held.
	var held []string
	for i := 0; len(x.names.b) == blocks && x.names.size >= size; i++ {
		rid := fmt.Sprintf("again-%0100d", i)
		x.put(rid, ridList{n: 1})
		held = append(held, rid)
	}
	if len(x.names.b) != 1 || x.dead != 0 || x.names.size != len(held)*len(held[0]) {
		t.Fatalf("after %d new IDs: %d blocks, %d bytes of names, %d dead", len(held), len(x.names.b), x.names.size, x.dead)
	}
	if err := x.check(); err != nil {
		t.Fatal(err)
	}
	for _, rid := range held {
		if _, ok := x.get(rid); !ok {
			t.Fatalf("%q lost", rid)
		}
	}
}
