package agent

import (
	"fmt"
	"log/slog"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/internal/keeper"
	"github.com/kvpool/kvpool/internal/logging"
	"github.com/kvpool/kvpool/pkg/wire"
)

// A spare's read ahead: the books it followed while the first agent served
// are finished at the next start, which replays only the records committed
// after the spare's last read, and restores the same pool as a replay of
// the whole books.
func TestRestoreFinishesTheBooksReadAhead(t *testing.T) {
	dir := t.TempDir()
	ksock, a1, stop1, offload := offloadingAgent(t, dir)
	for i := range 200 {
		offload(fmt.Sprintf("early-%03d", i))
	}
	ra := StartReadAhead(ksock, 5*time.Millisecond, 0, nil)
	waitUntil(t, "the spare following the books", func() bool { return ra.reads.Load() > 0 })
	ra.Stop()
	waitUntil(t, "the spare's hand-over", func() bool { return len(ra.out) == 1 })
	// Committed after the spare's last read: the restore replays these.
	for i := range 50 {
		offload(fmt.Sprintf("late-%03d", i))
	}
	want := a1.Pool().Export()
	stop1()

	a2, stop2 := bootAgent(t, Options{Config: a1.a.cfg, Standalone: true, ChunksPerGPU: 2, ChunkBytes: 2 << 20, Logger: quietLog, ReadAhead: ra})
	steps := a2.a.restart.steps
	// Nothing the spare read stays reachable from what the process keeps
	// (cmd/agent holds the ReadAhead until the agent ends): the replayed
	// state is the restore's garbage, handed back once the agent serves.
	if ra.fl != nil || ra.taken.fl != nil {
		stop2()
		t.Fatal("the ReadAhead still holds the follower, and with it the replayed state")
	}
	if steps == nil || !steps.ReadAhead {
		stop2()
		t.Fatalf("the restore did not finish the books read ahead: %+v", steps)
	}
	if got := a2.Pool().Export(); !reflect.DeepEqual(got, want) {
		stop2()
		t.Fatalf("the pool restored from the books read ahead differs:\n%+v\n%+v", got, want)
	}
	// The whole books, replayed by the next start (no spare), restore
	// the same pool; the spare's restore replayed only part of them.
	stop2()
	a3, stop3 := keptAgent(t, dir, ksock, []string{"tenant-a"})
	defer stop3()
	whole := a3.a.restart.steps
	if whole == nil || whole.ReadAhead {
		t.Fatalf("a start without a spare: %+v", whole)
	}
	if got := a3.Pool().Export(); !reflect.DeepEqual(got, want) {
		t.Fatalf("the pool restored from the whole books differs:\n%+v\n%+v", got, want)
	}
	if steps.ReplayedBytes <= 0 || steps.ReplayedBytes >= whole.ReplayedBytes {
		t.Fatalf("replayed %d bytes after the read ahead, %d whole: want some, fewer", steps.ReplayedBytes, whole.ReplayedBytes)
	}
	t.Logf("replayed %d bytes after the read ahead, %d whole", steps.ReplayedBytes, whole.ReplayedBytes)
}

// A spare slow to answer its turn (its loop not scheduled for a while on
// a busy node) is waited for by the restore, up to takeWait from the
// turn, while the start-up's steps before it run: its books are finished,
// not replayed whole. One slower than that is dropped, and the restore
// replays the books whole: the same pool either way.
func TestRestoreWaitsForASlowSpare(t *testing.T) {
	defer func(w time.Duration) { takeWait, handOverHook = w, nil }(takeWait)
	for _, c := range []struct {
		name      string
		wait      time.Duration
		late      time.Duration // how long the loop takes to answer the turn
		readAhead bool
	}{
		// Past the 20 ms the turn once waited for, before the steps.
		{"answers within takeWait", 2 * time.Second, 60 * time.Millisecond, true},
		{"answers past takeWait", 30 * time.Millisecond, 300 * time.Millisecond, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			takeWait = c.wait
			answered := make(chan struct{})
			handOverHook = func() { time.Sleep(c.late); close(answered) }
			dir := t.TempDir()
			ksock, a1, stop1, offload := offloadingAgent(t, dir)
			for i := range 100 {
				offload(fmt.Sprintf("early-%03d", i))
			}
			ra := StartReadAhead(ksock, 5*time.Millisecond, 0, nil)
			waitUntil(t, "the spare following the books", func() bool { return ra.reads.Load() > 0 })
			want := a1.Pool().Export()
			stop1()
			turn := time.Now()
			ra.Stop()
			a2, stop2 := bootAgent(t, Options{Config: a1.a.cfg, Standalone: true, ChunksPerGPU: 2, ChunkBytes: 2 << 20, Logger: quietLog, ReadAhead: ra})
			defer stop2()
			s := a2.a.restart.steps
			if s == nil || s.ReadAhead != c.readAhead {
				t.Fatalf("a spare answering its turn after %v, waited for %v: restore %+v, want readAhead %v", c.late, c.wait, s, c.readAhead)
			}
			if c.readAhead && s.SpareSeconds <= 0 {
				t.Fatalf("the restore waited %vs for a spare that answered its turn after %v", s.SpareSeconds, c.late)
			}
			if c.readAhead && time.Since(turn) < c.late {
				t.Fatalf("the restore finished the books read ahead %v after the turn, before the spare answered (%v)", time.Since(turn), c.late)
			}
			if got := a2.Pool().Export(); !reflect.DeepEqual(got, want) {
				t.Fatalf("restored pool differs:\n%+v\n%+v", got, want)
			}
			// What the loop hands over after the restore stopped waiting
			// is taken and closed, not left; one taken in time is not
			// late.
			<-answered
			if c.readAhead {
				if n := ra.lates.Load(); n != 0 {
					t.Fatalf("%d hand-overs taken as late, want none", n)
				}
			} else {
				waitUntil(t, "the late hand-over closed", func() bool { return ra.lates.Load() == 1 })
			}
		})
	}
}

// A spare keeps to its budget (restartInPlace.spareMemory): one whose
// read ahead holds more drops it, hands its heap back and reads no more,
// and the restore replays the books whole; one within it reads ahead as
// without a bound. The same pool either way.
func TestReadAheadKeepsToItsBudget(t *testing.T) {
	for _, c := range []struct {
		name      string
		budget    int64
		readAhead bool
	}{
		{"within", 1 << 30, true},
		{"over", 1 << 20, false}, // less than the runtime's own
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			ksock, a1, stop1, offload := offloadingAgent(t, dir)
			for i := range 100 {
				offload(fmt.Sprintf("early-%03d", i))
			}
			var logged logging.SyncBuffer
			log := slog.New(slog.NewTextHandler(&logged, nil))
			ra := StartReadAhead(ksock, 5*time.Millisecond, c.budget, log)
			if c.readAhead {
				waitUntil(t, "the spare following the books", func() bool { return ra.reads.Load() > 0 })
			} else {
				waitUntil(t, "the spare stopping for its budget", func() bool { return ra.overs.Load() > 0 })
			}
			want := a1.Pool().Export()
			stop1()
			ra.Stop()
			a2, stop2 := bootAgent(t, Options{Config: a1.a.cfg, Standalone: true, ChunksPerGPU: 2, ChunkBytes: 2 << 20, Logger: quietLog, ReadAhead: ra})
			defer stop2()
			if s := a2.a.restart.steps; s == nil || s.ReadAhead != c.readAhead {
				t.Fatalf("a spare with a budget of %d bytes: restore %+v, want readAhead %v", c.budget, s, c.readAhead)
			}
			if got := a2.Pool().Export(); !reflect.DeepEqual(got, want) {
				t.Fatalf("restored pool differs:\n%+v\n%+v", got, want)
			}
			if !c.readAhead && (ra.reads.Load() != 0 || ra.overs.Load() != 1) {
				t.Fatalf("a spare over its budget: %d reads, %d stops, want none and one", ra.reads.Load(), ra.overs.Load())
			}
			// The spare says so when it stops, not only at its turn.
			if warned := strings.Contains(logged.String(), "the spare stopped reading the books ahead"); warned == c.readAhead {
				t.Fatalf("a spare with a budget of %d bytes, read ahead %v: warned %v\n%s", c.budget, c.readAhead, warned, logged.String())
			}
		})
	}
}

// offloadingAgent starts a keeper and an agent kept by it (state in dir)
// with a session of tenant-a open, and returns the keeper's socket, the
// agent, what stops it, and what offloads a stream of two pages to it.
func offloadingAgent(t *testing.T, dir string) (string, *Agent, func(), func(rid string)) {
	t.Helper()
	ksock, _ := startKeeper(t)
	a, stop := keptAgent(t, dir, ksock, []string{"tenant-a"})
	w := dialAgent(t, a.Socket())
	w.open("tenant-a", "instance-a")
	return ksock, a, stop, func(rid string) {
		t.Helper()
		if st, msg := w.do(wire.OpOffload, &wire.Offload{Rid: rid, Label: "kv", GpuPages: []int32{1, 2}}, &wire.OffloadReply{}); st != 0 {
			t.Fatalf("offload %s: %s %s", rid, st, msg)
		}
	}
}

// Books the spare did not follow (it never read any: the keeper held none
// yet) leave the restore to replay the kept books whole.
func TestRestoreWithoutBooksReadAhead(t *testing.T) {
	dir := t.TempDir()
	ksock, _ := startKeeper(t)
	ra := StartReadAhead(ksock, 5*time.Millisecond, 0, nil)
	time.Sleep(20 * time.Millisecond) // a few reads of nothing
	ra.Stop()
	a1, stop1 := keptAgent(t, dir, ksock, []string{"tenant-a"})
	w := dialAgent(t, a1.Socket())
	w.open("tenant-a", "instance-a")
	if st, msg := w.do(wire.OpOffload, &wire.Offload{Rid: "r", Label: "kv", GpuPages: []int32{1}}, &wire.OffloadReply{}); st != 0 {
		t.Fatalf("offload: %s %s", st, msg)
	}
	want := a1.Pool().Export()
	stop1()
	a2, stop2 := bootAgent(t, Options{Config: a1.a.cfg, Standalone: true, ChunksPerGPU: 2, ChunkBytes: 2 << 20, Logger: quietLog, ReadAhead: ra})
	defer stop2()
	if s := a2.a.restart.steps; s == nil || s.ReadAhead || s.ReplayedBytes == 0 {
		t.Fatalf("a restore without books read ahead: %+v", s)
	}
	if got := a2.Pool().Export(); !reflect.DeepEqual(got, want) {
		t.Fatalf("restored pool differs:\n%+v\n%+v", got, want)
	}
}

// Books that compact while the spare follows them (quietly, here) are
// gone on into from where the spare stood, not read again, and the
// restore still finishes them: the same pool.
func TestReadAheadGoesOnThroughACompaction(t *testing.T) {
	oldAfter, oldFrom := quietCompactAfter, quietCompactFrom
	quietCompactAfter, quietCompactFrom = 50*time.Millisecond, 1
	defer func() { quietCompactAfter, quietCompactFrom = oldAfter, oldFrom }()
	ksock, a1, stop1, offload := offloadingAgent(t, t.TempDir())
	for i := range 200 {
		offload(fmt.Sprintf("early-%03d", i))
	}
	ra := StartReadAhead(ksock, 5*time.Millisecond, 0, nil)
	waitUntil(t, "the spare going on into the books' quiet compaction", func() bool { return ra.nexts.Load() > 0 })
	compactions := a1.a.restart.books.Stats().Compactions
	for i := range 30 {
		offload(fmt.Sprintf("late-%03d", i))
	}
	reads := ra.reads.Load()
	waitUntil(t, "the spare reading the late offloads", func() bool { return ra.reads.Load() > reads+2 })
	ra.Stop()
	want := a1.Pool().Export()
	stop1()
	a2, stop2 := bootAgent(t, Options{Config: a1.a.cfg, Standalone: true, ChunksPerGPU: 2, ChunkBytes: 2 << 20, Logger: quietLog, ReadAhead: ra})
	defer stop2()
	if s := a2.a.restart.steps; s == nil || !s.ReadAhead {
		t.Fatalf("the restore did not finish the books read ahead through %d compactions: %+v", compactions, s)
	}
	if got := a2.Pool().Export(); !reflect.DeepEqual(got, want) {
		t.Fatalf("the pool restored from books followed through a compaction differs:\n%+v\n%+v", got, want)
	}
}

// A spare takes the chunks ahead once they have stayed as they are, closes
// them as soon as the keeper's chunks change (a chunk replaced or dropped
// is not held in memory by the spare), takes them anew once settled, and
// at its turn the keeper hands over none of them: the restore adopts the
// ones it took, into the same pool.
func TestSpareTakesTheChunksAhead(t *testing.T) {
	defer func(s time.Duration) { aheadSettle = s }(aheadSettle)
	aheadSettle = 30 * time.Millisecond
	dir := t.TempDir()
	ksock, a1, stop1, offload := offloadingAgent(t, dir)
	for i := range 20 {
		offload(fmt.Sprintf("rid-%03d", i))
	}
	ra := StartReadAhead(ksock, 5*time.Millisecond, 0, nil)
	// What the spare holds now: the take's generation and files (none: 0).
	// The loop closes a take only once it is no longer ra.ahead.
	taken := func() (uint64, map[*os.File]bool) {
		ra.aheadMu.Lock()
		defer ra.aheadMu.Unlock()
		if ra.ahead == nil {
			return 0, nil
		}
		files := map[*os.File]bool{}
		for _, h := range ra.ahead.Chunks {
			files[h.File] = true
		}
		return ra.ahead.Gen, files
	}
	gen := func() uint64 {
		st, err := keeper.Query(ksock)
		if err != nil {
			t.Fatal(err)
		}
		return st.ChunkGen
	}
	waitUntil(t, "the spare taking the chunks", func() bool { g, _ := taken(); return g != 0 && g == gen() })
	firstGen, firstFiles := taken()
	if st, err := keeper.Query(ksock); err != nil || len(firstFiles) != st.Chunks || st.Chunks == 0 {
		t.Fatalf("the spare took %d chunks, the keeper holds %d (%v)", len(firstFiles), st.Chunks, err)
	}
	// A change to the keeper's chunks (an extra one, then dropped again).
	kc := a1.a.restart.client()
	extra := memfdFile(t, 4096)
	if err := kc.Put(keeper.Item{ID: "extra", Gen: 1, Size: 4096}, extra); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the spare letting go of the chunks it took before the change", func() bool { g, _ := taken(); return g != firstGen })
	if err := kc.Drop("extra"); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the spare taking the changed chunks", func() bool { g, _ := taken(); return g != 0 && g == gen() })
	_, files := taken()
	for f := range files {
		if firstFiles[f] {
			t.Fatal("the spare took the chunks anew, yet holds a file of its take before the change")
		}
	}
	want := a1.Pool().Export()
	ra.Stop()
	stop1()

	a2, stop2 := bootAgent(t, Options{Config: a1.a.cfg, Standalone: true, ChunksPerGPU: 2, ChunkBytes: 2 << 20, Logger: quietLog, ReadAhead: ra})
	defer stop2()
	if !a2.a.restart.chunksAhead {
		t.Fatal("the keeper handed the chunks over at the hello, though the spare held them")
	}
	a2.a.mu.RLock()
	for id, c := range a2.a.hmem {
		if !files[c.File] {
			t.Errorf("chunk %s: not the file the spare took ahead", id)
		}
	}
	a2.a.mu.RUnlock()
	if got := a2.Pool().Export(); !reflect.DeepEqual(got, want) {
		t.Fatalf("the pool restored from the chunks taken ahead differs:\n%+v\n%+v", got, want)
	}
}

// memfdFile is a sealable memfd of size bytes, closed at the test's end.
func memfdFile(t *testing.T, size int64) *os.File {
	t.Helper()
	fd, err := unix.MemfdCreate("extra", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "extra")
	t.Cleanup(func() { f.Close() })
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return f
}

// A spare whose keeper holds chunks and no books it can follow (none yet)
// takes the chunks all the same, and warms nothing for books it does not
// hold.
func TestSpareTakesTheChunksWithoutBooks(t *testing.T) {
	defer func(s time.Duration) { aheadSettle = s }(aheadSettle)
	aheadSettle = 0
	ksock, _ := startKeeper(t)
	kc, _, err := keeper.Connect(ksock, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer kc.Close()
	if err := kc.Put(keeper.Item{ID: "c0", Gen: 1, Size: 4096}, memfdFile(t, 4096)); err != nil {
		t.Fatal(err)
	}
	ra := StartReadAhead(ksock, 5*time.Millisecond, 0, nil)
	defer ra.Close()
	waitUntil(t, "the spare taking the chunk", func() bool {
		ra.aheadMu.Lock()
		defer ra.aheadMu.Unlock()
		return ra.ahead != nil && len(ra.ahead.Chunks) == 1
	})
	// The loop goes on past the take, ten more reads (a panic there ends
	// the test binary).
	time.Sleep(50 * time.Millisecond)
	if ra.halt.Load() {
		t.Fatal("the read ahead ended")
	}
}
