package books

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"reflect"
	"slices"
	"sync/atomic"
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

// finishedAsLoaded finishes fl on the books r's store holds and fails
// unless it reads what Load reads, the books of r's pool; it returns what
// the follower's Load says of them.
func finishedAsLoaded(t *testing.T, fl *Follower, r *rig) Info {
	t.Helper()
	want, _, err := Load(r.store.f)
	must(t, err)
	got, info, err := fl.Load(r.store.f)
	must(t, err)
	sameState(t, got, want)
	must(t, got.Check(r.p.Export()))
	got.src.Close()
	want.src.Close()
	return info
}

// follow keeps fl on the books store holds, as a spare agent does: read
// further where it still holds them, gone on into their compaction where
// that is the next memfd (unless anew), followed anew otherwise. It says
// which it did.
func follow(t *testing.T, fl *Follower, store *memStore, anew bool) (*Follower, string) {
	t.Helper()
	if fl != nil && fl.Follows(store.f) {
		must(t, fl.Advance())
		return fl, "advanced"
	}
	if fl != nil && !anew {
		f := readOnly(t, store.f)
		err := fl.Next(f)
		if err == nil {
			must(t, fl.Advance())
			return fl, "next"
		}
		f.Close()
		if !errors.Is(err, ErrNotNext) {
			t.Fatal(err)
		}
	}
	if fl != nil {
		fl.Close()
	}
	fl, err := Follow(readOnly(t, store.f), nil)
	must(t, err)
	return fl, "anew"
}

// followedRig is a rig after steps random ops, and a follower of its books.
func followedRig(t *testing.T, seed uint64, steps int) (*rig, *Follower) {
	r := newRig(t, seed)
	for i := range steps {
		r.step(i)
	}
	fl, err := Follow(readOnly(t, r.store.f), nil)
	must(t, err)
	return r, fl
}

// TestFollowerReadsWhatLoadReads: books followed while they are written,
// through sessions closed and opened, a revoke and compactions into fresh
// memfds (gone on into where it could, followed anew where it missed one
// or chose to), read a piece at a time at random points, then finished on
// the memfd a keeper would hand over: the state Load reads from the same
// memfd, and the pool it rebuilds is the pool that wrote them.
func TestFollowerReadsWhatLoadReads(t *testing.T) {
	old := minLog
	minLog = 4 << 10
	defer func() { minLog = old }()
	for seed := range uint64(4) {
		r := newRig(t, 300+seed)
		var fl *Follower
		did := map[string]int{}
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
				var how string
				fl, how = follow(t, fl, r.store, r.rng.IntN(4) == 0)
				did[how]++
			}
		}
		r.b.settle()
		if r.b.Stats().Compactions == 0 || did["advanced"] < 10 || did["next"] < 3 || did["anew"] < 2 {
			t.Fatalf("seed %d: %d compactions, reads %v: the test follows too little", seed, r.b.Stats().Compactions, did)
		}
		fl, _ = follow(t, fl, r.store, false) // the memfd the last compaction made
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
	fl, err := Follow(readOnly(t, r.store.f), nil)
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
	finishedAsLoaded(t, fl, r)
	t.Logf("%d reads beside the writer", reads)
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
	if _, err := Follow(readOnly(t, of), nil); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a memfd of zeros: %v", err)
	}
	fl, err = Follow(readOnly(t, r.store.f), nil)
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
		fl, ferr := Follow(readOnly(t, file), nil)
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

// compactedUnderFollower is a rig whose compaction aside began, 40 more
// changes went to the old log while it ran (the follower reading the first
// 20 of them) and then ended: the store holds the compaction, the follower
// still reads the old memfd.
func compactedUnderFollower(t testing.TB, seed uint64) (*rig, *Follower) {
	r, h := asideRig(t, seed)
	fl, err := Follow(readOnly(t, r.store.f), nil)
	must(t, err)
	for i := range 40 {
		r.step(i)
		if i == 19 {
			must(t, fl.Advance())
		}
	}
	close(h.release)
	r.b.settle()
	asideHook = nil
	if fl.Follows(r.store.f) || r.store.gen != fl.Gen()+1 {
		t.Fatalf("the store holds generation %d, the follower reads %d: no compaction under it", r.store.gen, fl.Gen())
	}
	return r, fl
}

// TestFollowerGoesOnIntoACompaction: a follower of books that compacted
// while it read them goes on in the compaction from where it stood (the
// records the compaction copied from the old log after its snapshot, past
// those it had read) without reading the snapshot, follows on, and ends
// with the state Load reads; a follower whose Load is handed the
// compaction itself (the writer compacted just before it died) goes on
// there too.
func TestFollowerGoesOnIntoACompaction(t *testing.T) {
	r, fl := compactedUnderFollower(t, 39)
	if info := finishedAsLoaded(t, fl, r); info.Replayed != 0 {
		t.Fatalf("replayed %d bytes of the compaction: want none (the follower stood at its end)", info.Replayed)
	}
	r.b.Close()
	for seed := range uint64(3) {
		r, fl := compactedUnderFollower(t, 40+seed)
		f := readOnly(t, r.store.f)
		must(t, fl.Next(f))
		if !fl.Follows(r.store.f) {
			t.Fatal("the follower does not read the compaction it went on to")
		}
		_, snapEnd, _, ok := readOrigin(fl.mem)
		if !ok || fl.rp.st.snapEnd != snapEnd {
			t.Fatalf("origin %v, the follower's snapshot end %d, the header's %d", ok, fl.rp.st.snapEnd, snapEnd)
		}
		// It stands past the 40 changes the compaction copied after its
		// snapshot: it read the old log to its end first.
		copied := fl.rp.off - snapEnd
		must(t, fl.Advance())
		if copied == 0 || fl.rp.off != snapEnd+copied {
			t.Fatalf("the follower stands %d bytes past the snapshot, %d after reading on; want the copied records, and nothing more to read", copied, fl.rp.off-snapEnd)
		}
		for i := range 30 {
			r.step(i)
		}
		r.b.settle()
		fl, _ = follow(t, fl, r.store, false)
		finishedAsLoaded(t, fl, r)
		r.b.Close()
	}
}

// fileBytes is what f holds.
func fileBytes(t testing.TB, f *os.File) []byte {
	t.Helper()
	var s unix.Stat_t
	must(t, unix.Fstat(int(f.Fd()), &s))
	mem := make([]byte, s.Size)
	_, err := f.ReadAt(mem, 0)
	must(t, err)
	return mem
}

// copyBooks is a memfd holding what f holds, changed by change, opened
// again read-only as a keeper hands it over.
func copyBooks(t *testing.T, f *os.File, change func(mem []byte)) *os.File {
	t.Helper()
	mem := fileBytes(t, f)
	change(mem)
	c := memfdOf(t, mem)
	defer c.Close()
	return readOnly(t, c)
}

// setOrigin rewrites the origin in the header of mem, as change makes it.
func setOrigin(mem []byte, change func(o *origin, snapEnd, skipped *uint64)) {
	o, snapEnd, skipped, _ := readOrigin(mem)
	change(&o, &snapEnd, &skipped)
	o.write(mem, snapEnd, int(skipped))
}

// TestFollowerNextRefuses: a memfd that is not the compaction of the
// followed books, or whose header or copied records say otherwise than the
// followed log, is refused with ErrNotNext and taken by nothing: the
// follower goes on reading its books, and then into the real compaction.
func TestFollowerNextRefuses(t *testing.T) {
	r, fl := compactedUnderFollower(t, 7)
	defer r.b.Close()
	oldGen := fl.Gen()
	if _, _, err := fl.Load(copyBooks(t, r.store.f, func(mem []byte) { mem[originAt+9] ^= 1 })); !errors.Is(err, ErrNotFollowed) || !errors.Is(err, ErrNotNext) {
		t.Fatalf("Load of a compaction it cannot go on into: %v, want ErrNotFollowed and ErrNotNext", err)
	}
	r, fl = compactedUnderFollower(t, 7)
	defer r.b.Close()
	cases := []struct {
		name   string
		change func(mem []byte)
	}{
		{"no origin (an older agent's)", func(mem []byte) { clear(mem[originAt : originAt+originSize]) }},
		{"an origin that fails its checksum", func(mem []byte) { mem[originAt+9] ^= 1 }},
		{"another log's compaction", func(mem []byte) { setOrigin(mem, func(o *origin, _, _ *uint64) { o.ino++ }) }},
		{"a compaction of a later generation", func(mem []byte) { binary.LittleEndian.PutUint64(mem[16:], binary.LittleEndian.Uint64(mem[16:])+1) }},
		{"records after the snapshot that are not the old log's", func(mem []byte) {
			_, snapEnd, _, _ := readOrigin(mem)
			mem[snapEnd+8] ^= 1
		}},
		{"a snapshot said to end past the books", func(mem []byte) {
			setOrigin(mem, func(_ *origin, snapEnd, _ *uint64) { *snapEnd = uint64(len(mem)) + 8 })
		}},
		{"a snapshot said to end in the header", func(mem []byte) { setOrigin(mem, func(_ *origin, snapEnd, _ *uint64) { *snapEnd = 40 }) }},
		{"a snapshot of the old log past what it holds", func(mem []byte) { setOrigin(mem, func(o *origin, _, _ *uint64) { o.off += 1 << 30 }) }},
		{"a snapshot of the old log's header", func(mem []byte) { setOrigin(mem, func(o *origin, _, _ *uint64) { o.off = 8 }) }},
		{"more records skipped than the follower saw", func(mem []byte) { setOrigin(mem, func(_ *origin, _, skipped *uint64) { *skipped = 1 << 40 }) }},
		{"not books", func(mem []byte) { copy(mem, "NOTBOOKS") }},
	}
	for _, c := range cases {
		f := copyBooks(t, r.store.f, c.change)
		if err := fl.Next(f); !errors.Is(err, ErrNotNext) {
			t.Fatalf("%s: %v, want ErrNotNext", c.name, err)
		}
		if fl.Gen() != oldGen || fl.Follows(r.store.f) {
			t.Fatalf("%s: the follower no longer reads the old books", c.name)
		}
		if _, err := f.Stat(); err != nil {
			t.Fatalf("%s: the refused memfd was closed: %v", c.name, err)
		}
		f.Close()
	}
	// A copy of the compaction is the compaction: the follower takes it.
	f := copyBooks(t, r.store.f, func([]byte) {})
	must(t, fl.Next(f))
	must(t, fl.Advance())
	want, _, err := Load(r.store.f)
	must(t, err)
	got, _, err := fl.Load(f)
	must(t, err)
	sameState(t, got, want)
	got.src.Close()
	want.src.Close()

	// A follower before its first state cannot tell.
	r2, fl2 := compactedUnderFollower(t, 8)
	defer r2.b.Close()
	fl2.rp = replayer{r: router{procs: 1}}
	f2 := readOnly(t, r2.store.f)
	defer f2.Close()
	if err := fl2.Next(f2); !errors.Is(err, ErrNotNext) {
		t.Fatalf("a follower with no state: %v, want ErrNotNext", err)
	}
	fl2.Close()
}

// FuzzNext: a follower of books that compacted under it goes on into a
// compaction whose origin and bytes the fuzzer chose: it refuses
// (ErrNotNext) or goes on, never reading out of bounds. Where the origin
// is the one the compaction wrote and the bytes changed are not its
// snapshot's contents (which a follower that goes on does not read), a
// follower that goes on reads the pool Load reads from the same memfd,
// or fails where Load fails.
func FuzzNext(f *testing.F) {
	// The pair, written out: the old log's image, where the follower
	// first stood in it, and the compaction's image.
	r, fl := compactedUnderFollower(f, 11)
	cut := int(fl.rp.off)
	oldImg, newImg := fileBytes(f, fl.f), fileBytes(f, r.store.f)
	fl.Close()
	r.b.Close()
	o, snapEnd, skipped, _ := readOrigin(newImg)
	f.Add(true, o.off, snapEnd, skipped, uint8(0), uint32(0), byte(0))
	f.Add(true, o.off+4, snapEnd+4, skipped, uint8(0), uint32(0), byte(0))
	f.Add(true, o.off, snapEnd, skipped, uint8(1), uint32(0), byte(0))
	f.Add(false, o.off, snapEnd, skipped, uint8(0), uint32(0), byte(0))
	f.Add(true, o.off, snapEnd, skipped, uint8(0), uint32(snapEnd+20), byte(4))
	f.Fuzz(func(t *testing.T, sameLog bool, off, snapEnd, skipped uint64, genDelta uint8, flipAt uint32, flip byte) {
		oldF := memfdOf(t, oldImg[:cut])
		defer oldF.Close()
		fl, err := Follow(readOnly(t, oldF), nil)
		must(t, err)
		defer fl.Close()
		_, err = oldF.WriteAt(oldImg[cut:], int64(cut))
		must(t, err)
		img := slices.Clone(newImg)
		ino := inode(oldF)
		if !sameLog {
			ino++
		}
		o, snapEnd0, skipped0, _ := readOrigin(newImg)
		truth := sameLog && off == o.off && snapEnd == snapEnd0 && skipped == skipped0 &&
			(flip == 0 || uint64(flipAt) >= snapEnd0 || snapshotFraming(newImg, flipAt))
		origin{ino, off}.write(img, snapEnd, int(skipped))
		binary.LittleEndian.PutUint64(img[16:], binary.LittleEndian.Uint64(img[16:])+uint64(genDelta))
		if int(flipAt) < len(img) && flipAt >= originAt+originSize {
			img[flipAt] ^= flip
		}
		newF := memfdOf(t, img)
		defer newF.Close()
		nf := readOnly(t, newF)
		if err := fl.Next(nf); err != nil {
			nf.Close()
			if !errors.Is(err, ErrNotNext) {
				t.Fatalf("the follower's own books failed: %v", err)
			}
			return
		}
		got, _, gerr := fl.Load(newF)
		want, _, werr := Load(newF)
		for _, st := range []*State{got, want} {
			if st != nil && st.src != nil {
				defer st.src.Close()
			}
		}
		if !truth {
			return
		}
		if (gerr == nil) != (werr == nil) {
			t.Fatalf("followed on: %v; loaded: %v", gerr, werr)
		}
		if gerr == nil {
			must(t, got.Check(want.Image()))
			if sa, sb := serverSide(got), serverSide(want); sa != sb {
				t.Fatalf("the server's side differs:\nfollowed %s\nloaded   %s", sa, sb)
			}
		}
	})
}

// snapshotFraming reports whether byte at of the books img is in the
// framing of one of the snapshot's records that a follower going on checks
// (length, the record's type, commit word), not in what it does not read
// (the checksum, the part's flags and contents).
func snapshotFraming(img []byte, at uint32) bool {
	for off := uint64(headerSize); off+8 <= uint64(len(img)); {
		n := uint64(binary.LittleEndian.Uint32(img[off:]))
		rec := 8 + (n+3)&^3 + 4
		if n < 2 || img[off+8] != recSnapshotPart {
			return false
		}
		a := uint64(at)
		if a >= off && a < off+rec {
			return a < off+4 || a == off+8 || a >= off+rec-4
		}
		if img[off+9]&partLast != 0 {
			return false
		}
		off += rec
	}
	return false
}

// memfdOf is a memfd holding img.
func memfdOf(t testing.TB, img []byte) *os.File {
	fd, err := unix.MemfdCreate("fuzz-books", unix.MFD_CLOEXEC)
	must(t, err)
	file := os.NewFile(uintptr(fd), "fuzz-books")
	_, err = file.WriteAt(img, 0)
	must(t, err)
	return file
}

// TestFollowerHaltedGoesOnInLoad: a read halted at any point (a spare's
// turn came while it read: among the records, or among a snapshot's parts
// or inside their decoding) stops where it stands, and Load goes on from
// there to the state Load reads, also when the books grew meanwhile.
func TestFollowerHaltedGoesOnInLoad(t *testing.T) {
	_, b, store := atLimits(t, 4, 20000, 20000*40, true)
	defer b.Close()
	records := fileBytes(t, store.f)
	oldPart := snapPart
	snapPart = 64 << 10
	must(t, b.Rehand(store))
	snapPart = oldPart
	defer func() { haltHook = nil }()
	for _, tc := range []struct {
		name string
		mem  []byte
	}{{"records", records}, {"a snapshot in parts", fileBytes(t, store.f)}} {
		f := memfdOf(t, tc.mem)
		want, _, err := Load(f)
		must(t, err)
		at := map[string]int{}
		// Halted at the k-th look at the halt.
		for _, k := range []int64{0, 1, 2, 40, 100, 200, 300, 1000, 3000, 1 << 40} {
			var looks atomic.Int64
			haltHook = func(h *atomic.Bool) {
				if looks.Add(1) > k {
					h.Store(true)
				}
			}
			var halt atomic.Bool
			fl, err := Follow(readOnly(t, f), &halt)
			must(t, err)
			switch {
			case !fl.Halted():
				at["not halted"]++
			case fl.rp.st != nil:
				at["among the records"]++
			case len(fl.rp.parts) > 0:
				at["among the snapshot's parts"]++
				// The writer grew the books after the halted read:
				// its parts stay mapped.
				var s unix.Stat_t
				must(t, unix.Fstat(int(f.Fd()), &s))
				must(t, f.Truncate(s.Size+1<<20))
			default:
				at["at the start"]++
			}
			got, _, err := fl.Load(f)
			must(t, err)
			sameState(t, got, want)
			got.src.Close()
		}
		haltHook = nil
		t.Logf("%s: halted %v", tc.name, at)
		mid := "among the records"
		if tc.name != "records" {
			mid = "among the snapshot's parts"
		}
		if at["at the start"] == 0 || at[mid] == 0 || at["not halted"] == 0 {
			t.Fatalf("%s: halted %v: want reads halted at the start, %s, and not halted", tc.name, at, mid)
		}
		want.src.Close()
		f.Close()
	}
}

// TestFollowerGoesOnIntoTheNextWritersBooks: a follower of books whose
// writer died goes on into the memfd the next writer starts them in, where
// that is not the kept one: a copy of the kept log (past the room its
// snapshot leaves), or a compaction of it (far past it).
func TestFollowerGoesOnIntoTheNextWritersBooks(t *testing.T) {
	for _, far := range []bool{false, true} {
		var r *rig
		if far {
			// A compaction aside held while the log grows far past its
			// room, then the writer gone.
			var h *heldAside
			r, h = asideRig(t, 61)
			for i := range 400 {
				r.step(i)
			}
			held := errors.New("held, then failed")
			h.fail.Store(&held)
			close(h.release)
			r.b.settle()
			asideHook = nil
			r.b.Close()
		} else {
			old := noResume
			noResume = true
			defer func() { noResume = old }()
			r = newRig(t, 62)
			for i := range 300 {
				r.step(i)
			}
			r.b.Close()
		}
		fl, err := Follow(readOnly(t, r.store.f), nil)
		must(t, err)
		st, info, err := Load(r.store.f)
		must(t, err)
		b, err := Start(st, info.Gen, r.store, func(err error) { t.Errorf("fatal: %v", err) })
		must(t, err)
		if fl.Follows(r.store.f) {
			t.Fatalf("far %v: the next writer went on in the kept memfd", far)
		}
		// A copy's snapshot is the kept log's own; a compaction's stands
		// for the whole kept log.
		o, snapEnd, _, ok := readOrigin(fileBytes(t, r.store.f))
		if !ok || o.ino != fl.ino || (o.off > snapEnd) != far {
			t.Fatalf("far %v: the next writer's books name origin %+v (%v), snapshot end %d", far, o, ok, snapEnd)
		}
		finishedAsLoaded(t, fl, r)
		b.Close()
	}
}
