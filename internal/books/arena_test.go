package books

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/wire"
)

// TestArenaKeepsEachValue decodes many offload records into one arena, as
// a replay's lane does, with IDs and page lists of every size around the
// blocks' bounds, and checks that each op still reads what was recorded
// once the arena has moved on, and that appending to one op's pages never
// writes over another's.
func TestArenaKeepsEachValue(t *testing.T) {
	var ops []server.SessionOp
	for i := range 3000 {
		nrid := 1 + i%97
		switch i % 500 {
		case 7:
			nrid = nameBlock/4 + 1 // its own allocation
		case 8:
			nrid = nameBlock / 4 // the longest an arena holds
		}
		npages := i % 23
		switch i % 700 {
		case 9:
			npages = pageBlock/4 + 1
		case 10:
			npages = pageBlock / 4
		}
		pages := make([]int32, npages)
		for j := range pages {
			pages[j] = int32(i*31 + j)
		}
		rid := fmt.Sprintf("%d-%s", i, strings.Repeat("r", nrid))
		ops = append(ops, server.SessionOp{Session: 5, Op: wire.OpOffload, Seq: uint32(i + 1), Rid: rid, Label: "kv", Pages: pages, Reply: []byte{8, 1}})
	}
	ar := &arena{}
	labels := map[string]string{}
	var got []server.SessionOp
	for _, op := range ops {
		d, err := decodeQueued(appendSessionOp(nil, &op), labels, ar)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, d)
	}
	for i := range got {
		// An append past a list's end copies it: the next list is not
		// touched.
		_ = append(got[i].Pages, -1, -2, -3)
	}
	for i, op := range ops {
		g := got[i]
		if g.Rid != op.Rid || g.Label != op.Label || !slices.Equal(g.Pages, op.Pages) {
			t.Fatalf("op %d: read back rid of %d bytes, label %q, pages %v; recorded %d bytes, %q, %v",
				i, len(g.Rid), g.Label, g.Pages, len(op.Rid), op.Label, op.Pages)
		}
		if g.Pages == nil {
			t.Fatalf("op %d: nil pages (an empty list reads back empty, not nil)", i)
		}
	}
	// The labels are interned: every op holds the same string.
	if len(labels) != 1 {
		t.Fatalf("%d labels interned, want 1", len(labels))
	}
}

// TestArenaRefusesBadPages checks that a page index out of range fails the
// decode in the arena as it does without one, and leaves the lists read
// before and after it whole.
func TestArenaRefusesBadPages(t *testing.T) {
	ar := &arena{}
	op := func(pages ...int32) []byte {
		return appendSessionOp(nil, &server.SessionOp{Session: 1, Op: wire.OpOffload, Seq: 1, Rid: "a", Label: "kv", Pages: pages})
	}
	before, err := decodeQueued(op(1, 2, 3), nil, ar)
	if err != nil {
		t.Fatal(err)
	}
	// -1 is recorded as 2^32-1, past any page index.
	if _, err := decodeQueued(op(7, 8, -1), nil, ar); err == nil {
		t.Fatal("a page index of 2^32-1 decoded")
	}
	after, err := decodeQueued(op(4, 5, 6), nil, ar)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(before.Pages, []int32{1, 2, 3}) || !slices.Equal(after.Pages, []int32{4, 5, 6}) {
		t.Fatalf("around a failed decode: %v and %v", before.Pages, after.Pages)
	}
}

// TestArenaStartsSmall: a session of a few streams takes blocks of about
// their size, and the blocks double up to the largest as a session grows.
func TestArenaStartsSmall(t *testing.T) {
	ar := &arena{}
	rec := func(i int) []byte {
		return appendSessionOp(nil, &server.SessionOp{Session: 1, Op: wire.OpOffload, Seq: uint32(i + 1), Rid: fmt.Sprintf("request-%06d", i), Label: "kv", Pages: []int32{int32(i)}})
	}
	for i := range 3 {
		if _, err := decodeQueued(rec(i), nil, ar); err != nil {
			t.Fatal(err)
		}
	}
	if cap(ar.names) != nameBlock/firstBlock || cap(ar.pages) != pageBlock/firstBlock {
		t.Fatalf("three streams took blocks of %d bytes and %d pages, want %d and %d",
			cap(ar.names), cap(ar.pages), nameBlock/firstBlock, pageBlock/firstBlock)
	}
	for i := 3; i < 20000; i++ {
		if _, err := decodeQueued(rec(i), nil, ar); err != nil {
			t.Fatal(err)
		}
	}
	if cap(ar.names) != nameBlock || cap(ar.pages) != pageBlock {
		t.Fatalf("20,000 streams: blocks of %d bytes and %d pages, want the largest, %d and %d", cap(ar.names), cap(ar.pages), nameBlock, pageBlock)
	}
}
