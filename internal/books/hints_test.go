package books

import (
	"maps"
	"testing"

	"golang.org/x/sys/unix"
)

// The replay's pre-pass counts each session's offload records, so that
// it sizes each request table once; the books replay to the same state
// whatever the counts say (a hint, never a bound).
func TestOffloadHintsCountEachSession(t *testing.T) {
	const streams = 3000
	p, bk, store := atLimits(t, 2, streams, streams*24, true)
	bk.Close()
	fi, err := store.f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(int(store.f.Fd()), 0, int(fi.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	hints := offloadHints(mem, headerSize, uint64(len(mem)))
	want := map[uint64]int{}
	for _, alloc := range []string{"alloc-0", "alloc-1"} {
		for _, s := range p.Sessions(alloc) {
			want[s.ID()] = streams
		}
	}
	if !maps.Equal(hints, want) {
		t.Fatalf("hints %v, want %v (one per offload record of each session)", hints, want)
	}
	// Torn or cut books: the count stops where the records do.
	if h := offloadHints(mem[:headerSize+64], headerSize, headerSize+64); len(h) > 1 {
		t.Errorf("hints from 64 bytes of records: %v", h)
	}
	st, _, err := Load(store.f)
	if err != nil {
		t.Fatal(err)
	}
	if st.ridHints != nil {
		t.Error("the hints outlive the replay")
	}
	if got := st.Streams(); got != 2*streams {
		t.Fatalf("replayed %d streams, want %d", got, 2*streams)
	}
}
