package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync/atomic"
	"time"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/keeper"
)

// The keeper watched. The agent holds every chunk's memfd and the books'
// memfd itself, beside the keeper; the keeper is what lets them outlive the
// agent. When the keeper is lost (its connection ends: it was killed or
// deleted; or it does not answer within keeper.CallTimeout: it is stopped
// or stalled) nothing is lost yet, but nothing the agent acknowledges from
// then on would survive an agent restart. So the agent:
//
//   - says so at once: an error log, a KVPoolKeeperLost Node event,
//     kvpool_keeper_connected 0 and kvpool_keeper_losses_total, readiness
//     check "keeper" failing, the KVPoolNode's PoolKept condition False;
//   - stops acknowledging changes: the copy server answers every request
//     that would change a session "unavailable, retry" (status 28), which
//     clients retry within their RetryFor, and serves reads, resumes and
//     resent requests (Options.Durable); the books go on in the agent's own
//     memfd (a compaction the keeper cannot take is kept by the agent);
//     chunk renewals go on, their memfds handed over later;
//   - connects to the keeper's socket again every keeperRedial, and as soon
//     as a keeper answers (a new keeper pod, or the stalled one again) hands
//     it every chunk it holds and a fresh compaction of the books
//     (rehand), then serves changes again: the pool and every session and
//     stream survive the keeper's loss, as long as the agent does.
//
// The agent does not restart itself instead: a restart without a keeper
// would lose the pool it still holds, and with a new keeper it would find
// nothing to adopt. Reconnecting keeps everything.

// keeperPing is how often the agent asks the keeper whether it lives, and
// keeperRedial how often it tries to connect to a keeper while none holds
// the pool.
const (
	keeperPing   = time.Second
	keeperRedial = 500 * time.Millisecond
)

// keeperLoss is the keeper's loss: when, and why.
type keeperLoss struct {
	at  time.Time
	err error
}

// client is the keeper connection in use.
func (r *restart) client() *keeper.Client {
	r.kmu.Lock()
	defer r.kmu.Unlock()
	return r.keeper
}

// durable is the copy server's Options.Durable: an error while no keeper
// holds the pool.
func (a *agent) durable() error {
	if l := a.restart.lost.Load(); l != nil {
		return fmt.Errorf("the keeper is lost (since %s, %v): a change now would not survive an agent restart",
			l.at.UTC().Format(time.RFC3339), l.err)
	}
	return nil
}

// keeperLost records the keeper's loss and says so, once per loss. It may
// be called under the books' lock (OnUnkept): it calls nothing of theirs.
func (a *agent) keeperLost(err error) {
	r := a.restart
	if err == nil {
		err = keeper.ErrLost
	}
	if !r.lost.CompareAndSwap(nil, &keeperLoss{at: time.Now(), err: err}) {
		return
	}
	r.losses.Add(1)
	a.log.Error("keeper lost: changes are refused (clients retry) until a keeper holds the pool again; reconnecting",
		"keeper", a.cfg.KeeperSocket, "err", err)
	a.events.KeeperLost(err.Error())
}

// watchKeeper pings the keeper every keeperPing and watches its
// connection until ctx ends; on a loss it reconnects (reconnectKeeper).
func (a *agent) watchKeeper(ctx context.Context) {
	r := a.restart
	t := time.NewTicker(keeperPing)
	defer t.Stop()
	for {
		kc := r.client()
		var err error
		select {
		case <-ctx.Done():
			return
		case <-kc.Lost():
			err = kc.Err()
		case <-t.C:
			if l := r.lost.Load(); l != nil {
				err = l.err // lost on another path (a put, the books): reconnect
				break
			}
			if _, err = kc.Ping(); err == nil {
				continue
			}
		}
		if ctx.Err() != nil {
			return // the agent is stopping and closed the connection
		}
		kc.Close()
		a.keeperLost(err)
		a.reconnectKeeper(ctx)
	}
}

// reconnectKeeper connects to the keeper's socket every keeperRedial until
// one answers and takes the pool (rehand), or ctx ends.
func (a *agent) reconnectKeeper(ctx context.Context) {
	r := a.restart
	var logged time.Time
	for {
		kc, held, err := keeper.Connect(a.cfg.KeeperSocket, 0)
		if err == nil {
			if err = a.rehand(kc, held); err == nil {
				return
			}
			kc.Close()
		}
		if time.Since(logged) >= 10*time.Second {
			logged = time.Now()
			a.log.Warn("waiting for a keeper to hold the pool", "keeper", a.cfg.KeeperSocket, "err", err,
				"lostFor", time.Since(r.lost.Load().at).Round(time.Second))
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(keeperRedial):
		}
	}
}

// rehand gives a keeper that just answered the pool the agent holds: every
// chunk's memfd (replacing what it holds under the same ID, dropping what
// the agent no longer has), then a fresh compaction of the books; then the
// agent uses it and acknowledges changes again. Chunk renewals wait while
// it runs (genMu), so none is handed to the lost keeper meanwhile.
func (a *agent) rehand(kc *keeper.Client, held *keeper.State) error {
	r := a.restart
	held.Close() // the agent has its own fds of everything
	r.genMu.Lock()
	defer r.genMu.Unlock()
	a.mu.RLock()
	chunks := make(map[string]*keeperChunk, len(a.hmem))
	for id, c := range a.hmem {
		chunks[id] = &keeperChunk{file: c.File, size: c.Size}
	}
	a.mu.RUnlock()
	for id, c := range chunks {
		seals, err := keeper.Seals(c.file)
		if err != nil {
			return fmt.Errorf("seals of chunk %s: %w", id, err)
		}
		if err := kc.Put(keeper.Item{ID: id, Gen: r.gens[id], Size: c.size, Seals: seals}, c.file); err != nil {
			return err
		}
	}
	for _, h := range held.Chunks {
		if chunks[h.ID] == nil {
			if err := kc.Drop(h.ID); err != nil {
				return err
			}
		}
	}
	if err := r.books.Rehand(kc); err != nil {
		return err
	}
	r.kmu.Lock()
	r.keeper = kc
	r.kmu.Unlock()
	// The lost keeper's lock went with it: the new one takes it, or the
	// agent locks the chunks itself again (settleLock).
	r.locks.Store(held.Locks)
	ids := make([]string, 0, len(chunks))
	for id := range chunks {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	r.lockq.push(ids...)
	loss := r.lost.Swap(nil)
	since := time.Duration(0)
	if loss != nil {
		since = time.Since(loss.at)
	}
	a.log.Info("keeper reconnected: it holds the pool and its books again; changes are served",
		"keeper", a.cfg.KeeperSocket, "chunks", len(chunks), "lostFor", since.Round(time.Millisecond), "booksGen", r.books.Stats().Gen)
	a.events.KeeperReconnected(len(chunks), since)
	a.writeMarker()
	return nil
}

type keeperChunk struct {
	file *os.File
	size int64
}

// The keeper marker: a small file in the state directory that says what
// the keeper held when this agent last handed it the books, while that
// was worth losing (allocations or sessions; with none the file is
// removed, so an uninstall leaves nothing). A later agent that finds the
// keeper empty though the marker says it held books knows that the keeper
// lost the pool (it was restarted while no agent held the pool), and says
// so, instead of starting as if for the first time.

// markerFile is the marker's name in the state directory.
const markerFile = "keeper-pool.json"

type marker struct {
	BooksGen    uint64    `json:"booksGen"`
	Chunks      int       `json:"chunks"`
	Allocations int       `json:"allocations"`
	Sessions    int       `json:"sessions"`
	Written     time.Time `json:"written"`
	// Sizing is the policy the pool was planned with (absent for a fixed
	// layout, and from agents before it): a restart under the same policy
	// keeps the pool it adopts (keepKeptPool).
	Sizing *config.Sizing `json:"sizing,omitempty"`
}

// poolLoss is what the agent found at start: the keeper had lost the pool
// the marker names.
type poolLoss struct {
	marker
}

func (a *agent) markerPath() string { return filepath.Join(a.cfg.StateDir, markerFile) }

// readMarker returns the marker, or a zero one when there is none or it
// does not parse.
func (a *agent) readMarker() marker {
	var m marker
	data, err := os.ReadFile(a.markerPath())
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			a.log.Warn("keeper marker unreadable", "path", a.markerPath(), "err", err)
		}
		return m
	}
	if err := json.Unmarshal(data, &m); err != nil {
		a.log.Warn("keeper marker unreadable", "path", a.markerPath(), "err", err)
		return marker{}
	}
	return m
}

// writeMarker records what the keeper holds now (atomically: a temporary
// file renamed), or removes the marker when the pool holds no allocation
// and no session. A failure is logged: the marker only sharpens what a
// later agent says.
func (a *agent) writeMarker() {
	r := a.restart
	m := marker{BooksGen: r.books.Stats().Gen, Chunks: len(a.srvChunks()), Allocations: a.allocations(), Written: time.Now().UTC(), Sizing: a.policy}
	if a.srv != nil {
		m.Sessions = len(a.srv.Sessions())
	}
	r.markedSessions.Store(int64(m.Sessions))
	r.markedAllocs.Store(int64(m.Allocations))
	var err error
	if m.Allocations == 0 && m.Sessions == 0 {
		if err = os.Remove(a.markerPath()); errors.Is(err, os.ErrNotExist) {
			err = nil
		}
	} else {
		data, _ := json.Marshal(m)
		err = writeFileAtomic(a.markerPath(), data)
	}
	if err != nil {
		a.log.Warn("keeper marker not written", "path", a.markerPath(), "err", err)
	}
}

// markerStale says whether the marker's counts differ from the pool's.
func (a *agent) markerStale() bool {
	r := a.restart
	return int64(len(a.srv.Sessions())) != r.markedSessions.Load() || int64(a.allocations()) != r.markedAllocs.Load()
}

// allocations counts the pool's allocations.
func (a *agent) allocations() int {
	seen := map[string]bool{}
	for _, c := range a.pool.Chunks() {
		if c.Allocation != "" {
			seen[c.Allocation] = true
		}
	}
	return len(seen)
}

// srvChunks lists the chunks the agent holds.
func (a *agent) srvChunks() []string {
	a.mu.RLock()
	defer a.mu.RUnlock()
	ids := make([]string, 0, len(a.hmem))
	for id := range a.hmem {
		ids = append(ids, id)
	}
	return ids
}

// keeperCounters are the restart's keeper figures.
type keeperCounters struct {
	lost           atomic.Pointer[keeperLoss] // non-nil while no keeper holds the pool
	losses         atomic.Int64
	markedSessions atomic.Int64 // sessions the marker last said
	markedAllocs   atomic.Int64 // allocations the marker last said
}
