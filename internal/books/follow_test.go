package books

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"reflect"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/pkg/pool"
)

// readOnly opens the memfd f again, read-only, as the keeper hands the
// books to a follower.
func readOnly(t testing.TB, f *os.File) *os.File {
	t.Helper()
	ro, err := os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", f.Fd()), os.O_RDONLY, 0)
	must(t, err)
	return ro
}

// sameState fails unless a and b hold the same books: every chunk,
// allocation, session, stream and pending reload, the server's side of each
// session, the records skipped, and where the replayed records and their
// snapshot end.
func sameState(t *testing.T, a, b *State) {
	t.Helper()
	if a.Skipped != b.Skipped || a.lastSession != b.lastSession || a.srcEnd != b.srcEnd || a.snapEnd != b.snapEnd || (a.src == nil) != (b.src == nil) {
		t.Fatalf("followed: skipped %d last %d end %d snapshot end %d source %v; loaded: %d %d %d %d %v",
			a.Skipped, a.lastSession, a.srcEnd, a.snapEnd, a.src != nil, b.Skipped, b.lastSession, b.srcEnd, b.snapEnd, b.src != nil)
	}
	must(t, a.Check(b.Image()))
	if sa, sb := serverSide(a), serverSide(b); sa != sb {
		t.Fatalf("the server's side differs:\nfollowed %s\nloaded   %s", sa, sb)
	}
}

// follow keeps fl on the books store holds, as a spare agent does: read
// further where it still holds them, followed anew where they compacted
// into a fresh memfd.
func follow(t *testing.T, fl *Follower, store *memStore) *Follower {
	t.Helper()
	if fl != nil && fl.Follows(store.f) {
		must(t, fl.Advance())
		return fl
	}
	if fl != nil {
		fl.Close()
	}
	fl, err := Follow(readOnly(t, store.f))
	must(t, err)
	return fl
}

// followedRig is a rig after steps random ops, and a follower of its books.
func followedRig(t *testing.T, seed uint64, steps int) (*rig, *Follower) {
	r := newRig(t, seed)
	for i := range steps {
		r.step(i)
	}
	fl, err := Follow(readOnly(t, r.store.f))
	must(t, err)
	return r, fl
}

// TestFollowerReadsWhatLoadReads: books followed while they are written,
// through sessions closed and opened, a revoke and compactions into fresh
// memfds, read a piece at a time at random points, then finished on the
// memfd a keeper would hand over: the state Load reads from the same
// memfd, and the pool it rebuilds is the pool that wrote them.
func TestFollowerReadsWhatLoadReads(t *testing.T) {
	old := minLog
	minLog = 16 << 10
	defer func() { minLog = old }()
	for seed := range uint64(4) {
		r := newRig(t, 300+seed)
		var fl *Follower
		reads := 0
		for i := range 3000 {
			r.step(i)
			switch i {
			case 700:
				r.closeAndReopen()
			case 1800:
				r.revokeB()
			}
			if r.rng.IntN(40) == 0 {
				r.b.settle() // a compaction aside hands its memfd over
				fl = follow(t, fl, r.store)
				reads++
			}
		}
		r.b.settle()
		if r.b.Stats().Compactions == 0 || reads < 20 {
			t.Fatalf("seed %d: %d compactions, %d reads: the test follows nothing", seed, r.b.Stats().Compactions, reads)
		}
		fl = follow(t, fl, r.store) // the memfd the last compaction made
		for range 50 {
			r.step(0)
		}
		r.b.settle()
		want, wantInfo, err := Load(r.store.f)
		must(t, err)
		got, info, err := fl.Load(r.store.f)
		must(t, err)
		if fl.rp.st != nil || fl.mem != nil {
			t.Fatal("the follower holds the state (or the books) after handing them over")
		}
		if info.Gen != wantInfo.Gen || !info.LastAlive.Equal(wantInfo.LastAlive) {
			t.Fatalf("followed: generation %d, last alive %v; loaded: %d, %v", info.Gen, info.LastAlive, wantInfo.Gen, wantInfo.LastAlive)
		}
		sameState(t, got, want)
		must(t, got.Check(r.p.Export()))
		q := pool.New()
		_, err = q.Restore(got.Image())
		must(t, err)
		if g, w := q.Export(), r.p.Export(); !reflect.DeepEqual(g, w) {
			t.Fatalf("seed %d: the pool rebuilt from the followed books differs:\n%+v\n%+v", seed, g, w)
		}
		got.src.Close()
		want.src.Close()
		r.b.Close()
	}
}

// TestFollowerBesideItsWriter: a follower reading as fast as it can while
// the writer appends on another goroutine (the race detector watches the
// Go side; the books are shared memory, as across processes) ends with the
// state Load reads.
func TestFollowerBesideItsWriter(t *testing.T) {
	r := newRig(t, 9)
	fl, err := Follow(readOnly(t, r.store.f))
	must(t, err)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 4000 {
			r.step(i)
		}
	}()
	reads := 0
	for running := true; running; reads++ {
		select {
		case <-done:
			running = false
		default:
		}
		must(t, fl.Advance())
	}
	want, _, err := Load(r.store.f)
	must(t, err)
	got, _, err := fl.Load(r.store.f)
	must(t, err)
	sameState(t, got, want)
	must(t, got.Check(r.p.Export()))
	t.Logf("%d reads beside the writer", reads)
	got.src.Close()
	want.src.Close()
	r.b.Close()
}

// TestFollowerPastATornRecord: a follower that read up to a record its
// writer died writing (length and payload, no commit word) reads, after the
// next writer cleared it and went on in the same memfd, that writer's
// records and never the torn one.
func TestFollowerPastATornRecord(t *testing.T) {
	r, fl := followedRig(t, 12, 300)
	defer fl.Close()
	_, _, end, err := replay(r.b.mem)
	must(t, err)
	// Torn: the removal of c0, framed and checksummed, its commit word
	// never stored.
	torn := appendEvent(nil, pool.Event{Kind: pool.EventRemoveChunk, Chunk: pool.Chunk{ID: "c0"}})
	writeRecord(r.b.mem, end, torn)
	binary.LittleEndian.PutUint32(r.b.mem[end+recordSize(len(torn))-4:], 0)
	must(t, fl.Advance())
	if fl.rp.off != end {
		t.Fatalf("the follower read to %d, want the torn record's start %d", fl.rp.off, end)
	}
	r.b.Close()
	// The next writer: it forgets c4 (a record where the torn one was,
	// shorter than it) and sets c1's generation.
	st, info, err := Load(r.store.f)
	must(t, err)
	st.Forget("c4")
	b, err := Start(st, info.Gen, r.store, func(err error) { t.Errorf("fatal: %v", err) })
	must(t, err)
	must(t, b.ChunkGen("c1", 5, 0))
	if !fl.Follows(r.store.f) {
		t.Fatal("the next writer did not go on in the followed memfd")
	}
	want, _, err := Load(r.store.f)
	must(t, err)
	got, _, err := fl.Load(r.store.f)
	must(t, err)
	sameState(t, got, want)
	if _, ok := got.Chunk("c0"); !ok {
		t.Fatal("the follower took the torn record: c0 removed")
	}
	if _, ok := got.Chunk("c4"); ok {
		t.Fatal("the follower missed the next writer's removal of c4")
	}
	if c, _ := got.Chunk("c1"); c.Gen != 5 {
		t.Fatalf("c1 at generation %d, want 5", c.Gen)
	}
	got.src.Close()
	want.src.Close()
	b.Close()
}

// TestFollowerRefuses: another memfd than the followed one is refused and
// reads nothing; what is not books cannot be followed; books whose
// generation changes under the follower stop it.
func TestFollowerRefuses(t *testing.T) {
	r, fl := followedRig(t, 5, 100)
	other, err := unix.MemfdCreate("other", unix.MFD_CLOEXEC)
	must(t, err)
	of := os.NewFile(uintptr(other), "other")
	defer of.Close()
	if _, _, err := fl.Load(of); !errors.Is(err, ErrNotFollowed) {
		t.Fatalf("another memfd: %v", err)
	}
	fl.Close() // again, after Load's own: nothing happens
	(*Follower)(nil).Close()
	must(t, of.Truncate(8192))
	if _, err := Follow(readOnly(t, of)); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a memfd of zeros: %v", err)
	}
	fl, err = Follow(readOnly(t, r.store.f))
	must(t, err)
	defer fl.Close()
	binary.LittleEndian.PutUint64(r.b.mem[16:], fl.Gen()+1)
	if err := fl.Advance(); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a generation changed under the follower: %v", err)
	}
	r.b.Close()
}

// FuzzFollow: books written in two pieces, the follower reading the first
// before the second is there, read what Load reads of the whole, or fail
// where it fails (a follower may also fail on the first piece alone: a
// failure there is the whole books' failure too, or the piece's bytes were
// cut inside a record that only the second piece completes).
func FuzzFollow(f *testing.F) {
	img, compacted := fuzzImages(f)
	f.Add(img[:40], img[headerSize:], uint16(100))
	f.Add(img[:40], img[headerSize:], uint16(0))
	f.Add(compacted[:40], compacted[headerSize:], uint16(300))
	f.Fuzz(func(t *testing.T, hdr, records []byte, cut uint16) {
		mem := fuzzMem(hdr, records)
		at := headerSize + min(int(cut), len(records))
		fd, err := unix.MemfdCreate("fuzz-books", unix.MFD_CLOEXEC)
		must(t, err)
		file := os.NewFile(uintptr(fd), "fuzz-books")
		defer file.Close()
		_, err = file.WriteAt(mem[:at], 0)
		must(t, err)
		fl, ferr := Follow(readOnly(t, file))
		_, err = file.WriteAt(mem[at:], int64(at))
		must(t, err)
		want, _, werr := Load(file)
		if want != nil && want.src != nil {
			defer want.src.Close()
		}
		if ferr != nil {
			return // the first piece alone did not follow
		}
		got, _, gerr := fl.Load(file)
		if got != nil && got.src != nil {
			defer got.src.Close()
		}
		if (gerr == nil) != (werr == nil) {
			t.Fatalf("followed: %v; loaded: %v", gerr, werr)
		}
		if gerr == nil {
			sameState(t, got, want)
		}
	})
}
