package books

import (
	"reflect"
	"testing"

	"github.com/kvpool/kvpool/pkg/pool"
)

// TestChunkGenerations: a chunk's memfd generation and seals, recorded
// before the chunk joins the pool or after, are what Chunk, Chunks and a
// snapshot of the books say, and a forgotten chunk takes none of its old
// ones back when it joins again.
func TestChunkGenerations(t *testing.T) {
	st := NewState()
	add := func(id string) {
		st.applyEvent(pool.Event{Kind: pool.EventAddChunk, Chunk: pool.Chunk{ID: id, Size: 1 << 16}})
	}
	gen := func(st *State, id string) (uint64, int, bool) {
		c, ok := st.Chunk(id)
		return c.Gen, c.Seals, ok
	}
	steps := []struct {
		name string
		do   func()
		id   string
		gen  uint64
		seal int
		in   bool
	}{
		{"recorded before the chunk joins", func() { st.SetGen("c0", 3, 7) }, "c0", 0, 0, false},
		{"the chunk joins with it", func() { add("c0") }, "c0", 3, 7, true},
		{"a chunk without one", func() { add("c1") }, "c1", 0, 0, true},
		{"recorded after it joined", func() { st.SetGen("c1", 5, 1) }, "c1", 5, 1, true},
		{"a new memfd", func() { st.SetGen("c0", 4, 15) }, "c0", 4, 15, true},
		{"forgotten", func() { st.Forget("c0") }, "c0", 0, 0, false},
		{"joins again without its old one", func() { add("c0") }, "c0", 0, 0, true},
		{"and with a new one", func() { st.SetGen("c0", 6, 15) }, "c0", 6, 15, true},
	}
	for _, s := range steps {
		s.do()
		if g, seals, ok := gen(st, s.id); g != s.gen || seals != s.seal || ok != s.in {
			t.Fatalf("%s: chunk %s generation %d, seals %d, in the books %v; want %d, %d, %v", s.name, s.id, g, seals, ok, s.gen, s.seal, s.in)
		}
	}
	want := []Chunk{
		{ChunkImage: pool.ChunkImage{Chunk: pool.Chunk{ID: "c1", Size: 1 << 16}}, Gen: 5, Seals: 1},
		{ChunkImage: pool.ChunkImage{Chunk: pool.Chunk{ID: "c0", Size: 1 << 16}}, Gen: 6, Seals: 15},
	}
	if got := st.Chunks(); !reflect.DeepEqual(got, want) {
		t.Fatalf("chunks %+v, want %+v", got, want)
	}
	if st.NumChunks() != len(want) {
		t.Fatalf("%d chunks counted, want %d", st.NumChunks(), len(want))
	}
	// A snapshot keeps them, and the state read from it says them too.
	rec := appendSnapshot(nil, st)
	d := newDec(rec[1:])
	back := d.snapshot()
	if d.err != nil {
		t.Fatal(d.err)
	}
	if got := back.Chunks(); !reflect.DeepEqual(got, want) {
		t.Fatalf("chunks read from a snapshot %+v, want %+v", got, want)
	}
	back.SetGen("c1", 9, 1)
	if g, _, _ := gen(back, "c1"); g != 9 {
		t.Fatalf("a generation recorded after a snapshot's read: %d, want 9", g)
	}
}
