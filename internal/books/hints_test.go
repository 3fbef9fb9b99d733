package books

import (
	"encoding/binary"
	"fmt"
	"maps"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/wire"
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
	// Sessions whose offloads alternate are counted as well as sessions
	// whose offloads follow each other.
	var ids []uint64
	for id := range want {
		ids = append(ids, id)
	}
	var recs []byte
	for i := range 7 {
		e := appendSessionOp(nil, &server.SessionOp{Session: ids[i%2], Op: wire.OpOffload, Rid: fmt.Sprint("alt-", i), Pages: []int32{0}})
		pad := (uint64(len(e)) + 3) &^ 3
		rec := make([]byte, 8+pad+4)
		binary.LittleEndian.PutUint32(rec, uint32(len(e)))
		copy(rec[8:], e)
		recs = append(recs, rec...)
	}
	alt := append(append([]byte{}, mem[:headerSize]...), recs...)
	h := offloadHints(alt, headerSize, uint64(len(alt)))
	if h[ids[0]] != 4 || h[ids[1]] != 3 || len(h) != 2 {
		t.Fatalf("hints of alternating offloads %v, want 4 for %d and 3 for %d", h, ids[0], ids[1])
	}
}
