package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"runtime/metrics"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/gpu"
	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/internal/keeper"
	"github.com/kvpool/kvpool/internal/logging"
	"github.com/kvpool/kvpool/internal/node"
	"github.com/kvpool/kvpool/internal/sizing"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/wire"
)

var quietLog = slog.New(slog.NewTextHandler(io.Discard, nil))

// startKeeper serves an in-process keeper on a socket of its own.
func startKeeper(t *testing.T) (string, *keeper.Keeper) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "keeper", "keeper.sock")
	l, err := keeper.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	k := keeper.New(quietLog)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- k.Serve(ctx, l) }()
	t.Cleanup(func() { cancel(); <-done; k.Close() })
	return path, k
}

// keptAgent boots a standalone agent with the keeper at keeperSock and a
// fixed layout; stop ends it (as a SIGTERM does).
func keptAgent(t *testing.T, dir, keeperSock string, tokens []string) (a *Agent, stop func()) {
	t.Helper()
	return keptAgentLogging(t, dir, keeperSock, tokens, quietLog)
}

// keptAgentLogging is keptAgent logging to log.
func keptAgentLogging(t *testing.T, dir, keeperSock string, tokens []string, log *slog.Logger) (a *Agent, stop func()) {
	t.Helper()
	cfg := config.Default()
	cfg.SocketDir, cfg.StateDir = filepath.Join(dir, "sock"), filepath.Join(dir, "state")
	cfg.Metrics.Address, cfg.Health.Address = "", ""
	cfg.KeeperSocket = keeperSock
	cfg.Standalone.Tokens = tokens
	return bootAgent(t, Options{Config: &cfg, Standalone: true, ChunksPerGPU: 2, ChunkBytes: 2 << 20, Logger: log})
}

// bootAgent boots an agent and runs it; stop ends it (as a SIGTERM does).
func bootAgent(t *testing.T, o Options) (a *Agent, stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	a, err := Boot(ctx, o)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- a.Wait(ctx) }()
	return a, func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent stop: %v", err)
		}
	}
}

// wireClient is a minimal client speaking the protocol by hand.
type wireClient struct {
	t   *testing.T
	c   *wire.Conn
	seq uint32
	buf []byte
}

func dialAgent(t *testing.T, socket string) *wireClient {
	t.Helper()
	c, err := wire.Dial(socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	w := &wireClient{t: t, c: c, buf: make([]byte, wire.MaxMessage+1)}
	if st, msg := w.do(wire.OpHello, &wire.Hello{Version: wire.Version, Client: "test"}, &wire.HelloReply{}); st != 0 {
		t.Fatalf("hello: %s %s", st, msg)
	}
	return w
}

func (w *wireClient) do(op wire.Op, req, rep proto.Message) (wire.Status, string) {
	w.t.Helper()
	w.seq++
	pkt, err := wire.AppendPacket(nil, wire.Header{Op: op, Seq: w.seq}, req)
	if err != nil {
		w.t.Fatal(err)
	}
	if err := w.c.Send(pkt, nil); err != nil {
		w.t.Fatal(err)
	}
	w.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, files, err := w.c.Recv(w.buf)
	for _, f := range files {
		f.Close()
	}
	if err != nil {
		w.t.Fatal(err)
	}
	h, body, err := wire.ParseHeader(got)
	if err != nil {
		w.t.Fatal(err)
	}
	if h.Status != 0 {
		var e wire.Error
		_ = wire.DecodeBody(body, &e)
		return h.Status, e.Message
	}
	if err := wire.DecodeBody(body, rep); err != nil {
		w.t.Fatal(err)
	}
	return 0, ""
}

func (w *wireClient) open(token, inst string) *wire.OpenReply {
	w.t.Helper()
	var rep wire.OpenReply
	if st, msg := w.do(wire.OpOpen, &wire.Open{Token: token, GpuUuid: cudart.SimulatedUUID(0), InstanceId: []byte(inst),
		Regions: []*wire.Region{{BytesPerPage: 4096, PageCount: 64}}}, &rep); st != 0 {
		w.t.Fatalf("open with %s: %s %s", token, st, msg)
	}
	return &rep
}

func chunkIDs(r *wire.OpenReply) []string {
	var ids []string
	for _, c := range r.Chunks {
		ids = append(ids, c.Id)
	}
	return ids
}

// A standalone allocation follows its token: an agent restarted with the
// tokens in another order gives each tenant its own chunks, session and
// streams back (issue 23: allocations named by position handed tenant A's
// chunks and streams to tenant B).
func TestReorderedTokensKeepTheirAllocations(t *testing.T) {
	dir := t.TempDir()
	ksock, _ := startKeeper(t)
	a, stop := keptAgent(t, dir, ksock, []string{"tenant-a", "tenant-b"})
	first := map[string]*wire.OpenReply{}
	for _, tok := range []string{"tenant-a", "tenant-b"} {
		w := dialAgent(t, a.Socket())
		first[tok] = w.open(tok, "instance-"+tok)
		if st, msg := w.do(wire.OpOffload, &wire.Offload{Rid: "req-of-" + tok, Label: "kv", GpuPages: []int32{1, 2, 3}}, &wire.OffloadReply{}); st != 0 {
			t.Fatalf("offload: %s %s", st, msg)
		}
		w.c.Close()
	}
	stop()

	a2, stop2 := keptAgent(t, dir, ksock, []string{"tenant-b", "tenant-a"})
	defer stop2()
	for _, tok := range []string{"tenant-a", "tenant-b"} {
		w := dialAgent(t, a2.Socket())
		got := w.open(tok, "instance-"+tok)
		if !got.Resumed || got.Session != first[tok].Session || !slices.Equal(chunkIDs(got), chunkIDs(first[tok])) {
			t.Fatalf("%s after the restart with reordered tokens: resumed %v, session %d chunks %v; before: session %d chunks %v",
				tok, got.Resumed, got.Session, chunkIDs(got), first[tok].Session, chunkIDs(first[tok]))
		}
		var n wire.NumPagesReply
		if st, msg := w.do(wire.OpNumPages, &wire.Stream{Rid: "req-of-" + tok, Label: "kv"}, &n); st != 0 || n.Pages != 3 {
			t.Fatalf("%s's stream after the restart: %s %s, %d pages", tok, st, msg, n.Pages)
		}
	}
}

// A restarted agent's chunks end up locked while it serves: by the keeper,
// which holds every page locked in a mapping of its own while the agent
// maps none of them (so that the agent's death unmaps nothing), or, with a
// keeper that leaves the lock with the agent (agent keeper --lock=false),
// in the agent's own mapping, faulted in.
func TestAdoptedChunksLockedWhileServing(t *testing.T) {
	for _, keeperLocks := range []bool{true, false} {
		t.Run(fmt.Sprintf("keeperLocks=%v", keeperLocks), func(t *testing.T) {
			dir := t.TempDir()
			ksock, k := startKeeper(t)
			k.SetLock(keeperLocks)
			a1, stop := keptAgent(t, dir, ksock, []string{"tenant-a"})
			total := poolBytes(a1)
			if keeperLocks {
				waitUntil(t, "the keeper holds the first agent's lock", func() bool { return kept(a1) == len(chunksOf(a1)) })
			}
			stop()
			var log logging.SyncBuffer
			a2, stop2 := keptAgentLogging(t, dir, ksock, []string{"tenant-a"}, slog.New(slog.NewTextHandler(&log, nil)))
			stopped := false
			defer func() {
				if !stopped {
					stop2()
				}
			}()
			w := dialAgent(t, a2.Socket())
			if got := w.open("tenant-a", "instance-a"); len(chunkIDs(got)) == 0 {
				t.Fatal("no chunks after the restart")
			}
			chunks := chunksOf(a2)
			if len(chunks) == 0 || a2.a.restartStatus().AdoptedChunks != len(chunks) {
				t.Fatalf("adopted %d of %d chunks", a2.a.restartStatus().AdoptedChunks, len(chunks))
			}
			for id, c := range chunks {
				if !c.Locked {
					t.Skipf("chunk %s not locked here (no CAP_IPC_LOCK?): %v", id, c.Warnings)
				}
				if keeperLocks {
					if mem := mapping(a2, c); !c.Kept || mem != nil {
						t.Fatalf("chunk %s adopted into a mapping of the agent's (kept %v) though the keeper holds its lock", id, c.Kept)
					}
					continue
				}
				waitUntil(t, "chunk "+id+" resident and locked", func() bool {
					rss, locked, err := hostmem.Resident(mapping(a2, c))
					if err != nil {
						t.Fatal(err)
					}
					return rss == c.Size && locked == c.Size
				})
			}
			if st := k.Stat(); keeperLocks && st.Locked != total || !keeperLocks && st.Locked != 0 {
				t.Fatalf("the keeper holds %d bytes locked of a pool of %d", st.Locked, total)
			}
			if n := a2.a.restartStatus().KeeperLockedChunks; keeperLocks && n != len(chunks) || !keeperLocks && n != 0 {
				t.Fatalf("the restart report counts %d chunks locked by the keeper of %d", n, len(chunks))
			}
			w.c.Close()
			stop2()
			stopped = true
			// Adopted as the keeper's, no chunk had its lock handed over
			// again (mapped, then unmapped).
			if keeperLocks && (strings.Contains(log.String(), "the keeper holds the pool's lock") || strings.Contains(log.String(), "the keeper holds the lock of these chunks")) {
				t.Fatalf("the restarted agent mapped chunks the keeper held locked, and handed their lock over again:\n%s", log.String())
			}
		})
	}
}

// TestFreshChunksLockedByTheKeeper: the chunks a standalone agent
// allocates before it serves, and a chunk renewed while it serves, have
// their lock handed to the keeper, and the agent maps none of them. A
// chunk is queued for the lock loop only once it is the agent's
// (install): queued at the keeper's put, the loop, which runs from the
// restore on, could take it first, find no chunk and drop it, and the
// chunk stayed in the agent's mapping (here the agent is made to wait
// between the two).
func TestFreshChunksLockedByTheKeeper(t *testing.T) {
	ksock, k := startKeeper(t)
	var lockedWhileFilling atomic.Int64 // the most the keeper held locked at an install
	beforeInstall = func(string) {
		lockedWhileFilling.Store(max(lockedWhileFilling.Load(), k.Stat().Locked))
		time.Sleep(20 * time.Millisecond)
	}
	t.Cleanup(func() { beforeInstall = nil })
	a, stop := keptAgent(t, t.TempDir(), ksock, []string{"tenant-a"})
	defer stop()
	chunks := chunksOf(a)
	// The locks are handed over as the pool fills, before the agent
	// serves: not from the heartbeat on.
	if lockedWhileFilling.Load() == 0 {
		t.Fatal("the keeper held no chunk's lock while the pool filled")
	}
	var id string
	for id = range chunks {
		if !chunks[id].Locked {
			t.Skipf("chunk %s not locked here (no CAP_IPC_LOCK?): %v", id, chunks[id].Warnings)
		}
	}
	waitUntil(t, "the keeper holds every fresh chunk's lock", func() bool { return kept(a) == len(chunks) })
	if err := a.a.renew(id); err != nil {
		t.Fatal(err)
	}
	if chunksOf(a)[id] == chunks[id] {
		t.Fatalf("chunk %s not renewed", id)
	}
	waitUntil(t, "the keeper holds the renewed chunk's lock", func() bool { return kept(a) == len(chunks) })
	if st := k.Stat(); st.Locked != poolBytes(a) {
		t.Fatalf("the keeper holds %d bytes locked of a pool of %d", st.Locked, poolBytes(a))
	}
}

// chunksOf is a copy of the agent's chunk table.
func chunksOf(a *Agent) map[string]*hostmem.Chunk {
	a.a.mu.RLock()
	defer a.a.mu.RUnlock()
	return maps.Clone(a.a.hmem)
}

// poolBytes is the size of the agent's chunks together.
func poolBytes(a *Agent) int64 {
	var n int64
	for _, c := range chunksOf(a) {
		n += c.Size
	}
	return n
}

// kept counts the agent's chunks whose lock the keeper holds.
func kept(a *Agent) int {
	a.a.mu.RLock()
	defer a.a.mu.RUnlock()
	n := 0
	for _, c := range a.a.hmem {
		if c.Kept && c.Mem == nil {
			n++
		}
	}
	return n
}

// mapping is the agent's mapping of c (nil when it has none).
func mapping(a *Agent, c *hostmem.Chunk) []byte {
	a.a.mu.RLock()
	defer a.a.mu.RUnlock()
	return c.Mem
}

// stopKeeper ends an in-process keeper as a kill does: its connections
// close and every fd it held with them.
type keeperProc struct {
	path   string
	k      *keeper.Keeper
	cancel context.CancelFunc
	done   chan error
}

func runKeeper(t *testing.T, path string) *keeperProc {
	t.Helper()
	return runKeeperLocking(t, path, true)
}

// runKeeperLocking is runKeeper with the keeper's SetLock(lock).
func runKeeperLocking(t *testing.T, path string, lock bool) *keeperProc {
	t.Helper()
	l, err := keeper.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	kp := &keeperProc{path: path, k: keeper.New(quietLog), done: make(chan error, 1)}
	kp.k.SetLock(lock)
	ctx, cancel := context.WithCancel(context.Background())
	kp.cancel = cancel
	go func() { kp.done <- kp.k.Serve(ctx, l) }()
	t.Cleanup(kp.kill)
	return kp
}

func (kp *keeperProc) kill() {
	if kp.cancel == nil {
		return
	}
	kp.cancel()
	<-kp.done
	kp.k.Close()
	kp.cancel = nil
}

func waitUntil(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 20s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The keeper lost and replaced under a client: the agent sees the loss at
// once, refuses changes ("retry") while reads go on, says so (readiness,
// the restart report), reconnects to the new keeper and hands it every
// chunk and the books; then changes are served again, and an agent
// restart on the new keeper finds every session and stream (issue 23: the
// agent never connected to the new keeper, renewals failed with "keeper
// put: broken pipe", and the next compaction made it exit).
func TestKeeperLostAndReplaced(t *testing.T) {
	dir := t.TempDir()
	ksock := filepath.Join(dir, "keeper", "keeper.sock")
	k1 := runKeeper(t, ksock)
	a, stop := keptAgent(t, dir, ksock, []string{"tenant-a"})
	w := dialAgent(t, a.Socket())
	first := w.open("tenant-a", "instance-a")
	if st, msg := w.do(wire.OpOffload, &wire.Offload{Rid: "before", Label: "kv", GpuPages: []int32{1, 2}}, &wire.OffloadReply{}); st != 0 {
		t.Fatalf("offload: %s %s", st, msg)
	}
	k1.kill()
	waitUntil(t, "the loss seen", func() bool { return a.a.durable() != nil })
	if r := a.a.restartStatus(); r.KeeperConnected || r.KeeperLosses != 1 {
		t.Fatalf("restart report while lost: %+v", r)
	}
	if st, msg := w.do(wire.OpOffload, &wire.Offload{Rid: "during", Label: "kv", GpuPages: []int32{3}}, &wire.OffloadReply{}); st != wire.StatusUnavailable {
		t.Fatalf("an offload while the keeper is lost: %s %s", st, msg)
	}
	var n wire.NumPagesReply
	if st, _ := w.do(wire.OpNumPages, &wire.Stream{Rid: "before", Label: "kv"}, &n); st != 0 || n.Pages != 2 {
		t.Fatalf("a read while the keeper is lost: %s %d", st, n.Pages)
	}
	k2 := runKeeper(t, ksock)
	waitUntil(t, "the new keeper takes the pool", func() bool { return a.a.durable() == nil })
	st := k2.k.Stat()
	if st.Chunks != len(a.a.hmem) || !st.Books || !st.Agent {
		t.Fatalf("the new keeper holds %+v, the agent %d chunks", st, len(a.a.hmem))
	}
	// The lost keeper's lock went with it; the new one takes it.
	waitUntil(t, "the new keeper holds the pool's lock", func() bool { return k2.k.Stat().Locked == poolBytes(a) })
	if r := a.a.restartStatus(); !r.KeeperConnected || r.KeeperLosses != 1 {
		t.Fatalf("restart report after the reconnect: %+v", r)
	}
	if st, msg := w.do(wire.OpOffload, &wire.Offload{Rid: "after", Label: "kv", GpuPages: []int32{3}}, &wire.OffloadReply{}); st != 0 {
		t.Fatalf("an offload once a keeper holds the pool: %s %s", st, msg)
	}
	w.c.Close()
	stop()

	a2, stop2 := keptAgent(t, dir, ksock, []string{"tenant-a"})
	defer stop2()
	w2 := dialAgent(t, a2.Socket())
	if got := w2.open("tenant-a", "instance-a"); !got.Resumed || got.Session != first.Session {
		t.Fatalf("after an agent restart on the new keeper: %+v", got)
	}
	for rid, pages := range map[string]uint32{"before": 2, "after": 1} {
		var n wire.NumPagesReply
		if st, msg := w2.do(wire.OpNumPages, &wire.Stream{Rid: rid, Label: "kv"}, &n); st != 0 || n.Pages != pages {
			t.Fatalf("stream %s after the restart: %s %s, %d pages", rid, st, msg, n.Pages)
		}
	}
	if r := a2.a.restartStatus(); r.PoolLost || r.AdoptedChunks != len(a2.a.hmem) {
		t.Fatalf("the restart on the new keeper: %+v", r)
	}
}

// A keeper that held the pool's lock is lost, and the one that replaces
// it leaves the lock with the agent (agent keeper --lock=false, or a
// keeper before lock requests): the agent maps every chunk again and
// locks it itself.
func TestKeeperLockTakenBackFromLostKeeper(t *testing.T) {
	dir := t.TempDir()
	ksock := filepath.Join(dir, "keeper", "keeper.sock")
	k1 := runKeeper(t, ksock)
	a, stop := keptAgent(t, dir, ksock, []string{"tenant-a"})
	defer stop()
	chunks := chunksOf(a)
	for id, c := range chunks {
		if !c.Locked {
			t.Skipf("chunk %s not locked here (no CAP_IPC_LOCK?): %v", id, c.Warnings)
		}
	}
	waitUntil(t, "the keeper holds the lock", func() bool { return kept(a) == len(chunks) })
	k1.kill()
	waitUntil(t, "the loss seen", func() bool { return a.a.durable() != nil })
	k2 := runKeeperLocking(t, ksock, false)
	waitUntil(t, "the new keeper takes the pool", func() bool { return a.a.durable() == nil })
	for id, c := range chunks {
		waitUntil(t, "chunk "+id+" mapped, resident and locked by the agent again", func() bool {
			mem := mapping(a, c)
			if mem == nil {
				return false
			}
			rss, locked, err := hostmem.Resident(mem)
			return err == nil && rss == c.Size && locked == c.Size
		})
	}
	if n := k2.k.Stat().Locked; n != 0 {
		t.Fatalf("a keeper with --lock=false holds %d bytes locked", n)
	}
}

// A keeper that lost the pool while no agent held it (both gone): the next
// agent finds it empty though its marker says it held books, and says the
// pool and its sessions were lost, not an ordinary first start.
func TestPoolLostAtStart(t *testing.T) {
	dir := t.TempDir()
	ksock := filepath.Join(dir, "keeper", "keeper.sock")
	k1 := runKeeper(t, ksock)
	a, stop := keptAgent(t, dir, ksock, []string{"tenant-a"})
	w := dialAgent(t, a.Socket())
	first := w.open("tenant-a", "instance-a")
	w.c.Close()
	stop()
	k1.kill()
	runKeeper(t, ksock)
	a2, stop2 := keptAgent(t, dir, ksock, []string{"tenant-a"})
	r := a2.a.restartStatus()
	if !r.PoolLost || r.LostChunks == 0 || r.AdoptedChunks != 0 {
		t.Fatalf("a start on a keeper that lost the pool: %+v", r)
	}
	if got := dialAgent(t, a2.Socket()).open("tenant-a", "instance-a"); got.Resumed || got.Session == first.Session {
		t.Fatalf("the lost session came back: %+v", got)
	}
	// A start after that one, on the same keeper, is an ordinary restart.
	stop2()
	a3, stop3 := keptAgent(t, dir, ksock, []string{"tenant-a"})
	defer stop3()
	if r := a3.a.restartStatus(); r.PoolLost {
		t.Fatalf("the next restart says the pool was lost again: %+v", r)
	}
}

// A stop with nothing to lose leaves no marker, even while the keeper is
// lost: an uninstall deletes the keeper's pod beside the agent's, and the
// marker written while the pool still held an allocation, since reclaimed,
// made the e2e uninstall leave it behind (and would make the next install
// report a lost pool).
func TestNoMarkerAfterAStopWithNothingToLose(t *testing.T) {
	dir := t.TempDir()
	ksock := filepath.Join(dir, "keeper", "keeper.sock")
	k := runKeeper(t, ksock)
	a, stop := keptAgent(t, dir, ksock, []string{"tenant-a"})
	if _, err := os.Stat(a.a.markerPath()); err != nil {
		t.Fatalf("no keeper marker while the pool holds an allocation: %v", err)
	}
	// The allocation reclaimed (as the plugin does for a pod that is gone),
	// then the keeper lost before the marker's next refresh (3 s).
	revoked := map[string]bool{}
	for _, c := range a.a.pool.Chunks() {
		if c.Allocation != "" && !revoked[c.Allocation] {
			revoked[c.Allocation] = true
			if _, err := a.a.pool.Revoke(c.Allocation); err != nil {
				t.Fatal(err)
			}
		}
	}
	k.kill()
	waitUntil(t, "the loss seen", func() bool { return a.a.durable() != nil })
	stop()
	if _, err := os.Stat(a.a.markerPath()); !os.IsNotExist(err) {
		t.Fatalf("the keeper marker is left after a stop with nothing to lose: %v", err)
	}
}

// Books that replay but do not rebuild a consistent pool make the agent
// start fresh, and the books it starts with are the fresh ones: the next
// restart finds none of the old sessions (the books memfd is written
// while the pool is rebuilt, so the copy of the old books, written first,
// must be replaced by the empty ones).
func TestBooksThatDoNotRebuildStartFresh(t *testing.T) {
	dir := t.TempDir()
	ksock, _ := startKeeper(t)
	a, stop := keptAgent(t, dir, ksock, []string{"tenant-a"})
	w := dialAgent(t, a.Socket())
	first := w.open("tenant-a", "instance-a")
	if st, msg := w.do(wire.OpOffload, &wire.Offload{Rid: "r", Label: "kv", GpuPages: []int32{1}}, &wire.OffloadReply{}); st != 0 {
		t.Fatalf("offload: %s %s", st, msg)
	}
	w.c.Close()
	stop()

	breakImage = func(img *pool.Image) {
		for i := range img.Sessions {
			img.Sessions[i].Capacity = -1
		}
	}
	a2, stop2 := keptAgent(t, dir, ksock, []string{"tenant-a"})
	breakImage = nil
	if r := a2.a.restartStatus(); r.Sessions != 0 || r.AdoptedChunks != 0 {
		t.Fatalf("a restart whose books did not rebuild: %+v", r)
	}
	if got := dialAgent(t, a2.Socket()).open("tenant-a", "instance-a"); got.Resumed || got.Session == first.Session {
		t.Fatalf("the old session came back: %+v", got)
	}
	stop2()

	a3, stop3 := keptAgent(t, dir, ksock, []string{"tenant-a"})
	defer stop3()
	r := a3.a.restartStatus()
	if r.Sessions != 1 || r.Streams != 0 {
		t.Fatalf("the restart after: %+v, want the one session opened since and no stream", r)
	}
}

// gogc is the collector's GOGC setting, read without changing it.
func gogc(t *testing.T) uint64 {
	s := []metrics.Sample{{Name: "/gc/gogc:percent"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		t.Fatalf("no %s here", s[0].Name)
	}
	return s[0].Value.Uint64()
}

// The restore turns the collector off until the agent serves: a restarted
// agent that serves turns it back on, and so does one whose start fails
// after the restore.
func TestCollectorBackOnAfterARestore(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(137))
	dir := t.TempDir()
	ksock, _ := startKeeper(t)
	_, stop := keptAgent(t, dir, ksock, []string{"tenant-a"})
	stop()
	a2, stop2 := keptAgent(t, dir, ksock, []string{"tenant-a"})
	w := dialAgent(t, a2.Socket())
	w.open("tenant-a", "instance-a")
	waitUntil(t, "GOGC back at 137 while the agent serves", func() bool { return gogc(t) == 137 })
	stop2()

	cfg := config.Default()
	cfg.SocketDir, cfg.StateDir = filepath.Join(dir, "sock"), filepath.Join(dir, "state")
	cfg.Metrics.Address, cfg.Health.Address = "", ""
	cfg.KeeperSocket = ksock
	cfg.Standalone.Tokens = []string{"tenant-a", "tenant-b", "tenant-c"} // three tokens, two chunks
	if _, err := Boot(context.Background(), Options{Config: &cfg, Standalone: true, ChunksPerGPU: 2, ChunkBytes: 2 << 20, Logger: quietLog}); err == nil {
		t.Fatal("an agent with more tokens than chunks started")
	} else {
		t.Logf("start failed as it should: %v", err)
	}
	if got := gogc(t); got != 137 {
		t.Fatalf("GOGC %d after a start that failed past the restore, want 137", got)
	}
}

// TestRestartLoggedWithoutASignOfLife: books whose header holds no sign of
// life (written before fresh memfds were stamped at once) still make a
// restart that is logged, its gap unknown; one with the sign of life logs
// the gap it measured.
func TestRestartLoggedWithoutASignOfLife(t *testing.T) {
	for _, stamped := range []bool{true, false} {
		dir := t.TempDir()
		ksock, _ := startKeeper(t)
		first, stop := keptAgent(t, dir, ksock, []string{"tenant-a"})
		if s := first.a.restartStatus().Restore; s != nil {
			t.Errorf("a first start reports restore steps: %+v", s)
		}
		stop()
		if !stamped {
			// As an agent would that held the books' memfd: zero the
			// header's sign of life, then let the keeper go on holding it.
			kc, held, err := keeper.Connect(ksock, 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if held.Books == nil {
				t.Fatal("the keeper holds no books after a stop")
			}
			if _, err := held.Books.WriteAt(make([]byte, 8), 32); err != nil {
				t.Fatal(err)
			}
			held.Close()
			kc.Close()
		}
		var log logging.SyncBuffer
		a, stop2 := keptAgentLogging(t, dir, ksock, []string{"tenant-a"}, slog.New(slog.NewTextHandler(&log, nil)))
		got := log.String()
		rs := a.a.restartStatus()
		stop2()
		want := `msg="serving again after a restart" gap=unknown`
		if stamped {
			want = `msg="serving again after a restart" gap=`
		}
		if !strings.Contains(got, want) || stamped == strings.Contains(got, "gap=unknown") {
			t.Errorf("stamped %v: the log does not say %q:\n%s", stamped, want, got)
		}
		if rs.AdoptedChunks == 0 || (rs.LastGapSeconds > 0) != stamped {
			t.Errorf("stamped %v: restart status %+v", stamped, rs)
		}
		if rs.BooksSnapshotBytes <= 0 || rs.BooksLogBytes <= rs.BooksSnapshotBytes || rs.BooksCompactions != 0 {
			t.Errorf("stamped %v: the books in the restart status: %+v", stamped, rs)
		}
		// The restore's steps, as the log line that says it adopted the
		// pool has them (rounded to the µs there).
		s := rs.Restore
		if s == nil || s.LoadSeconds <= 0 || s.RebuildSeconds <= 0 || s.WarmSeconds < 0 || s.AdoptSeconds < 0 || s.BooksSeconds < 0 {
			t.Fatalf("stamped %v: restore steps %+v", stamped, s)
		}
		m := regexp.MustCompile(`msg="pool adopted from the keeper".* load=(\S+) .* rebuild=(\S+) `).FindStringSubmatch(got)
		for i, v := range []float64{s.LoadSeconds, s.RebuildSeconds} {
			if m == nil {
				t.Fatalf("stamped %v: no adoption logged:\n%s", stamped, got)
			}
			logged, err := time.ParseDuration(m[i+1])
			if d := logged.Seconds() - v; err != nil || d > 1e-6 || d < -1e-6 {
				t.Errorf("stamped %v: step %d logged %s, reported %.9f s (%v)", stamped, i, m[i+1], v, err)
			}
		}
	}
}

// TestBooksCompactedWhileQuiet: once no change comes for a while, the
// agent compacts its books (they hold a snapshot and nothing after it),
// and the next agent restores every stream from that snapshot.
func TestBooksCompactedWhileQuiet(t *testing.T) {
	oldAfter, oldFrom := quietCompactAfter, quietCompactFrom
	quietCompactAfter, quietCompactFrom = 300*time.Millisecond, 1
	t.Cleanup(func() { quietCompactAfter, quietCompactFrom = oldAfter, oldFrom })
	dir := t.TempDir()
	ksock, _ := startKeeper(t)
	a, stop := keptAgent(t, dir, ksock, []string{"tenant-a"})
	w := dialAgent(t, a.Socket())
	w.open("tenant-a", "instance-a")
	const streams = 200
	for i := range streams {
		if st, msg := w.do(wire.OpOffload, &wire.Offload{Rid: fmt.Sprintf("r%03d", i), Label: "kv", GpuPages: []int32{int32(i % 8)}}, &wire.OffloadReply{}); st != 0 {
			t.Fatalf("offload %d: %s %s", i, st, msg)
		}
	}
	before := a.a.restartStatus()
	if before.BooksLogBytes <= 4096+before.BooksSnapshotBytes {
		t.Fatalf("no records after the snapshot after %d offloads: %+v", streams, before)
	}
	waitUntil(t, "the books compacted", func() bool {
		r := a.a.restartStatus()
		return r.BooksCompactions > before.BooksCompactions && r.BooksLogBytes == 4096+r.BooksSnapshotBytes
	})
	stop()
	a2, stop2 := keptAgent(t, dir, ksock, []string{"tenant-a"})
	defer stop2()
	w2 := dialAgent(t, a2.Socket())
	w2.open("tenant-a", "instance-a")
	for _, i := range []int{0, streams / 2, streams - 1} {
		var n wire.NumPagesReply
		if st, msg := w2.do(wire.OpNumPages, &wire.Stream{Rid: fmt.Sprintf("r%03d", i), Label: "kv"}, &n); st != 0 || n.Pages != 1 {
			t.Fatalf("stream %d after the restart: %s %s, %d pages", i, st, msg, n.Pages)
		}
	}
	if r := a2.a.restartStatus(); r.Streams != streams {
		t.Fatalf("restored %d streams, want %d: %+v", r.Streams, streams, r)
	}
}

// A restart plans the pool it is about to adopt. The kept chunks are
// resident and locked, so MemAvailable no longer counts them; a plan made
// from the node's figures alone (sizing.fraction of MemAvailable, the
// default) came out half the size at every restart, and the kept chunks
// past it were dropped with whatever they held. The node here is a fake
// /proc whose MemAvailable falls by the pool between the two starts, as
// the kernel's does.
func TestRestartPlansWithTheKeptMemory(t *testing.T) {
	dir := t.TempDir()
	ks, _ := startKeeper(t)
	root := filepath.Join(dir, "root")
	if err := os.MkdirAll(filepath.Join(root, "proc"), 0o755); err != nil {
		t.Fatal(err)
	}
	meminfo := func(availMiB int) {
		t.Helper()
		data := fmt.Sprintf("MemTotal: %d kB\nMemAvailable: %d kB\n", 64<<20, availMiB<<10)
		if err := os.WriteFile(filepath.Join(root, "proc/meminfo"), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cfg := config.Default()
	cfg.SocketDir, cfg.StateDir = filepath.Join(dir, "sock"), filepath.Join(dir, "state")
	cfg.KubeletDir = filepath.Join(dir, "kubelet")
	cfg.Metrics.Address, cfg.Health.Address = "", ""
	cfg.KeeperSocket = ks
	// Half of MemAvailable in 2 MiB chunks of 4 KiB pages.
	cfg.Sizing.ChunkBytes, cfg.Sizing.ReserveBytes = 2<<20, 0
	cfg.Sizing.HugePages = config.HugePagesNever
	boot := func() (*Agent, func()) {
		t.Helper()
		c := cfg
		return bootAgent(t, Options{Config: &c, SimulateGPUs: 1, Root: root, Logger: quietLog})
	}
	restart := func(what string, wantPlanned, wantAdopted int) {
		t.Helper()
		a, stop := boot()
		defer stop()
		if got := len(a.a.specs); got != wantPlanned {
			t.Errorf("%s: the restarted agent planned %d chunks, want %d", what, got, wantPlanned)
		}
		if got := len(a.a.restart.adopted); got != wantAdopted {
			t.Errorf("%s: adopted %d kept chunks, want %d", what, got, wantAdopted)
		}
	}
	meminfo(16)
	a, stop := boot()
	waitUntil(t, "the first agent's 4 chunks", func() bool { return len(chunksOf(a)) == 4 })
	stop()

	meminfo(16 - 8) // the kept 8 MiB are no longer available
	restart("the node as before", 4, 4)

	// Others took 4 MiB meanwhile: the node's figures plan 3 chunks. With
	// something to lose (the marker, as an agent serving an allocation
	// writes it) under the same policy, the pool keeps its 4.
	meminfo(16 - 8 - 4)
	data, _ := json.Marshal(marker{BooksGen: 1, Allocations: 1, Sizing: &cfg.Sizing})
	if err := writeFileAtomic(filepath.Join(cfg.StateDir, markerFile), data); err != nil {
		t.Fatal(err)
	}
	restart("less free memory, the same policy, an allocation", 4, 4)
	// Nothing to lose (that stop removed the marker): the plan stands and
	// the kept chunk past it is dropped.
	restart("less free memory, nothing to lose", 3, 3)
}

// A restart under the sizing policy its pool was planned with keeps the
// chunks it holds even where the node's free memory now plans fewer (the
// marker, there while the pool holds an allocation or a session, names the
// policy); a changed policy, no marker or a kept chunk the plan would not
// name plans as the node says.
func TestRestartKeepsTheKeptPoolUnderTheSamePolicy(t *testing.T) {
	policy := config.Default().Sizing
	policy.ChunkBytes = 2 << 20
	smaller := policy
	smaller.Fraction = 0.25
	held := func(ids ...string) []keeper.Held {
		var hs []keeper.Held
		for _, id := range ids {
			hs = append(hs, keeper.Held{Item: keeper.Item{ID: id, Size: 2 << 20}})
		}
		return hs
	}
	four := held("gpu0-numa0-0", "gpu0-numa0-1", "gpu0-numa0-2", "gpu0-numa0-3")
	for _, c := range []struct {
		name   string
		marker *config.Sizing // nil: no marker
		held   []keeper.Held
		want   int
	}{
		{"the same policy", &policy, four, 4},
		{"a changed policy", &smaller, four, 2},
		{"no marker: nothing to lose", nil, four, 2},
		{"a marker from before the policy was kept", &config.Sizing{}, four, 2},
		{"chunks of another NUMA node or size", &policy, append(held("gpu0-numa1-5", "gpu9-numa0-7"),
			keeper.Held{Item: keeper.Item{ID: "gpu0-numa0-6", Size: 4 << 20}}), 2},
		// Raised only over the kept chunks: the one past the gap is not
		// kept by planning fresh ones below it.
		{"a gap in the kept indexes", &policy, held("gpu0-numa0-0", "gpu0-numa0-1", "gpu0-numa0-2", "gpu0-numa0-4"), 3},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := config.Default()
			cfg.StateDir = t.TempDir()
			a := &agent{cfg: &cfg, log: quietLog, restart: &restart{held: &keeper.State{Chunks: c.held}}}
			if c.marker != nil {
				m := marker{BooksGen: 3, Allocations: 1}
				if *c.marker != (config.Sizing{}) {
					m.Sizing = c.marker
				}
				data, _ := json.Marshal(m)
				if err := writeFileAtomic(a.markerPath(), data); err != nil {
					t.Fatal(err)
				}
			}
			p := &sizing.Plan{ChunkBytes: 2 << 20, Total: 4 << 20, Bound: sizing.BoundFraction,
				GPUs: []sizing.GPUPlan{{GPU: 0, NUMA: 0, Chunks: 2, Bytes: 4 << 20, Bound: sizing.BoundFraction}}}
			a.restart.marker = a.readMarker() // as connectKeeper reads it
			a.keepKeptPool(p, policy)
			if got := p.GPUs[0].Chunks; got != c.want {
				t.Errorf("planned %d chunks, want %d", got, c.want)
			}
		})
	}
}

// A plan of more chunks than sizing.MaxChunks fails a fresh start, naming
// the chunk size that fits; a restart that adopts what the keeper holds (a
// pool an agent before the bound planned) goes on with the plan instead of
// failing, and so dropping the pool and its sessions.
func TestTooManyChunksRefusedButAKeptPoolKept(t *testing.T) {
	cfg := config.Default()
	cfg.StateDir = t.TempDir()
	cfg.Sizing.PoolBytes, cfg.Sizing.ChunkBytes = 64<<30, 2<<20 // 32,768 chunks
	cfg.Sizing.HugePages = config.HugePagesNever
	info := &node.Info{MemTotal: 512 << 30, MemAvailable: 500 << 30, Cgroup: node.Cgroup{Limit: node.Unlimited, Usage: -1}}
	for _, c := range []struct {
		name    string
		restart *restart
		want    string // "" plans
	}{
		{"a fresh start", nil, "sizing: too many chunks: 64Gi in 32768 chunks of 2Mi"},
		{"a restart adopting a kept pool", &restart{held: &keeper.State{}}, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			a := &agent{cfg: &cfg, log: quietLog, info: info, restart: c.restart,
				devs: []gpu.Device{{Index: 0, UUID: "GPU-0", NUMA: -1, Memory: 80 << 30}}}
			p, _, err := a.sizedPlan(false)()
			switch {
			case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "set sizing.chunkBytes to 4Mi or more")):
				t.Fatalf("plan: %v, want an error naming %q and the chunk size that fits", err, c.want)
			case c.want == "" && (err != nil || p.GPUs[0].Chunks != 32768):
				t.Fatalf("plan: %v, want the plan of 32768 chunks", err)
			}
		})
	}
}

// TestInspectKeptTakesTheKeepersWordForSealedChunks: what the keeper read
// of a sealed chunk's memfd at its put (its size, seals and page size) is
// taken as it says, with no system call (such a Held has no file here:
// asking it would fail); an unsealed chunk, and every chunk of a keeper
// that sends no page size, is asked itself, each at its own place
// whichever lane asks it.
func TestInspectKeptTakesTheKeepersWordForSealedChunks(t *testing.T) {
	newMemfd := func(size int64, seal bool) *os.File {
		f := memfdFile(t, size)
		if seal {
			if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, hostmem.Seals); err != nil {
				t.Fatal(err)
			}
		}
		return f
	}
	page := int64(os.Getpagesize())
	var held []keeper.Held
	var want []hostmem.FileInfo
	for i := range 300 {
		size := int64(i+1) * page
		switch i % 3 {
		case 0: // sealed, the keeper's word: no file to ask
			held = append(held, keeper.Held{Item: keeper.Item{ID: fmt.Sprint(i), Size: size, Seals: hostmem.Seals, PageSize: 2 << 20}})
			want = append(want, hostmem.FileInfo{Size: size, PageSize: 2 << 20, Seals: hostmem.Seals})
		case 1: // unsealed: asked, whatever the item says
			held = append(held, keeper.Held{Item: keeper.Item{ID: fmt.Sprint(i), Size: 1, PageSize: 2 << 20}, File: newMemfd(size, false)})
			want = append(want, hostmem.FileInfo{Size: size, PageSize: page})
		default: // sealed, from a keeper that sends no page size: asked
			held = append(held, keeper.Held{Item: keeper.Item{ID: fmt.Sprint(i), Size: 1, Seals: hostmem.Seals}, File: newMemfd(size, true)})
			want = append(want, hostmem.FileInfo{Size: size, PageSize: page, Seals: hostmem.Seals})
		}
	}
	for i, k := range inspectKept(held) {
		if k.err != nil || k.info != want[i] {
			t.Fatalf("chunk %d: %+v (%v), want %+v", i, k.info, k.err, want[i])
		}
	}
}
