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

// TestReqIndexAll: indexAll places the requests in the order given, finds
// each of them, and names the first ID given twice.
func TestReqIndexAll(t *testing.T) {
	ids := func(n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = fmt.Sprintf("r%04d", i)
		}
		return out
	}
	for _, tc := range []struct {
		name string
		rids []string
		dup  string
	}{
		{"none", nil, ""},
		{"one", ids(1), ""},
		{"a batch and a half", ids(indexBatch + indexBatch/2), ""},
		{"many", ids(1000), ""},
		{"twice in a batch", append(ids(5), "r0002"), "r0002"},
		{"twice across batches", append(ids(3*indexBatch), "r0001", "r0007"), "r0001"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := newReqIndex(len(tc.rids))
			dup, ok := x.indexAll(len(tc.rids), func(i int) (string, ridList) {
				return tc.rids[i], ridList{first: int32(i), last: int32(i), n: 1}
			})
			if dup != tc.dup || ok != (tc.dup == "") {
				t.Fatalf("indexAll = %q, %v; want %q", dup, ok, tc.dup)
			}
			if !ok {
				return
			}
			if err := x.check(); err != nil {
				t.Fatal(err)
			}
			for i, rid := range tc.rids {
				if l, ok := x.get(rid); !ok || l.first != int32(i) || x.rids[i] != rid {
					t.Fatalf("%q: %v, %v at place %d (%q)", rid, l, ok, i, x.rids[i])
				}
			}
		})
	}
}
