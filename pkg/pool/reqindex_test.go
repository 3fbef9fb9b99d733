package pool

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// TestReqIndexAgainstMap puts, replaces and deletes request IDs at random
// in the index and in a Go map, over sizes that make the table grow and
// deletions shift entries across its end, and checks that both hold the
// same lists and that the index's invariants hold.
func TestReqIndexAgainstMap(t *testing.T) {
	for _, keys := range []int{3, 40, 3000} {
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
				if i%97 == 0 || i == 20*keys-1 {
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
			dup, ok := x.indexAll(tc.reqs)
			if dup != tc.dup || ok != (tc.dup == "") {
				t.Fatalf("indexAll = %q, %v; want %q", dup, ok, tc.dup)
			}
			if !ok {
				return
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
				if want := (ridList{first: slot, last: slot + k - 1, n: k}); !held || l != want || x.rids[place] != q.Rid {
					t.Fatalf("%q: %v, %v at place %d (%q); want %v", q.Rid, l, held, place, x.rids[place], want)
				}
				place, slot = place+1, slot+k
			}
			if x.n != n {
				t.Fatalf("%d requests held, %d listed with streams", x.n, n)
			}
		})
	}
}
