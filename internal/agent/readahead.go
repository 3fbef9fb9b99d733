package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpool/kvpool/internal/books"
	"github.com/kvpool/kvpool/internal/bytesize"
	"github.com/kvpool/kvpool/internal/keeper"
)

// ReadAheadEvery is how often a spare reads the books further: the records
// a restart then replays are at most those of this long (a few thousand
// at a busy agent's rate, a few ms), and each read costs a keeper request
// and the records read.
const ReadAheadEvery = 100 * time.Millisecond

// ReadAhead is a spare agent's work ahead of its turn, so that a restart
// in place does little more than rebuild the pool's tables:
//
//   - it asks the keeper for the books it holds and replays them as the
//     serving agent appends (books.Follower): the restore then replays only
//     the records committed since the last read, not the whole books (the
//     replay was most of a restart's gap at the agent's bound:
//     docs/benchmarks.md, "A spare reads the books ahead"); books that
//     compact into a fresh memfd are followed on from where the last read
//     stood in the old one (the snapshot is not read again), other
//     memfds anew;
//   - it makes resident the heap the rest of the restore will take (the
//     warm heap, warmSize, less the replayed state's own) and lets it go,
//     so that the restore allocates in it instead of faulting it in;
//   - it takes every chunk's memfd from the keeper once the chunks have
//     stayed as they are for a while (takeAhead), and closes them as soon
//     as the keeper's chunks change: the turn's hello then hands over none
//     of them where they are still the keeper's (keeper.ConnectWith), the
//     hand-over being most of a restart's gap on a node of thousands of
//     chunks (docs/benchmarks.md, "A restart of many chunks").
//
// A keeper that does not answer a follow (older than it), or books that
// cannot be followed, leave the restore to do it all, as without a spare.
// What the spare holds is about the memory a restore takes at its peak,
// and at most its budget (restartInPlace.spareMemory): past it, it stops.
type ReadAhead struct {
	stop      chan struct{}
	stopOnce  sync.Once
	halt      atomic.Bool    // set at the turn: a read in progress stops at the next record
	doing     atomic.Int32   // what the loop does now (a phase), for the turn's word on a late read
	out       chan readAhead // the loop's last word
	gcPercent int            // before the loop turned the collector off
	budget    int64          // the most memory the loop may hold (0: no bound)
	log       *slog.Logger   // where the loop says it stopped for its budget (nil: nowhere)
	// The loop's own.
	fl   *books.Follower
	huge bool
	err  error
	// reads: reads that left books followed; nexts: compactions gone on
	// into (tests wait for them).
	reads, nexts atomic.Int64
	// overs: reading ahead ended for the budget; lates: hand-overs the
	// restore no longer waited for, closed when they came (tests).
	overs, lates atomic.Int64
	// lastTop is when the warm heap was last topped up.
	lastTop time.Time
	// The chunks taken ahead (takeAhead): ahead, guarded by aheadMu with
	// aheadTaken (the agent took them: the loop keeps none it takes
	// after); genSeen is the keeper's chunk generation the loop last saw,
	// since genSince; noHeld: the keeper answers no held request.
	aheadMu    sync.Mutex
	ahead      *keeper.Ahead
	aheadTaken bool
	genSeen    uint64
	genSince   time.Time
	noHeld     bool
	settle     time.Duration // aheadSettle when the loop started
	// The agent's, after Stop: when the turn came, whether the loop's
	// last word was taken (or left to a goroutine that closes it), and
	// what was taken.
	turn  time.Time
	took  bool
	taken readAhead
}

// readAhead is what the loop hands over when it ends.
type readAhead struct {
	fl   *books.Follower
	huge bool  // the warm heap was asked for in huge pages
	err  error // why the last read failed, if it did
}

// What the loop does (ReadAhead.doing).
const (
	phaseAsk int32 = iota
	phaseRead
	phaseCollect
	phaseWarm
	phaseLetGo
)

var phases = [...]string{phaseAsk: "asking the keeper", phaseRead: "reading the books", phaseCollect: "collecting garbage",
	phaseWarm: "warming the heap", phaseLetGo: "letting the warm heap go"}

// takeWait bounds how long the restore waits, from the turn, for the read
// in progress that the turn halted: it stops at the next record (or batch
// of records or of a snapshot's requests, a few ms at most), and the
// restore goes on from there; a piece of warm heap takes less. The
// start-up's steps before the restore (the keeper's hand-over, the plan)
// run meanwhile, so a loop that answers in time costs the restart
// nothing. Past takeWait (a loop not scheduled for that long, or a keeper
// that does not answer its follow) what it read is dropped and the
// restore replays the books whole, which at the agent's bound takes about
// as long (100-300 ms on a 2-vCPU VM): waiting longer could only lose.
// The turn used to wait 20 ms itself, before the start-up's steps: under
// four busy clients on two CPUs, 5-7 turns in 200 found the loop not yet
// scheduled and replayed whole.
var takeWait = 250 * time.Millisecond

// StartReadAhead starts reading ahead the books the keeper at socket holds,
// every `every`, holding at most budget bytes (0: no bound;
// restartInPlace.spareMemory); log, if not nil, hears when it stops for
// that.
func StartReadAhead(socket string, every time.Duration, budget int64, log *slog.Logger) *ReadAhead {
	ra := &ReadAhead{stop: make(chan struct{}), out: make(chan readAhead, 1), budget: budget, log: log, settle: aheadSettle}
	// The collector runs when the loop says (collect): left to itself,
	// with the followed state live, the runtime hands the free heap the
	// loop warmed back to the system within seconds (8 s after a warm of
	// 81 MiB, 33 MiB were left: docs/benchmarks.md).
	ra.gcPercent = debug.SetGCPercent(-1)
	go ra.loop(socket, every)
	return ra
}

// garbageMost is the garbage the loop lets build up before it collects:
// each read leaves a little (a keeper request, the records' decoding), a
// memfd followed anew the state of the last one.
const garbageMost = 8 << 20

// collect runs the collector where the loop's garbage calls for it (or
// force).
func (ra *ReadAhead) collect(force bool) {
	if force || heapMetric("/memory/classes/heap/objects:bytes")-heapMetric("/gc/heap/live:bytes") >= garbageMost {
		collectKeeping(holdFree()) // the warm heap stays resident
	}
}

func (ra *ReadAhead) loop(socket string, every time.Duration) {
	defer func() {
		if !ra.halt.Load() {
			// Ended before the turn (the books past the budget, a keeper
			// that answers no follow): nothing checks the chunks taken
			// ahead any more, so none is held.
			ra.aheadMu.Lock()
			a := ra.ahead
			ra.ahead = nil
			ra.aheadMu.Unlock()
			a.Close()
		}
		last := readAhead{ra.fl, ra.huge, ra.err}
		ra.fl = nil // handed over: the follower holds the replayed state
		if handOverHook != nil {
			handOverHook()
		}
		ra.out <- last
	}()
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		if !ra.read(socket) {
			return
		}
		ra.takeAhead(socket)
		select {
		case <-ra.stop:
			return
		case <-t.C:
		}
	}
}

// read reads the books further once and tops the warm heap up; false:
// the keeper cannot hand the books to a follower, and reading ahead ends.
func (ra *ReadAhead) read(socket string) bool {
	ra.doing.Store(phaseAsk)
	f, _, err := keeper.Follow(socket)
	switch {
	case errors.Is(err, keeper.ErrNoFollow):
		ra.err = err
		return false
	case err != nil: // not up yet, or gone: asked again next time
		ra.err = err
		return true
	case f == nil:
		ra.drop()
		return true
	case ra.fl != nil && ra.fl.Follows(f):
		f.Close()
		ra.doing.Store(phaseRead)
		if ra.err = ra.fl.Advance(); ra.err != nil {
			ra.drop()
		}
	case ra.fl != nil && ra.next(f):
	default:
		ra.drop()
		if ra.halt.Load() {
			f.Close()
			return false
		}
		ra.doing.Store(phaseCollect)
		ra.collect(true) // the last state, before the next is read
		ra.doing.Store(phaseRead)
		ra.fl, ra.err = books.Follow(f, &ra.halt)
	}
	if ra.halt.Load() {
		return false // the turn came: hand over what was read
	}
	ra.doing.Store(phaseCollect)
	ra.collect(false)
	if ra.fl != nil && ra.budget > 0 && held() > ra.budget {
		ra.overBudget()
		return false
	}
	if ra.fl != nil {
		ra.reads.Add(1)
		if time.Since(ra.lastTop) >= topUpEvery {
			ra.doing.Store(phaseWarm)
			ra.topUp()
			ra.lastTop = time.Now()
		}
	}
	return true
}

// aheadSettle is how long the keeper's chunks stay as they are before a
// spare takes them ahead: not while a pool is being allocated (each chunk
// a new generation) or reclaimed, when every take would soon be stale.
var aheadSettle = time.Second

// takeAhead keeps the spare's chunks taken ahead those the keeper holds:
// the ones taken are closed as soon as the keeper's generation is no
// longer theirs (a chunk dropped or replaced is then not held in memory
// by the spare past this read), and the chunks are taken anew once they
// have stayed as they are for aheadSettle.
func (ra *ReadAhead) takeAhead(socket string) {
	if ra.noHeld || ra.halt.Load() {
		return
	}
	st, err := keeper.Query(socket)
	if err != nil || st.ChunkGen == 0 { // gone, or a keeper before generations
		return
	}
	ra.aheadMu.Lock()
	stale := ra.ahead
	if stale != nil && stale.Gen == st.ChunkGen {
		stale = nil
	} else {
		ra.ahead = nil
	}
	have := ra.ahead != nil
	ra.aheadMu.Unlock()
	stale.Close()
	switch {
	case have:
		return
	case st.ChunkGen != ra.genSeen:
		ra.genSeen, ra.genSince = st.ChunkGen, time.Now()
		return
	case st.Chunks == 0 || time.Since(ra.genSince) < ra.settle:
		return
	}
	a, err := keeper.TakeHeld(socket)
	if errors.Is(err, keeper.ErrNoHeld) {
		ra.noHeld = true
	}
	if err != nil {
		return
	}
	ra.aheadMu.Lock()
	if ra.aheadTaken {
		defer a.Close()
	} else {
		ra.ahead, a = a, nil
	}
	ra.aheadMu.Unlock()
	// The take's garbage (its packets, their decoding) goes now, and the
	// warm heap it used is made up at once: a turn soon after a take found
	// 7 MiB of it free where 70 were wanted, and faulted 2,600 pages in
	// (16,384 chunks: 158 ms against 116).
	ra.doing.Store(phaseCollect)
	ra.collect(true)
	if ra.fl != nil { // the books followed: the warm heap is sized by them
		ra.doing.Store(phaseWarm)
		ra.topUp()
		ra.lastTop = time.Now()
	}
}

// takeChunks hands the agent the chunks taken ahead (nil: none), once;
// the loop keeps none it takes later.
func (ra *ReadAhead) takeChunks() *keeper.Ahead {
	ra.aheadMu.Lock()
	defer ra.aheadMu.Unlock()
	ra.aheadTaken = true
	a := ra.ahead
	ra.ahead = nil
	return a
}

// next goes on to f where it is the compaction of the followed books
// (books.Follower.Next): true where it did, or where reading the old
// memfd to its end failed (f closed; followed anew next time).
func (ra *ReadAhead) next(f *os.File) bool {
	ra.doing.Store(phaseRead)
	err := ra.fl.Next(f)
	switch {
	case err == nil:
		ra.nexts.Add(1)
		ra.err = ra.fl.Advance()
	case errors.Is(err, books.ErrNotNext):
		return false
	default:
		ra.err = err
		f.Close()
	}
	if ra.err != nil {
		ra.drop()
	}
	return true
}

// topUpEvery bounds how often the warm heap is topped up: while the
// books grow fast (an agent filling), each top-up allocates and collects.
const topUpEvery = time.Second

// topUp makes the heap hold, resident and free, what the rest of a
// restore of the books read so far would take: the whole restore's
// (warmSize) less the heap the replayed state already holds, and at
// least as much as the state (the pool's tables the rebuild makes take
// about as much). The pieces are made resident and let go here, so that
// the restore finds them free without a collection of its own (which, the
// state being live, took 17 ms at the agent's bound); the loop's
// collections keep it resident (collectKeeping), short of a memory limit.
func (ra *ReadAhead) topUp() {
	snap, recs := ra.fl.Sizes()
	want := warmWant(snap, recs, ra.fl.Chunks())
	if ra.budget > 0 {
		// Held after the top-up: what is held now and the free heap it
		// adds.
		want = min(want, ra.budget-held()+heapFree())
	}
	if want-heapFree() < warmPiece {
		return
	}
	// The allocator takes the free heap first: pieces of want bytes
	// leave want free.
	more, huge := warmPieces(want, 1, ra.stop)
	select {
	case <-ra.stop: // the turn came: no collection for pieces it does not wait for
		clear(more)
	default:
		ra.doing.Store(phaseLetGo)
		letGo(more)
		ra.huge = ra.huge || huge
	}
}

// warmWant is the free heap a restore of books of snapshot and records
// bytes naming chunks chunks wants resident where a follower holds what it
// read of them: the whole restore's (warmSize) less the heap already live,
// and at least the live heap again (the pool's tables the rebuild makes
// take about as much as the replayed state).
func warmWant(snapshot, records int64, chunks int) int64 {
	live := heapMetric("/gc/heap/live:bytes")
	return max(warmSize(snapshot, records, chunks, memoryLimit())-live, min(live, warmMost))
}

// heapFree is the heap that is free and resident.
func heapFree() int64 { return heapMetric("/memory/classes/heap/free:bytes") }

// held is the memory the process holds from the system, less what it
// handed back: what its memory cgroup is charged for it, about.
func held() int64 {
	return heapMetric("/memory/classes/total:bytes") - heapMetric("/memory/classes/heap/released:bytes")
}

// overBudget drops what was read, hands the heap back to the system and
// ends the reading ahead: the state alone takes more than the budget (the
// books grew past what the spare was given), and the next restart
// replays the books whole.
func (ra *ReadAhead) overBudget() {
	h := held()
	ra.drop()
	ra.err = fmt.Errorf("the spare's read ahead held %s, more than restartInPlace.spareMemory %s: it stopped", bytesize.Approx(h), bytesize.Exact(ra.budget))
	ra.overs.Add(1)
	runtime.GC()
	debug.FreeOSMemory()
	if ra.log != nil {
		ra.log.Warn("the spare stopped reading the books ahead: they take more memory than restartInPlace.spareMemory; "+
			"the next restart in place replays them whole", bytesize.Attr("held", h), "spareMemory", bytesize.Exact(ra.budget))
	}
}

func heapMetric(name string) int64 {
	s := []metrics.Sample{{Name: name}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return int64(s[0].Value.Uint64())
}

func (ra *ReadAhead) drop() {
	if ra.fl != nil {
		ra.fl.Close()
		ra.fl = nil
	}
	ra.huge = false
}

// handOverHook, where a test sets it, runs in the loop before it hands
// over what it read (a loop that is slow to answer the turn).
var handOverHook func()

// Stop is the turn: it ends the reading ahead without waiting for it (a
// read in progress is halted at its next record), and the agent then
// takes what was read (take, in the restore) and Closes it. Stop may be
// called more than once.
func (ra *ReadAhead) Stop() {
	ra.stopOnce.Do(func() {
		ra.turn = time.Now()
		ra.halt.Store(true)
		close(ra.stop)
	})
}

// take hands the agent what was read ahead, once: the follower (nil:
// none, and err may say why) and whether the heap was warmed in huge
// pages. It waits for the loop's last word until takeWait after the turn;
// past it, what the loop hands over later is closed. The collector, off
// while the spare read, is turned back on here, just before the restore
// turns it off for its own part (on at the turn, a cycle could start
// beside the start-up with the followed state to mark).
func (ra *ReadAhead) take() readAhead {
	ra.Stop()
	if !ra.took {
		ra.took = true
		defer debug.SetGCPercent(ra.gcPercent)
		select {
		case ra.taken = <-ra.out:
		default:
			t := time.NewTimer(time.Until(ra.turn.Add(takeWait)))
			select {
			case ra.taken = <-ra.out:
			case <-t.C:
				ra.taken.err = fmt.Errorf("the spare was still %s %v after the turn", phases[ra.doing.Load()], takeWait)
				go ra.closeLate()
			}
			t.Stop()
		}
	}
	t := ra.taken
	ra.taken.fl = nil
	return t
}

// closeLate closes what the loop hands over once it is no longer waited for.
func (ra *ReadAhead) closeLate() {
	late := <-ra.out
	if late.fl != nil {
		late.fl.Close()
	}
	ra.lates.Add(1)
}

// Close drops what was read ahead and not taken (a start that ended before
// its restore leaves the loop's last word to a goroutine that closes it).
func (ra *ReadAhead) Close() {
	ra.Stop()
	ra.takeChunks().Close()
	if !ra.took {
		ra.took = true
		debug.SetGCPercent(ra.gcPercent)
		go ra.closeLate()
		return
	}
	if ra.taken.fl != nil {
		ra.taken.fl.Close()
		ra.taken.fl = nil
	}
}
