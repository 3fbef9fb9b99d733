package agent

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvpool/kvpool/internal/bytesize"
	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/internal/keeper"
)

// The pool's lock held by the keeper. The agent locks a chunk's pages in
// its own mapping when it allocates it, and the kernel unmaps that mapping
// when the agent dies: about 0.07 s a GiB of locked 4 KiB pages, all of it
// before the next agent can start (and the next agent then had to fault
// every adopted page into a mapping of its own to lock it again). So, with
// a keeper that takes lock requests (keeper.State.Locks), the agent hands
// each locked chunk's lock over once the chunk is the keeper's: the keeper
// maps the chunk and locks it, a step at a time while the agent serves,
// and then the agent unmaps its own mapping (hostmem.Chunk.HandOff). A
// restarted agent adopts such a chunk without mapping it
// (hostmem.AdoptKept). A keeper that cannot lock (no CAP_IPC_LOCK) or that
// predates lock requests leaves the lock with the agent, as before: the
// adopted chunks are faulted in and locked by the agent (faultInAdopted).

// lockStep is how much of a chunk one lock request asks the keeper to
// fault in and lock (about 6 ms of the keeper's time on the dev VM: 4 GiB
// took 0.4 s).
const lockStep = 64 << 20

// lockQueue is the chunks whose lock is to be settled (settleLock), in
// the order they came, each once.
type lockQueue struct {
	mu   sync.Mutex
	ids  []string
	in   map[string]bool
	wake chan struct{}
}

func newLockQueue() *lockQueue {
	return &lockQueue{in: map[string]bool{}, wake: make(chan struct{}, 1)}
}

func (q *lockQueue) push(ids ...string) {
	q.mu.Lock()
	for _, id := range ids {
		if !q.in[id] {
			q.in[id] = true
			q.ids = append(q.ids, id)
		}
	}
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

func (q *lockQueue) pop() (string, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.ids) == 0 {
		return "", false
	}
	id := q.ids[0]
	q.ids = q.ids[1:]
	delete(q.in, id)
	return id, true
}

// startLocks is the step "locks": from the restore on, the chunks
// queued (fresh ones as the pool fills, renewed ones, all of them after a
// new keeper took the pool, and the adopted ones once the agent serves:
// settleAdopted) have their lock handed to the keeper, or kept by the
// agent where the keeper cannot take it. A pool filled before the agent
// serves (standalone tokens) is so the keeper's to lock as it fills: it
// was handed over only once the agent served, and a restart in the
// seconds that took waited for the kernel to unmap the killed agent's
// locked mapping (docs/benchmarks.md).
func (a *agent) startLocks(ctx context.Context, wg *sync.WaitGroup) error {
	wg.Go(func() { a.settleLocks(ctx) })
	return nil
}

// settleAdopted settles the lock of the adopted chunks ids that the
// keeper does not hold locked: queued for the keeper (settleLocks), or
// faulted in by the agent where the keeper does not lock (faultInAdopted).
func (a *agent) settleAdopted(ctx context.Context, wg *sync.WaitGroup, ids []string) {
	if len(ids) == 0 {
		return
	}
	if a.restart.locks.Load() {
		a.restart.lockq.push(ids...)
		return
	}
	wg.Go(func() { a.faultInAdopted(ctx, ids) })
}

// settleLocks runs until ctx ends, settling the lock of every chunk
// queued. What the keeper took is logged once the queue has stayed empty
// for lockSummaryAfter: a pool that fills hands each chunk over as it
// comes, and is summed up once, not a line a chunk.
func (a *agent) settleLocks(ctx context.Context) {
	r := a.restart
	var chunks int
	var bytes int64
	var first, last time.Time
	for {
		id, ok := r.lockq.pop()
		if !ok {
			var timer *time.Timer
			var quiet <-chan time.Time
			if chunks > 0 {
				timer = time.NewTimer(lockSummaryAfter)
				quiet = timer.C
			}
			select {
			case <-ctx.Done():
				return
			case <-r.lockq.wake:
				if timer != nil {
					timer.Stop()
				}
			case <-quiet:
				msg := "the keeper holds the pool's lock; the agent maps none of it"
				if mapped := a.mappedChunks(); mapped > 0 {
					msg = fmt.Sprintf("the keeper holds the lock of these chunks; the agent still maps %d others", mapped)
				}
				a.log.Info(msg, "chunks", chunks, bytesize.Attr("bytes", bytes), "took", last.Sub(first).Round(time.Millisecond))
				chunks, bytes = 0, 0
			}
			continue
		}
		t := time.Now()
		if n := a.settleLock(ctx, id); n > 0 {
			if chunks == 0 {
				first = t
			}
			chunks++
			bytes += n
			last = time.Now()
		}
	}
}

// lockSummaryAfter is how long the lock queue stays empty before
// settleLocks logs what the keeper took.
const lockSummaryAfter = 500 * time.Millisecond

// settleLock hands chunk id's lock to the keeper, and returns its size
// when the keeper took it. Where the keeper cannot take it, the agent
// keeps or takes the lock itself (faults the chunk in, mapping it again if
// it had handed its mapping off to a keeper since lost).
func (a *agent) settleLock(ctx context.Context, id string) int64 {
	r := a.restart
	a.mu.RLock()
	c := a.hmem[id]
	a.mu.RUnlock()
	if c == nil || !c.Locked {
		return 0
	}
	if r.locks.Load() {
		err := a.lockInKeeper(ctx, id, c)
		if err == nil {
			return c.Size
		}
		if !a.current(id, c) || errors.Is(err, keeper.ErrLost) || ctx.Err() != nil {
			// Renewed or dropped meanwhile, or the keeper is gone: a new
			// keeper gets every chunk queued again (rehand).
			return 0
		}
		if r.locks.CompareAndSwap(true, false) {
			a.log.Warn("the keeper cannot hold the pool's lock; the agent keeps it, and a restart of the agent waits for the kernel to unmap it (about 0.07 s a GiB of 4 KiB pages): grant the keeper IPC_LOCK",
				"chunk", id, "err", err)
		}
	}
	a.mu.Lock()
	var err error
	if a.hmem[id] == c && c.Kept {
		err = c.MapAgain(true)
	}
	a.mu.Unlock()
	if err == nil {
		_, err = a.faultIn(ctx, id, c)
	}
	if err != nil {
		a.log.Warn("chunk not locked again; its pages lock as clients touch them", "chunk", id, "err", err)
	}
	return 0
}

// lockInKeeper asks the keeper to lock chunk c (id), a step at a time,
// and once it holds every page locked, unmaps the agent's own mapping.
func (a *agent) lockInKeeper(ctx context.Context, id string, c *hostmem.Chunk) error {
	r := a.restart
	step := max(lockStep, c.PageSize) // a huge page is faulted in whole
	locked := false
	for off := int64(0); off < c.Size && !locked; off += step {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		r.genMu.Lock()
		gen := r.gens[id]
		r.genMu.Unlock()
		if !a.current(id, c) {
			return errors.New("renewed or dropped")
		}
		var err error
		if locked, err = r.client().Lock(id, gen, off, min(step, c.Size-off)); err != nil {
			return err
		}
	}
	if !locked {
		return errors.New("the keeper did not report the whole chunk locked")
	}
	a.mu.Lock()
	if a.hmem[id] != c {
		a.mu.Unlock()
		return errors.New("renewed or dropped")
	}
	mem := c.HandOff()
	a.mu.Unlock()
	if err := hostmem.Unmap(mem); err != nil {
		// The keeper holds the lock all the same.
		a.log.Warn("the keeper holds a chunk's lock, but the agent's mapping of it stays", "chunk", id, "err", err)
	}
	return nil
}

// mappedChunks counts the chunks the agent still maps.
func (a *agent) mappedChunks() int {
	a.mu.RLock()
	defer a.mu.RUnlock()
	n := 0
	for _, c := range a.hmem {
		if c.Mem != nil {
			n++
		}
	}
	return n
}

// current reports whether c is still the agent's chunk id.
func (a *agent) current(id string, c *hostmem.Chunk) bool {
	a.mu.RLock()
	defer a.mu.RUnlock()
	return a.hmem[id] == c
}
