package books

import (
	"bytes"
	"errors"
	"os"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/wire"
)

// heldAside makes the next compactions aside stop after their snapshot
// until released, and reports when one has stopped there. fail is what
// each returns once released.
type heldAside struct {
	stopped chan struct{}
	release chan struct{}
	fail    atomic.Pointer[error]
}

func holdAside(t testing.TB) *heldAside {
	h := &heldAside{stopped: make(chan struct{}, 1), release: make(chan struct{})}
	asideHook = func() error {
		h.stopped <- struct{}{}
		<-h.release
		if err := h.fail.Load(); err != nil {
			return *err
		}
		return nil
	}
	t.Cleanup(func() { asideHook = nil })
	return h
}

// settle waits for the compaction running aside, if one is (tests).
func (b *Books) settle() {
	b.mu.Lock()
	c := b.aside
	b.mu.Unlock()
	if c != nil {
		<-c.done
	}
}

// asideRig is a rig whose log is 4 KiB (a compaction every few changes),
// stepped until a compaction aside has written its snapshot and stopped
// there (holdAside).
func asideRig(t testing.TB, seed uint64) (*rig, *heldAside) {
	old := minLog
	minLog = 4 << 10
	t.Cleanup(func() { minLog = old })
	h := holdAside(t)
	r := newRig(t, seed)
	r.stepUntilAside(h)
	return r, h
}

// stepUntilAside steps the rig until a compaction aside begins, then
// waits, stepping no more, until it has written its snapshot and stopped:
// the log then holds what it held when the compaction began. (Stepping on
// until the compaction stopped grew the log by as much as the goroutine
// took to be scheduled: 4 KiB mostly, 125 KiB once in a hundred.)
func (r *rig) stepUntilAside(h *heldAside) {
	r.t.Helper()
	for i := range 100000 {
		r.step(i)
		r.b.mu.Lock()
		began := r.b.aside != nil
		r.b.mu.Unlock()
		if began {
			select {
			case <-h.stopped:
				return
			case <-time.After(30 * time.Second):
				r.t.Fatal("the compaction aside began and did not reach its snapshot")
			}
		}
	}
	r.t.Fatal("no compaction began")
}

// withoutWaiting runs f, failing the test if it has not returned after a
// long while: appends must not wait for a compaction that runs aside.
func withoutWaiting(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatalf("%s waited for the compaction running aside", what)
	}
}

// TestCompactionAside: a full log compacts beside the appends. While the
// compaction replays and writes, the changes go on into the old memfd,
// which grows; the keeper still holds it, so an agent killed then loses
// nothing; once installed, the new memfd holds the snapshot and every
// record appended meanwhile.
func TestCompactionAside(t *testing.T) {
	oldCopy := lockedCopy
	lockedCopy = 4 << 10 // most of what is appended meanwhile copied outside the lock, in rounds
	defer func() { lockedCopy = oldCopy }()
	r, h := asideRig(t, 21)
	before := r.b.Stats()
	puts := r.store.puts // the compaction has not handed anything yet
	withoutWaiting(t, "appending", func() {
		for i := range 3000 {
			r.step(i)
		}
	})
	grown := r.b.Stats()
	if grown.Gen != before.Gen || grown.Capacity <= before.Capacity || grown.LogBytes <= before.LogBytes {
		t.Fatalf("while compacting aside: books %+v, then %+v; want the same generation, grown", before, grown)
	}
	// Killed now: the keeper's memfd is the old one, with every change.
	st, info, err := Load(r.store.f)
	must(t, err)
	if info.Gen != before.Gen || r.store.puts != puts {
		t.Fatalf("the keeper holds generation %d after %d puts, want %d after %d", info.Gen, r.store.puts, before.Gen, puts)
	}
	must(t, st.Check(r.p.Export()))

	close(h.release)
	r.b.settle()
	after := r.b.Stats()
	if after.Gen != before.Gen+1 || r.store.gen != after.Gen || r.store.puts != puts+1 {
		t.Fatalf("after the compaction: books %+v, the keeper's generation %d after %d puts", after, r.store.gen, r.store.puts)
	}
	if after.LongestHold <= 0 {
		t.Fatalf("the compaction's hold of the appends was not noted: %+v", after)
	}
	if after.LogBytes <= headerSize+after.Snapshot {
		t.Fatalf("the new memfd holds %d bytes after a snapshot of %d: the records appended meanwhile are missing", after.LogBytes-headerSize, after.Snapshot)
	}
	// The records copied take their room from the log's room, up to half
	// of it (here they are many times the room: the rest is added).
	room, copied := max(uint64(minLog), after.Snapshot), after.LogBytes-headerSize-after.Snapshot
	if want := roundPage(after.Snapshot + room + max(copied, room/2) - room/2 + 32); after.Capacity-headerSize != want {
		t.Fatalf("a log of %d bytes after a snapshot of %d and %d bytes of records copied: want %d", after.Capacity-headerSize, after.Snapshot, copied, want)
	}
	must(t, r.load().Check(r.p.Export()))
	// And the books go on: more compactions, all aside.
	asideHook = nil
	for i := range 5000 {
		r.step(i)
	}
	r.b.settle()
	for i := 5000; r.b.Stats().Compactions < after.Compactions+2; i++ { // on a busy machine few may have ended
		r.step(i)
		r.b.settle()
	}
	must(t, r.load().Check(r.p.Export()))
	if s := r.b.Stats(); s.Compactions < after.Compactions+2 || r.store.puts != int(s.Compactions)+1 {
		t.Fatalf("books %+v after %d puts", s, r.store.puts)
	}
	r.b.Close()
}

// TestCompactionAsideFails: a compaction aside that fails changes nothing
// (the books go on in the grown memfd the keeper holds), and the next full
// log compacts in line, as every compaction did before.
func TestCompactionAsideFails(t *testing.T) {
	r, h := asideRig(t, 22)
	gen, puts := r.b.Stats().Gen, r.store.puts
	errNoMemory := errors.New("no memory for a memfd")
	h.fail.Store(&errNoMemory)
	close(h.release)
	r.b.settle()
	if s := r.b.Stats(); s.Gen != gen || r.store.puts != puts {
		t.Fatalf("a failed compaction changed the books: %+v, %d puts (was generation %d, %d puts)", s, r.store.puts, gen, puts)
	}
	must(t, r.load().Check(r.p.Export()))
	// The next full log compacts in line: the record that filled it
	// returns after the new memfd was handed over.
	for i := 0; r.store.puts == puts; i++ {
		if i == 100000 {
			t.Fatal("the log never filled again")
		}
		r.step(i)
	}
	if s := r.b.Stats(); s.LongestHold <= 0 {
		t.Fatalf("the compaction in line held the appends, and no hold was noted: %+v", s)
	}
	if r.b.aside != nil || r.b.asideErr != nil || r.store.gen != gen+1 {
		t.Fatalf("after the compaction in line: aside %v, error %v, the keeper's generation %d", r.b.aside, r.b.asideErr, r.store.gen)
	}
	must(t, r.load().Check(r.p.Export()))
	r.b.Close()
}

// TestCompactionAsideOvertaken: a compaction in line while one runs aside
// (Rehand, after a keeper loss) makes the one aside stale: it is dropped,
// and the books are the in-line one's and what came after it.
func TestCompactionAsideOvertaken(t *testing.T) {
	r, h := asideRig(t, 23)
	gen := r.b.Stats().Gen
	fresh := &memStore{}
	withoutWaiting(t, "Rehand", func() { must(t, r.b.Rehand(fresh)) })
	for i := range 50 {
		r.step(i)
	}
	close(h.release)
	r.b.settle()
	if s := r.b.Stats(); s.Gen != gen+1 || fresh.gen != gen+1 || fresh.puts != 1 {
		t.Fatalf("books %+v, the new keeper's generation %d after %d puts; want %d after one", s, fresh.gen, fresh.puts, gen+1)
	}
	r.store = fresh
	must(t, r.load().Check(r.p.Export()))
	r.b.Close()
}

// TestCloseWaitsForTheCompactionAside: Close returns once the compaction
// aside has ended, and drops it: the keeper keeps the memfd it held, whole.
func TestCloseWaitsForTheCompactionAside(t *testing.T) {
	r, h := asideRig(t, 24)
	gen, puts := r.b.Stats().Gen, r.store.puts
	closed := make(chan struct{})
	go func() {
		r.b.Close()
		close(closed)
	}()
	select {
	case <-closed:
		t.Fatal("Close returned while a compaction ran aside")
	case <-time.After(50 * time.Millisecond):
	}
	close(h.release)
	<-closed
	if r.store.gen != gen || r.store.puts != puts {
		t.Fatalf("a compaction installed after Close: the keeper holds generation %d after %d puts, want %d after %d", r.store.gen, r.store.puts, gen, puts)
	}
	st, _, err := Load(r.store.f)
	must(t, err)
	must(t, st.Check(r.p.Export()))
}

// TestLogPagesPresentAhead: the log's pages past the last record are
// present before a record is written there (populateLocked), so that an
// append does not take the page fault of a sparse memfd's fresh page.
func TestLogPagesPresentAhead(t *testing.T) {
	r := newRig(t, 25)
	defer r.b.Close()
	for i := range 3000 {
		r.step(i)
		if i%500 != 0 {
			continue
		}
		r.b.mu.Lock()
		if r.b.noPopulate {
			r.b.mu.Unlock()
			t.Skip("this kernel cannot populate a mapping (MADV_POPULATE_WRITE, Linux 5.14)")
		}
		from, to := r.b.off&^4095, min(roundPage(r.b.off+ahead), r.b.end)
		vec := make([]byte, (to-from)/4096)
		_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&r.b.mem[from])), uintptr(to-from), uintptr(unsafe.Pointer(&vec[0])))
		r.b.mu.Unlock()
		if errno != 0 {
			t.Fatalf("mincore: %v", errno)
		}
		for p, v := range vec {
			if v&1 == 0 {
				t.Fatalf("after %d changes the log ends at %d; its page at %d is not present", i+1, r.b.off, from+uint64(p)*4096)
			}
		}
	}
}

// TestSizes: the kept books' snapshot and records, told from the framing
// of the snapshot's parts, are what the books wrote: at start (the
// snapshot of a fresh state), after changes, and after a compaction into
// many parts. Books it cannot read are all records.
func TestSizes(t *testing.T) {
	check := func(r *rig, what string) {
		t.Helper()
		r.b.settle()
		s := r.b.Stats()
		snap, recs := Sizes(r.store.f)
		logged := int64(s.LogBytes - headerSize - s.Snapshot)
		if snap != int64(s.Snapshot) || recs < logged || recs > logged+2*ahead+4096 {
			t.Fatalf("%s: Sizes = %d and %d, the books wrote a snapshot of %d and %d bytes of records", what, snap, recs, s.Snapshot, logged)
		}
	}
	r := newRig(t, 26)
	defer r.b.Close()
	check(r, "at start")
	for i := range 2000 {
		r.step(i)
	}
	check(r, "after 2000 changes")
	oldPart := snapPart
	snapPart = 256
	must(t, r.b.Rehand(r.store))
	snapPart = oldPart
	for i := range 300 {
		r.step(i)
	}
	if s := r.b.Stats(); s.Snapshot < 3*256 {
		t.Fatalf("a snapshot of %d bytes: want many parts", s.Snapshot)
	}
	check(r, "compacted in parts")

	if snap, recs := Sizes(nil); snap != 0 || recs != 0 {
		t.Fatalf("no books: %d and %d", snap, recs)
	}
	fd, err := unix.MemfdCreate("not-books", unix.MFD_CLOEXEC)
	must(t, err)
	f := os.NewFile(uintptr(fd), "not-books")
	defer f.Close()
	if _, err := f.WriteAt(bytes.Repeat([]byte{0xff}, 3<<20), 0); err != nil {
		t.Fatal(err)
	}
	if snap, recs := Sizes(f); snap != 0 || recs != 3<<20-headerSize {
		t.Fatalf("3 MiB that are not books: %d and %d, want all records", snap, recs)
	}
	// A snapshot of more parts than any books hold: the walk stops short
	// of its last part, and the whole counts as records.
	var many bytes.Buffer
	many.Write(make([]byte, headerSize))
	for i := range maxSizesParts + 1 {
		flags := byte(0)
		if i == maxSizesParts {
			flags = partLast
		}
		many.Write([]byte{2, 0, 0, 0, 0, 0, 0, 0, recSnapshotPart, flags, 0, 0, 0, 0, 0, 0})
	}
	g, err := os.CreateTemp(t.TempDir(), "parts")
	must(t, err)
	defer g.Close()
	_, err = g.Write(many.Bytes())
	must(t, err)
	if snap, recs := Sizes(g); snap != 0 || recs <= 0 {
		t.Fatalf("%d parts, the last flagged: %d and %d, want all records", maxSizesParts+1, snap, recs)
	}
}

// TestCompactIfQuiet: books left quiet are compacted beside the appends
// once their records are worth it, and a restart then replays a snapshot
// with nothing after it; busy books, records too few beside the snapshot,
// a compaction already running and books no store holds are left as they
// are.
func TestCompactIfQuiet(t *testing.T) {
	r := newRig(t, 33)
	for i := range 3000 {
		r.step(i)
	}
	before := r.b.Stats()
	recs := before.LogBytes - headerSize - before.Snapshot
	for _, c := range []struct {
		name  string
		quiet time.Duration
		from  uint64
	}{
		{"appended within the hour", time.Hour, 1},
		{"records below the bound", 0, recs + 1},
	} {
		if r.b.CompactIfQuiet(c.quiet, c.from) != nil {
			t.Fatalf("%s: compacted", c.name)
		}
		r.b.settle()
		if s := r.b.Stats(); s.Gen != before.Gen || r.store.puts != 1 {
			t.Fatalf("%s: books %+v after %d puts, want them as they were: %+v", c.name, s, r.store.puts, before)
		}
	}
	h := holdAside(t)
	done := r.b.CompactIfQuiet(0, recs)
	if done == nil {
		t.Fatalf("quiet books with %d bytes of records after a snapshot of %d: not compacted", recs, before.Snapshot)
	}
	<-h.stopped
	if r.b.CompactIfQuiet(0, 1) != nil {
		t.Fatal("a second compaction began beside the first")
	}
	select {
	case <-done:
		t.Fatal("the compaction said it ended while held")
	default:
	}
	close(h.release)
	<-done
	after := r.b.Stats()
	if after.Gen != before.Gen+1 || r.store.gen != after.Gen || r.store.puts != 2 || after.LogBytes != headerSize+after.Snapshot {
		t.Fatalf("after the quiet compaction: books %+v, the keeper's generation %d after %d puts; want the next generation, all snapshot", after, r.store.gen, r.store.puts)
	}
	must(t, r.load().Check(r.p.Export()))
	if r.b.CompactIfQuiet(0, 1) != nil {
		t.Fatal("compacted again with no record since")
	}
	// A few changes more: records far below a quarter of the snapshot.
	for i := range 20 {
		r.step(3000 + i)
	}
	if s := r.b.Stats(); s.LogBytes == headerSize+s.Snapshot || s.LogBytes-headerSize-s.Snapshot >= s.Snapshot/4 {
		t.Fatalf("the rig: %d bytes of records after a snapshot of %d, want some below a quarter of it", s.LogBytes-headerSize-s.Snapshot, s.Snapshot)
	}
	if r.b.CompactIfQuiet(0, 1) != nil {
		t.Fatalf("compacted for %d bytes of records after a snapshot of %d", r.b.Stats().LogBytes-headerSize-after.Snapshot, after.Snapshot)
	}
	// No store holds the books (the keeper is lost): a compaction would
	// only hand them to nobody.
	for i := range 3000 {
		r.step(4000 + i)
	}
	r.store.fail = errors.New("keeper lost")
	if err := r.b.Rehand(r.store); err == nil {
		t.Fatal("handed to a failing store")
	}
	for i := range 3000 {
		r.step(8000 + i)
	}
	if s := r.b.Stats(); s.LogBytes-headerSize-s.Snapshot < s.Snapshot/4 {
		t.Fatalf("the rig: %d bytes of records after a snapshot of %d, want a quarter of it at least", s.LogBytes-headerSize-s.Snapshot, s.Snapshot)
	}
	if r.b.CompactIfQuiet(0, 1) != nil {
		t.Fatal("compacted books no store holds")
	}
	r.store.fail = nil
	must(t, r.b.Rehand(r.store))
	must(t, r.load().Check(r.p.Export()))
	r.b.Close()
	if r.b.CompactIfQuiet(0, 1) != nil {
		t.Fatal("compacted closed books")
	}
}

// TestCompactIfQuietCountsFromStart: books a restarted agent starts from
// kept records are not quiet until quiet has passed since they started.
func TestCompactIfQuietCountsFromStart(t *testing.T) {
	r := newRig(t, 34)
	for i := range 3000 {
		r.step(i)
	}
	r.b.Close()
	st, info, err := Load(r.store.f)
	must(t, err)
	store := r.store
	puts := store.puts
	b, err := Start(st, info.Gen, store, func(err error) { t.Errorf("fatal: %v", err) })
	must(t, err)
	defer b.Close()
	if s := b.Stats(); s.LogBytes-headerSize-s.Snapshot < max(1, s.Snapshot/4) {
		t.Fatalf("the rig: %d bytes of records kept after a snapshot of %d", s.LogBytes-headerSize-s.Snapshot, s.Snapshot)
	}
	if b.CompactIfQuiet(time.Hour, 1) != nil {
		t.Fatal("compacted within the hour after starting")
	}
	done := b.CompactIfQuiet(0, 1)
	if done == nil {
		t.Fatal("kept records not compacted")
	}
	<-done
	if s := b.Stats(); s.LogBytes != headerSize+s.Snapshot || store.puts != puts+1 {
		t.Fatalf("after the compaction: %+v after %d puts", s, store.puts)
	}
}

// TestStartCopiesALogPastItsRoom: an agent killed while a compaction ran
// beside the appends leaves a log grown past the room a compaction of its
// snapshot leaves. Up to twice that room, the next agent's start copies
// it rather than compacting it (a compaction there ran beside the pool's
// rebuild, before the agent served), and its first records start the
// compaction again, beside them; past twice the room, the start compacts
// (TestStartCompactsALongKeptLog).
func TestStartCopiesALogPastItsRoom(t *testing.T) {
	r, h := asideRig(t, 23)
	defer func() {
		close(h.release)
		r.b.settle()
		r.b.Close()
	}()
	// Appends go on into the live memfd, which grows past its room. (The
	// rig's log filled at 4 KiB, and it stepped on while the compaction
	// began: a start here sees a room of 20 KiB, within which the log
	// grows to half as much again.)
	minLog = 20 << 10 // asideRig's cleanup puts it back
	s := r.b.Stats()
	room := s.Snapshot + max(uint64(minLog), s.Snapshot)
	for i := 0; r.b.Stats().LogBytes-headerSize+64 <= room+room/2; i++ {
		r.step(i)
	}
	// Killed now: the keeper holds that memfd.
	kept := snapshotMem(t, r.store.f)
	st, info, err := Load(r.store.f)
	must(t, err)
	end, snap := st.srcEnd, st.snapEnd-headerSize
	if k := end - headerSize + 64; snap != s.Snapshot || k <= room || k > 2*room {
		t.Fatalf("kept %d bytes after a snapshot of %d: want past the room of %d, within twice it", end-headerSize, snap, room)
	}
	want := st.Image()
	store := &memStore{}
	b, err := Start(st, info.Gen, store, func(err error) { t.Errorf("fatal: %v", err) })
	must(t, err)
	defer b.Close()
	started := b.Stats()
	if started.Gen != info.Gen+1 || started.LogBytes != end || started.Snapshot != snap || !bytes.Equal(b.mem[headerSize:end], kept[headerSize:end]) {
		t.Fatalf("started with %+v: want the kept log of %d bytes copied into generation %d", started, end-headerSize, info.Gen+1)
	}
	st2, _, err := Load(store.f)
	must(t, err)
	must(t, st2.Check(want))
	// Its first records fill the copy and start a compaction aside
	// (asideHook still holds the old agent's, not this one's).
	asideHook = nil
	sid := want.Sessions[0].ID
	for seq := uint32(1); b.Stats().Compactions == started.Compactions; seq++ {
		if seq > 100000 {
			t.Fatal("no compaction after 100,000 records")
		}
		// A discard of a stream the session does not hold: recorded,
		// and replayed as nothing.
		must(t, b.Session(server.SessionOp{Session: sid, Op: wire.OpDiscard, Seq: seq, Rid: "none", Label: "none"}))
		b.settle()
	}
	after := b.Stats()
	if after.LogBytes-headerSize-after.Snapshot >= end-headerSize-snap {
		t.Fatalf("after the compaction: %d bytes of records after a snapshot of %d, want fewer than the %d kept", after.LogBytes-headerSize-after.Snapshot, after.Snapshot, end-headerSize-snap)
	}
	st3, _, err := Load(store.f)
	must(t, err)
	must(t, st3.Check(want))
}
