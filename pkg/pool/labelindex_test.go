package pool

import (
	"fmt"
	"testing"
	"unsafe"
)

// TestLabelIndexGrowsInPieces: offloading requests of many streams one
// stream at a time, no offload moves more than a sixty-fourth of the label
// index's entries or so once it holds splitAt of them (its one table is
// split by place, each table growing alone), every stream is found by its
// label throughout, and removals keep the index whole; with one table
// doubling, the offload that found it full moved every entry.
func TestLabelIndexGrowsInPieces(t *testing.T) {
	const per, requests = 20, 2 * splitAt
	p := New()
	must(t, p.AddChunk(Chunk{ID: "c", GPU: 0, Size: 4 << 20}))
	must(t, p.Grant("A", []string{"c"}))
	s, err := p.Open("A", Spec{GPU: 0, PageSize: 4, DevicePages: 8})
	must(t, err)
	x := &s.byLabel
	most, split := 0, false
	for i := range per * requests {
		rid, label := fmt.Sprint("r", i/per), fmt.Sprint("layer-", i%per)
		before := make([]*uint64, len(x.tabs))
		for t, tab := range x.tabs {
			before[t] = unsafe.SliceData(tab)
		}
		_, err := s.Offload(rid, label, []int32{int32(i % 8)}, Meta{}, nil)
		must(t, err)
		if len(before) != len(x.tabs) {
			split = split || len(x.tabs) == 1<<tabBits
			continue // made (the first stream of a request past indexFrom) or split: once each
		}
		moved := 0
		for t, tab := range x.tabs {
			if before[t] != unsafe.SliceData(tab) {
				moved += int(x.tabN[t])
			}
		}
		if split {
			most = max(most, moved)
		}
		if i%16411 == 0 {
			must(t, s.Check())
		}
	}
	if !split || len(x.tabs) != 1<<tabBits {
		t.Fatalf("%d label tables at %d entries; want %d from %d", len(x.tabs), x.n, 1<<tabBits, splitAt)
	}
	if bound := 4 * x.n >> tabBits; most > bound {
		t.Fatalf("an offload moved %d label entries (of %d); want at most %d", most, x.n, bound)
	}
	must(t, s.Check())
	for r := range requests {
		for _, l := range []int{0, per / 2, per - 1} {
			if n, err := s.NumPages(fmt.Sprint("r", r), fmt.Sprint("layer-", l)); err != nil || n != 1 {
				t.Fatalf("r%d/layer-%d: %d pages, %v", r, l, n, err)
			}
		}
	}
	// Every other request removed, and one stream of each of the rest.
	for r := 0; r < requests; r += 2 {
		n, err := s.RemoveRequest(fmt.Sprint("r", r))
		if err != nil || n != per {
			t.Fatalf("remove r%d: %d, %v", r, n, err)
		}
		must(t, s.Discard(fmt.Sprint("r", r+1), "layer-3"))
	}
	must(t, s.Check())
	if want := requests / 2 * (per - 1); x.n != want {
		t.Fatalf("the label index holds %d entries; want %d", x.n, want)
	}
	t.Logf("%d entries in %d tables: an offload moved at most %d", x.n, len(x.tabs), most)
}
