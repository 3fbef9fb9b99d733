package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/internal/books"
	"github.com/kvpool/kvpool/internal/bytesize"
	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/internal/keeper"
	"github.com/kvpool/kvpool/internal/node"
	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/internal/sizing"
	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/pool"
)

// keeperWait bounds how long the agent waits for the keeper at start (the
// previous agent's connection may still be closing).
const keeperWait = 30 * time.Second

// restart is what the agent took over from the keeper at start.
type restart struct {
	kmu    sync.Mutex
	keeper *keeper.Client // kmu: replaced when the agent connects to a new keeper (keeperwatch.go)
	// held: what the keeper handed over at connect, until the restore
	// takes it (nil after); marker: the keeper marker as the previous
	// agent left it, read at connect.
	held     *keeper.State
	kept     []keptFile // what each of held.Chunks' memfds says, in its order (inspectKept)
	marker   marker
	books    *books.Books
	genMu    sync.Mutex
	gens     map[string]uint64 // memfd generation of each chunk the agent holds; genMu
	adopted  map[string]bool
	sessions []server.RestoredSession
	streams  int
	// chunksAhead: the keeper handed over no chunk at the hello, a spare
	// having taken them ahead (ReadAhead.takeAhead).
	chunksAhead bool
	// readAhead: the restore finished the books a spare read ahead
	// (loadKept).
	readAhead bool
	warmed    int64 // heap made resident for the restore (warmHeap)
	warmHuge  bool  // and asked for in huge pages
	// lastAlive is the previous agent's last sign of life; the gap runs
	// from it until this agent serves.
	lastAlive time.Time
	gap       time.Duration
	fresh     atomic.Int64 // chunks allocated by this agent
	// steps: how long the restore's steps took (nil: nothing restored).
	steps *report.RestoreSteps
	// gcOn turns the collector back on (the restore turned it off).
	gcOn func()
	// locks: the keeper takes lock requests (keeperlock.go), until one is
	// refused; lockq: the chunks whose lock is to be settled.
	locks atomic.Bool
	lockq *lockQueue
	// poolLost: at start the keeper held none of the pool an earlier
	// agent had kept in it (the marker says what); nil otherwise.
	poolLost *poolLoss
	keeperCounters
}

// connectKeeper is the step "keeper": it connects to the keeper and takes
// what it holds, first, so that the plan counts the memory the keeper holds
// for the pool as the pool's own (keptMemory) and a restart that adopts a
// pool does not wait for the API server (plannedNode). Its stop closes the
// keeper connection; the keeper keeps the memory and the books for the
// next agent.
func (a *agent) connectKeeper() error {
	path := a.cfg.KeeperSocket
	// The configuration checked socketDir; the socket the agent serves
	// may be elsewhere (--socket).
	if err := config.CheckKeeperSocket(filepath.Dir(a.socket), path); err != nil {
		return err
	}
	var ahead *keeper.Ahead // the chunks a spare took ahead of its turn
	if ra := a.opts.ReadAhead; ra != nil {
		ahead = ra.takeChunks()
	}
	kc, held, err := keeper.ConnectWith(path, keeperWait, ahead)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ECONNREFUSED) {
		return fmt.Errorf("keeper: %w (is `agent keeper --socket %s` running?)", err, path)
	}
	if err != nil {
		return err
	}
	r := &restart{keeper: kc, held: held, chunksAhead: held.Ahead, kept: inspectKept(held.Chunks), marker: a.readMarker(), gens: make(map[string]uint64, len(held.Chunks)), adopted: make(map[string]bool, len(held.Chunks)), lockq: newLockQueue()}
	r.locks.Store(held.Locks)
	a.restart = r
	return nil
}

// keptMemory is the memory of the chunks the keeper holds, by NUMA node
// (from the chunk's ID) and page size (from its memfd): the plan counts it
// as available (node.Info.WithKept). Nothing without a keeper.
func (a *agent) keptMemory() []node.Kept {
	if a.restart == nil || a.restart.held == nil {
		return nil
	}
	var kept []node.Kept
	for i, h := range a.restart.held.Chunks {
		numa := -1
		if _, n, _, err := contract.ParseChunkID(h.ID); err == nil {
			numa = n
		}
		pageSize := a.restart.kept[i].info.PageSize
		if pageSize == 0 { // the memfd did not say (the restore drops it)
			pageSize = int64(os.Getpagesize())
		}
		kept = append(kept, node.Kept{NUMA: numa, PageSize: pageSize, Bytes: h.Size})
	}
	return kept
}

// keptFile is what a kept chunk's memfd says of itself, or why it did not.
type keptFile struct {
	info hostmem.FileInfo
	err  error
}

// inspectKept is what every kept chunk's memfd says of itself, for the
// plan and the restore both. A sealed chunk (hostmem.Seals) can change
// neither its size nor its seals, so what the keeper read of it at the put
// stands (keeper.Item.PageSize: 9-10 ms of a restart's gap with 4,096
// chunks on the dev VM); the others, and every chunk of a keeper that does
// not say, are read once (hostmem.Inspect), on every CPU the process has.
func inspectKept(chunks []keeper.Held) []keptFile {
	out := make([]keptFile, len(chunks))
	var ask []int
	for i, h := range chunks {
		if h.PageSize > 0 && h.Seals&hostmem.Seals == hostmem.Seals {
			out[i].info = hostmem.FileInfo{Size: h.Size, PageSize: h.PageSize, Seals: h.Seals}
			continue
		}
		ask = append(ask, i)
	}
	lanes := min(runtime.GOMAXPROCS(0), (len(ask)+inspectPerLane-1)/inspectPerLane)
	var wg sync.WaitGroup
	for l := range lanes {
		wg.Go(func() {
			for k := l; k < len(ask); k += lanes {
				i := ask[k]
				out[i].info, out[i].err = hostmem.Inspect(chunks[i].File)
			}
		})
	}
	wg.Wait()
	return out
}

// inspectPerLane is the fewest chunks worth a goroutine of their own.
const inspectPerLane = 128

// keepKeptPool raises the plan to the chunks the keeper holds when the
// marker says the pool was planned under this very sizing policy: the node
// having less free memory than when the pool was planned (others took it)
// then does not make a restart drop chunks it already holds, and their
// sessions with them. A changed policy (an upgrade that shrinks the pool)
// plans as it says. The marker is there only while the pool holds an
// allocation or a session: with nothing to lose, the plan stands.
func (a *agent) keepKeptPool(p *sizing.Plan, policy config.Sizing) {
	m := a.restart.marker
	if m.Sizing == nil || *m.Sizing != policy {
		return
	}
	planned := p.Total
	if p.KeepAtLeast(keptChunks(a.restart.held.Chunks, p)) {
		a.log.Warn("the node's free memory plans a smaller pool than the one kept across the restart; "+
			"the sizing policy is unchanged, so the pool keeps the chunks it holds",
			bytesize.Attr("planned", planned), bytesize.Attr("kept", p.Total))
	}
}

// keptChunks is, for each GPU of p, how many of its first chunks (indexes
// 0, 1, ...) the keeper holds as the plan would name them (its NUMA node,
// the plan's chunk size): a plan raised to it holds only kept chunks, so
// keeping the pool allocates nothing. A kept chunk past a gap is left to
// the plan (dropped where it is past it).
func keptChunks(held []keeper.Held, p *sizing.Plan) map[int]int {
	numa := make(map[int]int, len(p.GPUs))
	for _, g := range p.GPUs {
		numa[g.GPU] = g.NUMA
	}
	have := map[[2]int]bool{} // (GPU, index)
	for _, h := range held {
		gpu, n, i, err := contract.ParseChunkID(h.ID)
		if want, ok := numa[gpu]; err == nil && ok && n == want && h.Size == p.ChunkBytes {
			have[[2]int{gpu, i}] = true
		}
	}
	need := map[int]int{}
	for gpu := range numa {
		for have[[2]int{gpu, need[gpu]}] {
			need[gpu]++
		}
	}
	return need
}

// restore is the step "restore": it replays the books the keeper holds,
// adopts every kept chunk whose identity matches them and the plan, and
// rebuilds the pool, so that no chunk is pinned twice and every committed
// session and stream is back. Whatever cannot be adopted is dropped and
// said so; books of another format version are refused, the keeper's
// state released, and the agent starts fresh. Its stop (stopRestore)
// closes the books.
func (a *agent) restore() (err error) {
	r := a.restart
	held := r.held
	r.held = nil
	var ahead *books.Follower
	var warmHuge bool
	var spareWait time.Duration
	if ra := a.opts.ReadAhead; ra != nil {
		a.opts.ReadAhead = nil
		asked := time.Now()
		t := ra.take()
		spareWait = time.Since(asked)
		ahead, warmHuge = t.fl, t.huge
		if ahead == nil {
			a.log.Info("the spare did not read the books ahead; the restore replays them whole", "err", t.err)
		}
		// Books read ahead that the restore did not finish (Close
		// after the Follower's own Load is harmless).
		defer ahead.Close()
	}
	// The restore allocates what it keeps and little else, nearly all of
	// it before the socket opens: collecting meanwhile only delays the
	// socket (131,072 streams: 223-230 ms to serving with the collector
	// off, 244-270 on; peak RSS 157 MiB against 146). GOMEMLIMIT (the
	// chart sets it) still makes the runtime collect near the limit, and
	// the heartbeat step hands the garbage back once the agent serves.
	//
	// The collector stays off until the agent serves (the heartbeat
	// step): turned on here, its first cycle ran beside the steps up to
	// the socket and beside the first calls, with a restore's heap to
	// mark. Should the start stop earlier, undoing this step (or the
	// failed restore itself) turns it back on.
	gcPercent := debug.SetGCPercent(-1)
	r.gcOn = sync.OnceFunc(func() { debug.SetGCPercent(gcPercent) })
	defer func() {
		if err != nil {
			r.gcOn()
		}
	}()
	if m := r.marker; held.Books == nil && m.BooksGen > 0 {
		r.poolLost = &poolLoss{marker: m}
		a.log.Error("the keeper lost the pool: it holds no books, though it held generation "+fmt.Sprint(m.BooksGen)+
			" for the previous agent; that pool's sessions and streams are gone, and the pool is allocated fresh",
			"keeper", a.cfg.KeeperSocket, "chunksThen", m.Chunks, "sessionsThen", m.Sessions, "markedAt", m.Written)
		a.events.PoolLost(m.Chunks, m.Sessions)
	}
	t0 := time.Now()
	if ahead != nil && held.Books != nil {
		// The spare warmed the heap for the rest of the restore of the
		// books it read ahead (these, or those they compacted from): what
		// is free and resident of it. A read the turn halted, or a spare
		// that had not topped it up since it read, leaves the rest to
		// warm here.
		r.warmHuge = warmHuge
		snap, recs := books.Sizes(held.Books)
		if short := warmWant(snap, recs, len(held.Chunks)) - heapFree(); short >= warmPiece {
			_, huge := warmHeap(short)
			r.warmHuge = r.warmHuge || huge
		}
		r.warmed = heapFree()
	} else {
		snap, recs := books.Sizes(held.Books)
		r.warmed, r.warmHuge = warmHeap(warmSize(snap, recs, len(held.Chunks), memoryLimit()))
	}
	tWarm := time.Now()
	st, info, held := a.loadBooks(held, ahead)
	r.lastAlive = info.LastAlive
	tLoad := time.Now()
	if err := a.adoptAll(st, held); err != nil {
		return err
	}
	tAdopt := time.Now()
	// The books start while the pool is rebuilt (both only read st):
	// mostly they go on in the kept memfd, which costs little, but a log
	// past its room is copied and one far past it compacted.
	startBooks := startAside(func() (*books.Books, error) { return books.Start(st, info.Gen, r.client(), a.booksFailed) })
	img := st.Image()
	if breakImage != nil {
		breakImage(&img)
	}
	sessions, err := a.pool.Restore(img)
	if err != nil {
		a.log.Error("the books do not rebuild a consistent pool; releasing the keeper's state and starting fresh", "err", err)
		if b, _ := startBooks(); b != nil {
			b.Close()
		}
		for id, c := range a.hmem {
			c.Close()
			delete(a.hmem, id)
		}
		if err := r.client().Reset(); err != nil {
			return fmt.Errorf("keeper: %w", err)
		}
		clear(r.adopted)
		clear(r.gens)
		st, sessions = books.NewState(), nil
		startBooks = func() (*books.Books, error) { return books.Start(st, info.Gen, r.client(), a.booksFailed) }
	}
	r.sessions = st.Restored(sessions)
	r.streams = 0
	for _, ps := range sessions {
		r.streams += ps.Usage().Streams
	}
	tPool := time.Now()
	b, err := startBooks()
	if err != nil {
		return err
	}
	tBooks := time.Now()
	b.OnUnkept(a.keeperLost)
	r.books = b
	a.pool.SetJournal(b)
	if len(held.Chunks) > 0 || len(r.adopted) > 0 {
		r.steps = &report.RestoreSteps{SpareSeconds: spareWait.Seconds(), WarmSeconds: tWarm.Sub(t0).Seconds(), WarmBytes: r.warmed, LoadSeconds: tLoad.Sub(tWarm).Seconds(),
			AdoptSeconds: tAdopt.Sub(tLoad).Seconds(), RebuildSeconds: tPool.Sub(tAdopt).Seconds(), BooksSeconds: tBooks.Sub(tPool).Seconds(),
			ReadAhead: r.readAhead, ReplayedBytes: int64(info.Replayed)}
		a.log.Info("pool adopted from the keeper", "chunks", len(r.adopted), "sessions", len(r.sessions),
			"streams", r.streams, "booksGen", info.Gen, "readAhead", r.readAhead, bytesize.Attr("replayed", int64(info.Replayed)),
			bytesize.Attr("warmHeap", r.warmed), "warmHuge", r.warmHuge, "spare", spareWait.Round(time.Microsecond), "warm", tWarm.Sub(t0).Round(time.Microsecond),
			"load", tLoad.Sub(tWarm).Round(time.Microsecond),
			"adopt", tAdopt.Sub(tLoad).Round(time.Microsecond), "rebuild", tPool.Sub(tAdopt).Round(time.Microsecond),
			"books", tBooks.Sub(tPool).Round(time.Microsecond), "chunksAhead", r.chunksAhead)
	}
	return nil
}

// breakImage, set by tests, changes the image the books give the pool
// before it is rebuilt (to make the rebuild fail).
var breakImage func(*pool.Image)

// startAside runs start in a goroutine of its own and returns what waits
// for its result.
func startAside[T any](start func() (T, error)) func() (T, error) {
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := start()
		done <- result{v, err}
	}()
	return sync.OnceValues(func() (T, error) { r := <-done; return r.v, r.err })
}

// loadBooks replays the books the keeper holds. Books that cannot be
// adopted, or chunks without books, make the keeper release everything:
// the agent then starts from fresh books and holds nothing.
func (a *agent) loadBooks(held *keeper.State, ahead *books.Follower) (*books.State, books.Info, *keeper.State) {
	switch {
	case held.Books != nil:
		st, info, err := a.loadKept(held.Books, ahead)
		held.Books.Close()
		if err == nil {
			return st, info, held
		}
		a.log.Error("the kept books cannot be adopted; releasing the keeper's state and starting with a fresh pool",
			"err", err, "incompatible", errors.Is(err, books.ErrIncompatible), "chunks", len(held.Chunks))
		a.release(held)
	case len(held.Chunks) > 0:
		a.log.Error("the keeper holds chunks but no books; releasing them and starting with a fresh pool", "chunks", len(held.Chunks))
		a.release(held)
	default:
		return books.NewState(), books.Info{}, held
	}
	return books.NewState(), books.Info{}, &keeper.State{}
}

// loadKept replays the kept books f: only the records committed since a
// spare last read them, where fl read these very books ahead
// (Options.ReadAhead), the whole books otherwise.
func (a *agent) loadKept(f *os.File, fl *books.Follower) (*books.State, books.Info, error) {
	if fl == nil {
		return books.Load(f)
	}
	st, info, err := fl.Load(f)
	if err == nil {
		a.restart.readAhead = true
		return st, info, nil
	}
	// Books that compacted since the spare's last read, most often.
	a.log.Info("the spare's read ahead does not finish the kept books; replaying them whole", "err", err)
	return books.Load(f)
}

// adoptAll maps every kept chunk the books and the plan agree on, drops
// the others from the keeper, and forgets the books' chunks the keeper no
// longer holds (revoking their allocations).
func (a *agent) adoptAll(st *books.State, held *keeper.State) error {
	r := a.restart
	planned := make(map[string]*hostmem.Spec, len(a.specs))
	for i := range a.specs {
		planned[a.specs[i].ID] = &a.specs[i]
	}
	if len(a.hmem) == 0 {
		a.hmem = make(map[string]*hostmem.Chunk, len(held.Chunks))
	}
	// One by one: the mappings take the process's address-space lock
	// (tried side by side on two CPUs: no faster).
	for i, h := range held.Chunks {
		c, why := a.adopt(st, h, r.kept[i], planned)
		if why != "" {
			a.log.Warn("dropping a kept chunk", "chunk", h.ID, "why", why)
			h.File.Close()
			st.Forget(h.ID)
			if err := r.client().Drop(h.ID); err != nil {
				return fmt.Errorf("keeper: %w", err)
			}
			continue
		}
		a.hmem[h.ID] = c
		r.gens[h.ID] = h.Gen
		r.adopted[h.ID] = true
	}
	if len(r.adopted) == st.NumChunks() {
		// Every chunk adopted is in the books (adopt checks): none of
		// the books' is missing, and none is looked up again.
		return nil
	}
	for _, c := range st.Chunks() {
		if !r.adopted[c.ID] {
			a.log.Warn("a chunk of the books is not in the keeper; its allocation is revoked", "chunk", c.ID)
			st.Forget(c.ID)
		}
	}
	return nil
}

// stopRestore undoes the step "restore": the collector back on, the
// marker written and the books closed, while the pool still holds its
// chunks (the plan's stop, next, frees them).
func (a *agent) stopRestore() error {
	r := a.restart
	if r.gcOn != nil {
		r.gcOn()
	}
	if r.books != nil {
		// A stop with nothing to lose leaves no marker; with something, the
		// marker says what a later agent will not find if the keeper is
		// lost (while it is lost, what this stop loses).
		a.writeMarker()
		r.books.Close()
	}
	return nil
}

// closeKeeper undoes the step "keeper": the keeper connection is closed
// (and whatever it handed over that the restore did not take). The keeper
// keeps the memory and the books for the next agent.
func (a *agent) closeKeeper() error {
	r := a.restart
	if r == nil {
		return nil
	}
	if r.held != nil {
		r.held.Close()
		r.held = nil
	}
	if err := r.client().Close(); err != nil && !errors.Is(err, net.ErrClosed) {
		return fmt.Errorf("keeper: %w", err)
	}
	return nil
}

// restoreSessions is the step "sessions": the server takes back the
// sessions the books kept, before the socket appears.
func (a *agent) restoreSessions(context.Context) error {
	return a.srv.Restore(a.restart.sessions)
}

// startHeartbeat is the step "heartbeat": the restart's gap is logged,
// the books get a sign of life and the keeper is watched until the agent
// stops (keeperwatch.go).
func (a *agent) startHeartbeat(ctx context.Context, wg *sync.WaitGroup) error {
	r := a.restart
	switch {
	case !r.lastAlive.IsZero():
		r.gap = time.Since(r.lastAlive)
		a.log.Info("serving again after a restart", "gap", r.gap.Round(time.Millisecond),
			"adoptedChunks", len(r.adopted), "sessions", len(r.sessions), "streams", r.streams)
	case len(r.adopted) > 0:
		// Books from before their writer stamped a new memfd at once:
		// a restart all the same, its gap unknown.
		a.log.Info("serving again after a restart", "gap", "unknown",
			"adoptedChunks", len(r.adopted), "sessions", len(r.sessions), "streams", r.streams)
	}
	a.writeMarker()
	if r.streams > 0 || r.warmed > 0 {
		// The restore's garbage (the books' decoded state, the pool's
		// image, the warm heap it did not use) goes back to the system
		// now, not bit by bit: the restarted agent's resident memory is
		// what the one it replaced held, not the restore's peak.
		wg.Go(func() { debug.FreeOSMemory(); r.gcOn() })
	} else {
		r.gcOn()
	}
	wg.Go(func() { a.heartbeat(ctx) })
	wg.Go(func() { a.watchKeeper(ctx) })
	ids := make([]string, 0, len(r.adopted))
	a.mu.RLock()
	for id := range r.adopted {
		if c := a.hmem[id]; c != nil && !c.Kept {
			ids = append(ids, id)
		}
	}
	a.mu.RUnlock()
	a.settleAdopted(ctx, wg, ids)
	return nil
}

// faultInAdopted faults the pages of the adopted chunks ids into the
// agent's mapping, and so locks them (hostmem.Adopt locks on fault), while
// the agent serves, where the keeper does not hold their lock
// (keeperlock.go): one goroutine per NUMA node, a step at a time, leaving
// a chunk dropped or renewed meanwhile. Until a page is in, it is as it
// was while no agent ran: resident in the file the keeper holds, only not
// locked by this agent. A failure is logged; the pages then lock as they
// are touched.
func (a *agent) faultInAdopted(ctx context.Context, ids []string) {
	type kept struct {
		id string
		c  *hostmem.Chunk
	}
	lanes := map[int][]kept{}
	a.mu.RLock()
	for _, id := range ids {
		if c := a.hmem[id]; c != nil && c.Locked {
			lanes[c.Node] = append(lanes[c.Node], kept{id, c})
		}
	}
	a.mu.RUnlock()
	if len(lanes) == 0 {
		return
	}
	start := time.Now()
	var wg sync.WaitGroup
	var bytes atomic.Int64
	errs := make(chan error, len(ids))
	for _, chunks := range lanes {
		wg.Go(func() {
			for _, k := range chunks {
				n, err := a.faultIn(ctx, k.id, k.c)
				bytes.Add(n)
				if err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	if err := errors.Join(all...); err != nil {
		a.log.Warn("adopted chunks not all faulted in; their pages lock as clients touch them", "err", err,
			bytesize.Attr("faultedIn", bytes.Load()), "took", time.Since(start).Round(time.Millisecond))
		return
	}
	a.log.Info("adopted chunks faulted in and locked", "chunks", len(ids), bytesize.Attr("bytes", bytes.Load()),
		"lanes", len(lanes), "took", time.Since(start).Round(time.Millisecond))
}

// faultIn faults the adopted chunk c in, a step at a time, while it is
// still the agent's chunk id and the agent runs; it returns the bytes
// faulted in.
func (a *agent) faultIn(ctx context.Context, id string, c *hostmem.Chunk) (int64, error) {
	var done int64
	for off := int64(0); off < c.Size && ctx.Err() == nil; off += hostmem.FaultInStep {
		a.mu.RLock()
		var part []byte
		if a.hmem[id] == c && c.Mem != nil {
			part = c.Mem[off:min(off+hostmem.FaultInStep, c.Size)]
		}
		a.mu.RUnlock()
		if part == nil {
			return done, nil // dropped or renewed meanwhile
		}
		if err := hostmem.FaultIn(part); err != nil {
			a.mu.RLock()
			gone := a.hmem[id] != c
			a.mu.RUnlock()
			if gone {
				return done, nil // unmapped under the step: dropped meanwhile
			}
			return done, err
		}
		done += int64(len(part))
	}
	return done, nil
}

// release makes the keeper drop everything it holds.
func (a *agent) release(held *keeper.State) {
	held.Close()
	if err := a.restart.client().Reset(); err != nil {
		a.log.Error("keeper reset", "err", err)
	}
}

// adopt maps a kept chunk after checking it is the one the books name: same
// generation (a fresh memfd replaces a chunk at each grant), size and seals,
// and still in the plan. A chunk the keeper holds locked is not mapped at
// all (hostmem.AdoptKept). Otherwise mapping and locking pages that are
// already resident allocates nothing; the lock is on fault (hostmem.Adopt),
// and the pages are locked while the agent serves, by the keeper or by
// faulting them in (settleLocks).
func (a *agent) adopt(st *books.State, h keeper.Held, f keptFile, planned map[string]*hostmem.Spec) (*hostmem.Chunk, string) {
	bc, ok := st.Chunk(h.ID)
	spec, inPlan := planned[h.ID]
	switch {
	case !ok:
		return nil, "not in the books"
	case bc.Gen != h.Gen:
		return nil, fmt.Sprintf("generation %d, the books say %d", h.Gen, bc.Gen)
	case f.err != nil:
		return nil, fmt.Sprintf("its memfd: %v", f.err)
	case bc.Size != h.Size || h.Size != f.info.Size:
		return nil, fmt.Sprintf("size %d (the memfd %d), the books say %d", h.Size, f.info.Size, bc.Size)
	case f.info.Seals != bc.Seals:
		return nil, fmt.Sprintf("seals %#x, the books say %#x", f.info.Seals, bc.Seals)
	case !inPlan:
		return nil, "no longer in the plan"
	case spec.Size != h.Size:
		return nil, fmt.Sprintf("the plan's chunk size is now %d", spec.Size)
	}
	if h.Locked && spec.Lock && a.restart.locks.Load() {
		return hostmem.AdoptKept(h.File, f.info, bc.NUMA), ""
	}
	c, err := hostmem.Adopt(h.File, f.info, bc.NUMA, spec.Lock, spec.LockFallback)
	if err != nil {
		return nil, err.Error()
	}
	return c, ""
}

// keep hands a new chunk's memfd to the keeper and records its generation
// in the books before the chunk is used: a freshly allocated chunk, or a
// fresh memfd that replaces a chunk at reclaim (the keeper then drops the
// old one); install then makes it the agent's. Without a keeper it does
// nothing. Safe for concurrent use.
func (a *agent) keep(id string, c *hostmem.Chunk) error {
	r := a.restart
	if r == nil {
		return nil
	}
	r.genMu.Lock()
	defer r.genMu.Unlock()
	seals, err := keeper.Seals(c.File)
	if err != nil {
		return fmt.Errorf("seals of chunk %s: %w", id, err)
	}
	gen := r.gens[id] + 1
	if r.lost.Load() == nil {
		if err := r.client().Put(keeper.Item{ID: id, Gen: gen, Size: c.Size, Seals: seals}, c.File); errors.Is(err, keeper.ErrLost) {
			// The keeper is gone: the agent holds the chunk, and hands it
			// to the next keeper with the rest (rehand).
			a.keeperLost(err)
		} else if err != nil {
			return err
		}
	}
	if err := r.books.ChunkGen(id, gen, seals); err != nil {
		return err
	}
	r.gens[id] = gen
	return nil
}

// booksFailed stops the agent: a change it cannot record would not
// survive a restart, so it must not be acknowledged.
func (a *agent) booksFailed(err error) {
	a.log.Error("the books cannot record changes; stopping the agent so that nothing unrecorded is acknowledged", "err", err)
	os.Exit(3)
}

// settleRestored is the step "settle" (with a keeper), once the device
// plugin knows its allocations: pool
// allocations the plugin has no token for (the agent died between the
// grant and the checkpoint) are revoked, and chunks left dirty by a
// reclaim that was cut short are renewed (fresh memory, as a reclaim does).
func (a *agent) settleRestored() error {
	known := map[string]bool{}
	for _, id := range a.static {
		known[id] = true
	}
	if a.plug != nil {
		for _, rec := range a.plug.Plugin.Allocations() {
			known[rec.ID()] = true
		}
	} else if a.static == nil {
		return nil
	}
	// The pool's allocations and dirty chunks asked for, not a copy of
	// every chunk (a large node's restart holds thousands).
	for _, alloc := range a.pool.Allocations() {
		if known[alloc] {
			continue
		}
		a.log.Warn("revoking a restored allocation no token names", "allocation", alloc)
		if _, err := a.pool.Revoke(alloc); err != nil {
			a.log.Error("revoke", "allocation", alloc, "err", err)
		}
	}
	for _, id := range a.pool.Dirty() {
		if err := a.renew(id); err != nil {
			a.log.Error("scrub a restored dirty chunk", "chunk", id, "err", err)
			continue
		}
		if err := a.pool.Scrubbed(id); err != nil {
			a.log.Error("scrub a restored dirty chunk", "chunk", id, "err", err)
		}
	}
	return nil
}

// heartbeat leaves a sign of life in the books until ctx ends, so that the
// next agent can tell how long the pool went unserved, and keeps the
// keeper marker current (every 3 s, when the pool's allocations or
// sessions changed).
func (a *agent) heartbeat(ctx context.Context) {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for i := 1; ; i++ {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			a.restart.books.Touch()
		}
		r := a.restart
		if i%30 == 0 && r.lost.Load() == nil && a.markerStale() {
			a.writeMarker()
		}
		if i%10 != 0 {
			continue
		}
		if done := r.books.CompactIfQuiet(quietCompactAfter, quietCompactFrom); done != nil {
			a.log.Debug("compacting the books while no change comes", "quietFor", quietCompactAfter)
			// The compaction's replay is garbage once it is written (as
			// much heap as a restore's): handed back to the system at
			// once, so that the agent's resident memory is what it was.
			go func() {
				<-done
				debug.FreeOSMemory()
			}()
		}
	}
}

// The books are compacted, beside anything that comes meanwhile, once no
// change was recorded for quietCompactAfter and the records after their
// snapshot take quietCompactFrom bytes and a quarter of it
// (books.CompactIfQuiet): a restart then replays a snapshot, in about 60%
// of the time the same streams take as records. Checked once a second.
// Variables for tests.
var (
	quietCompactAfter        = time.Second
	quietCompactFrom  uint64 = 1 << 20
)

// restartStatus is the restart section of the status report.
func (a *agent) restartStatus() *report.Restart {
	r := a.restart
	if r == nil {
		return nil
	}
	kept := 0
	a.mu.RLock()
	for _, c := range a.hmem {
		if c.Kept {
			kept++
		}
	}
	a.mu.RUnlock()
	rs := &report.Restart{Keeper: a.cfg.KeeperSocket, AdoptedChunks: len(r.adopted), FreshChunks: int(r.fresh.Load()), KeeperLockedChunks: kept,
		Sessions: len(r.sessions), Streams: r.streams, LastGapSeconds: r.gap.Seconds(),
		KeeperConnected: true, KeeperLosses: int(r.losses.Load())}
	if r.steps != nil {
		steps := *r.steps
		rs.Restore = &steps
	}
	if l := r.lost.Load(); l != nil {
		rs.KeeperConnected, rs.KeeperLostSeconds, rs.KeeperError = false, time.Since(l.at).Seconds(), l.err.Error()
	}
	if p := r.poolLost; p != nil {
		rs.PoolLost, rs.LostChunks, rs.LostSessions = true, p.Chunks, p.Sessions
	}
	if b := r.books; b != nil {
		s := b.Stats()
		rs.BooksLogBytes, rs.BooksSnapshotBytes = int64(s.LogBytes), int64(s.Snapshot)
		rs.BooksCompactions = s.Compactions
		rs.BooksLongestHoldSeconds = s.LongestHold.Seconds()
	}
	return rs
}
