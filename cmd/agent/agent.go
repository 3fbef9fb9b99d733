package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/kvpool/kvpool/internal/bytesize"
	"github.com/kvpool/kvpool/pkg/config"
	"github.com/kvpool/kvpool/pkg/events"
	"github.com/kvpool/kvpool/pkg/gpu"
	"github.com/kvpool/kvpool/pkg/hostmem"
	"github.com/kvpool/kvpool/pkg/node"
	"github.com/kvpool/kvpool/pkg/plugin"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/server"
	"github.com/kvpool/kvpool/pkg/sizing"
	"github.com/kvpool/kvpool/pkg/standalone"
)

// version is the agent's version, set at link time (-X main.version=...).
var version = "dev"

// nvmlLib is the NVML binding GPU discovery uses; tests replace it.
var nvmlLib = func() nvml.Interface { return nvml.New() }

// agent is the running node agent: the pool, its chunks, the copy server,
// the device plugin and the observability endpoints.
type agent struct {
	log    *slog.Logger
	cfg    *config.Config
	setup  *serveSetup
	mode   string // "cluster" or "standalone"
	node   string
	socket string
	plan   *sizing.Plan
	specs  []hostmem.Spec

	pool *pool.Pool
	mu   sync.RWMutex
	hmem map[string]*hostmem.Chunk

	obs    *observability
	plug   *pluginRun
	kube   *kubeParts
	events events.Events
	// static maps standalone tokens to their allocation; tokenChunks the
	// chunks each token is granted once they are ready.
	static      map[string]string
	tokenChunks map[string][]string
	granted     atomic.Bool
	// refused counts pod-binding refusals since the last logged one.
	refused, refusedLogged atomic.Int64

	// restart is what the agent took over from the keeper; nil without one.
	restart *restart

	ln         *net.UnixListener
	serveDone  chan error
	background sync.WaitGroup
	// cancel ends the context every goroutine of the agent runs under:
	// on a signal, a fatal error of the socket server, or a failed start.
	cancel context.CancelFunc
}

// bootAgent brings the agent up in start-up order: node and GPUs, the
// sizing plan, the socket server, observability, the device plugin, then
// the chunks in the background. It returns once the socket is listening.
//
// Every goroutine it starts runs under a context of its own, which a failed
// start cancels before releasing what it got to: a failed start returns its
// error at once instead of waiting on loops nothing would stop.
func bootAgent(parent context.Context, s *serveSetup, log *slog.Logger) (_ *agent, err error) {
	cfg := s.cfg
	ctx, cancel := context.WithCancel(parent)
	a := &agent{log: log, cfg: cfg, setup: s, mode: "cluster", socket: s.socket, pool: pool.New(),
		hmem: map[string]*hostmem.Chunk{}, events: events.Nop, cancel: cancel}
	if s.flags.standalone {
		a.mode = "standalone"
	}
	a.node = os.Getenv("NODE_NAME")
	if a.node == "" {
		a.node = hostname()
	}
	defer func() {
		if err != nil {
			cancel()
			a.abort()
		}
	}()

	info, err := node.Read(s.flags.root)
	if err != nil {
		return nil, err
	}
	var allocatable int64
	if !s.flags.standalone {
		if a.kube, err = connectKube(ctx, s, log); err != nil {
			return nil, err
		}
		if a.kube != nil {
			a.node = a.kube.node
			allocatable = a.kube.allocatable
			a.events = a.kube.events
		}
	}
	devs, source, err := a.gpus(info)
	if err != nil {
		return nil, err
	}
	if err := a.makePlan(info, devs, allocatable); err != nil {
		return nil, err
	}
	a.logPlan(source)
	if cfg.KeeperSocket != "" {
		if err := a.restore(); err != nil {
			return nil, err
		}
	}
	if s.flags.standalone || cfg.Sizing.HugePages == config.HugePagesPrefer {
		for _, w := range a.plan.Warnings {
			if strings.Contains(w, "huge pages") {
				a.events.HugePagesFallback(w)
			}
		}
	}
	if err := a.prepareTokens(); err != nil {
		return nil, err
	}

	// Observability first, so start-up failures after this are counted.
	a.obs = newObservability(a.pool, obsOptions{Node: a.node, Mode: a.mode, Version: version,
		Targets: func() map[int]int64 {
			m := map[int]int64{}
			for _, g := range a.plan.GPUs {
				m[g.GPU] = g.Bytes
			}
			return m
		}})
	for _, g := range a.plan.GPUs {
		a.obs.Metrics.InitGPU(g.GPU)
	}
	a.obs.Report.Restart = a.restartStatus
	a.obs.Metrics.Restart(a.restartStatus)

	// The device plugin is built (not yet registered) before the server,
	// whose Authorize resolves the tokens it hands out.
	pcfg := pluginConfig{
		Enabled:      !s.flags.standalone || s.flags.devicePlugin,
		ResourceName: cfg.ResourceName, KubeletDir: cfg.KubeletDir, SocketDir: cfg.SocketDir, StateDir: cfg.StateDir,
		GracePeriod: cfg.Reclaim.GracePeriod.Duration, Interval: cfg.Reclaim.Interval.Duration,
		BindPods: cfg.TokenBinding == config.TokenBindingPod, PodLogsDir: cfg.PodLogsDir,
	}
	if a.plug, err = newPlugin(pcfg, a.pool, a.renew, a.events, log); err != nil {
		return nil, err
	}
	a.settleRestored()

	// Standalone tokens name their chunks up front: allocate before the
	// socket appears, so a client that finds the socket finds its chunks.
	if a.static != nil {
		a.allocate(ctx)
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}

	uuids := make(map[string]int, len(a.plan.GPUs))
	for _, g := range a.plan.GPUs {
		uuids[g.UUID] = g.GPU
	}
	srv, err := server.New(server.Options{
		GPUs:      uuids,
		Pool:      a.pool,
		Chunks:    a.chunk,
		Authorize: a.authorize,
		AuthorizePeer: func(token string, peer server.Peer) (string, error) {
			return a.authorizePeer(ctx, token, peer)
		},
		Logger:   log,
		Hooks:    serverHooks(a.obs.Observer, a.obs.limitRejects),
		Journal:  a.journal(),
		Name:     "kvpool-agent " + version + " (" + a.mode + ")",
		Limits:   serverLimits(cfg.Limits),
		ProbePID: os.Getpid(),
	})
	if err != nil {
		return nil, err
	}
	if s.flags.standalone {
		if err := standalone.CheckSocketDir(filepath.Dir(a.socket)); err != nil {
			return nil, err
		}
	}
	if a.restart != nil {
		if err := srv.Restore(a.restart.sessions); err != nil {
			return nil, err
		}
	}
	if a.ln, err = server.Listen(a.socket); err != nil {
		return nil, err
	}
	if r := a.restart; r != nil {
		if !r.lastAlive.IsZero() {
			r.gap = time.Since(r.lastAlive)
			a.log.Info("serving again after a restart", "gap", r.gap.Round(time.Millisecond),
				"adoptedChunks", len(r.adopted), "sessions", len(r.sessions), "streams", r.streams)
		}
		a.background.Add(1)
		go func() {
			defer a.background.Done()
			a.heartbeat(ctx)
		}()
	}
	a.serveDone = make(chan error, 1)
	go func() { a.serveDone <- srv.Serve(ctx, a.ln) }()

	a.addHealthChecks(ctx)
	if err := a.obs.start(ctx, cfg.Metrics.Address, cfg.Health.Address); err != nil {
		return nil, err
	}
	if a.plug != nil {
		a.plug.start(ctx)
	}
	if a.kube != nil {
		a.kube.startStatus(ctx, a, &a.background)
	}
	if a.static == nil {
		a.background.Add(1)
		go func() {
			defer a.background.Done()
			a.allocate(ctx)
		}()
	}
	a.logServing()
	return a, nil
}

// gpus finds the GPUs: simulated in standalone mode or with
// --simulate-gpus, else through NVML.
func (a *agent) gpus(info *node.Info) ([]gpu.Device, string, error) {
	var numa []int
	for _, n := range info.NUMANodes {
		numa = append(numa, n.ID)
	}
	if a.setup.flags.standalone {
		return gpu.Simulated(a.cfg.Standalone.GPUs, simulatedGPUMemory, numa), "simulated (standalone)", nil
	}
	if n := a.setup.flags.simulateGPUs; n > 0 {
		return gpu.Simulated(n, simulatedGPUMemory, numa), "simulated (--simulate-gpus)", nil
	}
	devs, err := gpu.Discover(nvmlLib(), a.setup.flags.root)
	if errors.Is(err, gpu.ErrNoNVML) {
		return nil, "", fmt.Errorf("%w.\nRun the agent on a GPU node, pass --simulate-gpus N to serve N simulated GPUs (nodes without GPUs, tests), or use --standalone", err)
	}
	if err != nil {
		return nil, "", err
	}
	if len(devs) == 0 {
		return nil, "", errors.New("NVML found no GPU on this node; nothing to serve (--simulate-gpus N to simulate)")
	}
	return devs, "NVML", nil
}

// makePlan sizes the pool and turns it into chunk specs.
func (a *agent) makePlan(info *node.Info, devs []gpu.Device, allocatable int64) error {
	policy := a.cfg.Sizing
	f := a.setup.flags
	if f.standalone && f.chunksPerGPU > 0 {
		// The fixed layout of --chunks-per-gpu and --chunk-mib.
		cb := int64(f.chunkMiB) << 20
		a.plan = &sizing.Plan{ChunkBytes: cb, Bound: "--chunks-per-gpu", Limits: []sizing.Limit{}}
		for _, d := range devs {
			a.plan.GPUs = append(a.plan.GPUs, sizing.GPUPlan{GPU: d.Index, UUID: d.UUID, NUMA: d.NUMA,
				Bytes: cb * int64(f.chunksPerGPU), Chunks: f.chunksPerGPU, PageSize: int64(os.Getpagesize()), Bound: "--chunks-per-gpu"})
			a.plan.Total += cb * int64(f.chunksPerGPU)
		}
		policy.HugePages = config.HugePagesNever
	} else {
		in := sizing.Input{Node: info, Allocatable: allocatable}
		for _, d := range devs {
			in.GPUs = append(in.GPUs, sizing.GPU{Index: d.Index, UUID: d.UUID, NUMA: d.NUMA, Memory: d.Memory})
		}
		if f.standalone {
			policy = sizing.Standalone(a.cfg, len(devs))
		}
		p, err := sizing.Make(policy, in)
		if err != nil {
			return fmt.Errorf("sizing the pool: %w", err)
		}
		a.plan = p
	}
	workers := max(1, min(runtime.NumCPU()/2, 8))
	a.specs = a.plan.Specs(policy.HugePages, workers)
	// Simulated GPUs copy with the CPU: pinning gains nothing, so a memlock
	// limit only warns.
	if f.standalone || f.simulateGPUs > 0 {
		for i := range a.specs {
			a.specs[i].LockFallback = true
		}
	}
	return nil
}

func (a *agent) logPlan(source string) {
	p := a.plan
	a.log.Info("pool plan", "mode", a.mode, "gpus", source, bytesize.Attr("total", p.Total),
		bytesize.Attr("chunk", p.ChunkBytes), "chunks", len(a.specs), "boundBy", p.Bound)
	for _, g := range p.GPUs {
		a.log.Info("pool plan gpu", "gpu", g.GPU, "uuid", g.UUID, "numa", g.NUMA, bytesize.Attr("bytes", g.Bytes),
			"chunks", g.Chunks, bytesize.Attr("pageSize", g.PageSize), "boundBy", g.Bound)
	}
	for _, w := range p.Warnings {
		a.log.Warn("pool plan", "warning", w)
	}
}

// prepareTokens decides the standalone allocations: each token gets every
// n-th chunk of each GPU. With the device plugin the plugin hands out
// tokens instead.
func (a *agent) prepareTokens() error {
	if !a.setup.flags.standalone {
		return nil
	}
	if a.setup.flags.devicePlugin {
		if !a.setup.randomToken {
			a.log.Warn("standalone tokens are ignored with --device-plugin: kubelet's Allocate hands out the tokens")
		}
		return nil
	}
	toks := a.cfg.Standalone.Tokens
	if a.setup.randomToken {
		toks = []string{standalone.NewToken()}
	}
	gpus := make([][]string, len(a.plan.GPUs))
	for i, g := range a.plan.GPUs {
		gpus[i] = g.ChunkIDs()
	}
	static, chunks, err := standalone.Allocations(toks, gpus)
	if err != nil {
		return err
	}
	a.static, a.tokenChunks = static, chunks
	return nil
}

// authorize resolves an allocation token: a standalone token, or one the
// device plugin handed out in Allocate.
func (a *agent) authorize(token string) (string, error) {
	if alloc, ok := a.static[token]; ok {
		if !a.granted.Load() {
			return "", fmt.Errorf("%w: the pool is still being allocated", pool.ErrNotReady)
		}
		return alloc, nil
	}
	if a.plug != nil {
		alloc, err := a.plug.Plugin.Authorize(token)
		if errors.Is(err, pool.ErrNotReady) {
			return "", err
		}
		if err != nil {
			return "", fmt.Errorf("%w: %v", server.ErrUnknownToken, err)
		}
		return alloc, nil
	}
	return "", server.ErrUnknownToken
}

// authorizePeer is authorize with the client's credentials: a token the
// device plugin handed out works only from its pod when tokenBinding is
// "pod" (plugin.Plugin.AuthorizePeer).
func (a *agent) authorizePeer(ctx context.Context, token string, peer server.Peer) (string, error) {
	if _, ok := a.static[token]; ok || a.plug == nil {
		return a.authorize(token)
	}
	alloc, err := a.plug.Plugin.AuthorizePeer(ctx, token, peer.PID)
	if err != nil {
		if errors.Is(err, pool.ErrNotReady) {
			return "", err // restored, its chunks not yet back: "retry"
		}
		if errors.Is(err, plugin.ErrUnknownToken) {
			return "", fmt.Errorf("%w: %v", server.ErrUnknownToken, err)
		}
		// At most one line a second: a pod retrying in a loop must not
		// flood the log.
		n := a.refused.Add(1)
		if now := time.Now().UnixNano(); now-a.refusedLogged.Load() >= int64(time.Second) {
			a.refusedLogged.Store(now)
			a.refused.Store(0)
			a.log.Warn("token refused", "pid", peer.PID, "uid", peer.UID, "refusedSinceLastLine", n, "err", err)
		}
		return "", err
	}
	return alloc, nil
}

// chunk is the server's ChunkSource.
func (a *agent) chunk(id string) (*hostmem.Chunk, bool) {
	a.mu.RLock()
	defer a.mu.RUnlock()
	c, ok := a.hmem[id]
	return c, ok
}

// renewCloseDelay keeps a dropped chunk's (emptied) file open a little
// longer, in case a reply that looked the chunk up just before the reclaim is
// still sending its descriptor.
const renewCloseDelay = 10 * time.Second

// renew replaces a reclaimed chunk: the old one is dropped (unmapped, its
// pages released even where a pod still maps them) and a fresh one, made as
// at start (bound, pre-faulted, locked, sealed), takes its ID. The plugin
// calls it and keeps the chunk unhealthy until it succeeds.
func (a *agent) renew(id string) error {
	var spec *hostmem.Spec
	for i := range a.specs {
		if a.specs[i].ID == id {
			spec = &a.specs[i]
		}
	}
	if spec == nil {
		return fmt.Errorf("renew: no planned chunk %q", id)
	}
	g := -1
	for _, p := range a.plan.GPUs {
		if slices.Contains(p.ChunkIDs(), id) {
			g = p.GPU
		}
	}
	a.mu.Lock()
	old := a.hmem[id]
	delete(a.hmem, id)
	a.mu.Unlock()
	start := time.Now()
	if old != nil {
		if err := old.Drop(renewCloseDelay); err != nil {
			a.log.Warn("dropping reclaimed chunk", "chunk", id, "err", err)
		}
	}
	c, err := hostmem.Alloc(spec.Options)
	if err != nil {
		err = fmt.Errorf("renew chunk %s: %w", id, err)
		a.obs.Metrics.ChunkRenewFailed(g, err)
		return err
	}
	if err := a.keep(id, c); err != nil {
		// The keeper must hold every chunk a session may use, or a
		// restart would lose it.
		c.Close()
		err = fmt.Errorf("renew chunk %s: hand it to the keeper: %w", id, err)
		a.obs.Metrics.ChunkRenewFailed(g, err)
		return err
	}
	took := time.Since(start)
	a.mu.Lock()
	a.hmem[id] = c
	a.mu.Unlock()
	a.obs.Metrics.ChunkRenewed(g, took)
	a.log.Info("chunk renewed", "chunk", id, "took", took.Round(time.Microsecond), bytesize.Attr("pageSize", int64(c.PageSize)), "node", c.Node, "locked", c.Locked)
	return nil
}

// allocate allocates the planned chunks one by one, adding each to the
// pool (and so to the device plugin's device list) as soon as it is ready.
func (a *agent) allocate(ctx context.Context) {
	start := time.Now()
	gpuOf := map[string]int{}
	wantPage := map[string]int64{}
	left := map[int]int{}
	for _, g := range a.plan.GPUs {
		left[g.GPU] = g.Chunks
		for _, id := range g.ChunkIDs() {
			gpuOf[id] = g.GPU
		}
	}
	var specs []hostmem.Spec
	for _, s := range a.specs {
		wantPage[s.ID] = s.PageSize
		if a.restart != nil && a.restart.adopted[s.ID] {
			left[gpuOf[s.ID]]-- // adopted from the keeper: already in the pool
			continue
		}
		specs = append(specs, s)
	}
	last := start
	fellBack := false
	ready, total := len(a.specs)-len(specs), len(a.specs)
	for r := range hostmem.AllocateAll(ctx, specs, a.log) {
		g := gpuOf[r.ID]
		if r.Err != nil {
			a.obs.Metrics.ChunkPinFailed(g, r.Err)
			a.obs.Errors.Error("hostmem", fmt.Errorf("chunk %s: %w", r.ID, r.Err))
			a.log.Error("pool allocation stopped; serving the chunks already ready", "chunk", r.ID, "ready", ready, "of", total, "err", r.Err)
			break
		}
		now := time.Now()
		c := r.Chunk
		if w := wantPage[r.ID]; w > int64(os.Getpagesize()) && c.PageSize < w && !fellBack {
			fellBack = true
			a.events.HugePagesFallback(strings.Join(c.Warnings, "; "))
		}
		pc := pool.Chunk{ID: r.ID, GPU: g, NUMA: c.Node, Size: c.Size}
		if c.Node < 0 {
			pc.NUMA = a.numaOf(g)
		}
		if err := a.keep(r.ID, c); err != nil {
			// A chunk the keeper does not hold would be lost by a restart
			// with everything written to it: not used.
			c.Close()
			a.obs.Metrics.Error("keeper", err)
			a.obs.Errors.Error("keeper", fmt.Errorf("chunk %s: %w", r.ID, err))
			a.log.Error("pool allocation stopped: the keeper does not take the chunk", "chunk", r.ID, "err", err)
			break
		}
		a.mu.Lock()
		a.hmem[r.ID] = c
		a.mu.Unlock()
		if err := a.pool.AddChunk(pc); err != nil {
			a.log.Error("adding chunk to the pool", "chunk", r.ID, "err", err)
			a.obs.Metrics.Error("pool", err)
			continue
		}
		ready++
		if a.restart != nil {
			a.restart.fresh.Add(1)
		}
		a.obs.Metrics.ChunkPinned(g, now.Sub(last))
		last = now
		if left[g]--; left[g] == 0 {
			a.obs.Metrics.PoolFilled(g, now.Sub(start))
		}
		if a.plug != nil {
			if err := a.plug.Feed.Set(plugin.PoolDevices(a.pool.Chunks())); err != nil {
				a.log.Error("device list", "err", err)
			}
			a.plug.Plugin.GrantPending()
		}
	}
	if ctx.Err() != nil {
		return
	}
	if ready == total {
		a.events.PoolReady(a.plan.Total, total, time.Since(start))
		a.log.Info("pool ready", "chunks", total, bytesize.Attr("bytes", a.plan.Total), "took", time.Since(start).Round(time.Millisecond))
	}
	a.grantStatic()
}

// numaOf is the planned NUMA node of a GPU's chunks (-1 when unknown).
func (a *agent) numaOf(g int) int {
	for _, p := range a.plan.GPUs {
		if p.GPU == g {
			return p.NUMA
		}
	}
	return -1
}

// grantStatic grants the standalone tokens their ready chunks.
func (a *agent) grantStatic() {
	if a.static == nil {
		return
	}
	a.mu.RLock()
	have := map[string]bool{}
	for id := range a.hmem {
		have[id] = true
	}
	a.mu.RUnlock()
	for tok, alloc := range a.static {
		var ids []string
		for _, id := range a.tokenChunks[tok] {
			if have[id] {
				ids = append(ids, id)
			}
		}
		a.tokenChunks[tok] = ids
		if len(ids) == 0 {
			a.log.Error("standalone token has no ready chunk", "allocation", alloc)
			continue
		}
		if err := a.pool.Grant(alloc, ids); err != nil {
			a.log.Error("granting standalone chunks", "allocation", alloc, "err", err)
			continue
		}
		a.log.Info("allocation", "token", tok, "chunks", strings.Join(ids, ","))
	}
	a.granted.Store(true)
	var first string
	for tok := range a.static {
		if first == "" || tok < first {
			first = tok
		}
	}
	a.log.Info("standalone tokens granted",
		"try", fmt.Sprintf("KVPOOL_SOCKET=%s KVPOOL_TOKEN=%s go run ./cmd/kvclient", a.socket, first))
}

func (a *agent) logServing() {
	attrs := []any{"mode", a.mode, "node", a.node, "socket", a.socket, "gpus", len(a.plan.GPUs),
		"chunks", len(a.specs), bytesize.Attr("chunk", a.plan.ChunkBytes)}
	if a.obs.metricsAddr != nil {
		attrs = append(attrs, "metrics", a.obs.metricsAddr.String())
	}
	if a.obs.healthAddr != nil {
		attrs = append(attrs, "health", a.obs.healthAddr.String())
	}
	if a.plug != nil {
		attrs = append(attrs, "devicePlugin", a.cfg.ResourceName)
	}
	a.log.Info("kvpool agent serving", attrs...)
}

// wait serves until ctx ends, then shuts down: the server stops accepting
// and closes its connections, the plugin unregisters, the allocation stops,
// and the chunks are freed.
//
// When the socket server stops on its own (a fatal accept error), wait logs
// why, stops everything else and returns the error, so that the process
// exits non-zero and kubelet restarts it.
func (a *agent) wait(ctx context.Context) error {
	var err error
	select {
	case err = <-a.serveDone:
		if ctx.Err() == nil {
			if err == nil {
				err = errors.New("stopped without an error")
			}
			err = fmt.Errorf("socket server stopped: %w", err)
			a.log.Error("fatal: shutting down", "err", err)
		}
	case <-ctx.Done():
		err = <-a.serveDone
	}
	a.cancel()
	a.abort()
	return err
}

// serverLimits turns the configured limits into the server's.
func serverLimits(l config.Limits) server.Limits {
	return server.Limits{
		MaxConns: l.MaxConns, MaxConnsPerUID: l.MaxConnsPerUID, MaxConnsPerPID: l.MaxConnsPerPID,
		ProbeConns: l.ProbeConns, HelloTimeout: l.HelloTimeout.Duration, OpenTimeout: l.OpenTimeout.Duration,
		MaxSessions: l.MaxSessions, MaxSessionsPerAllocation: l.MaxSessionsPerAllocation,
		MaxStreamsPerSession: l.MaxStreamsPerSession, MaxNameBytesPerSession: int64(l.MaxNameBytesPerSession),
		MaxDevicePages: l.MaxDevicePages, MaxClientName: l.MaxClientName,
	}
}

// abort releases whatever start-up got to. The caller's ctx must be done
// (or start-up failed before any goroutine started).
func (a *agent) abort() {
	if a.ln != nil {
		a.ln.Close()
		os.Remove(a.socket)
	}
	if a.plug != nil {
		a.plug.Wait()
	}
	a.background.Wait()
	if a.kube != nil {
		a.kube.stopped()
		a.kube.close()
	}
	if r := a.restart; r != nil {
		// The keeper keeps the memory and the books for the next agent.
		if r.books != nil {
			r.books.Close()
		}
		r.keeper.Close()
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for id, c := range a.hmem {
		if err := c.Close(); err != nil {
			a.log.Warn("freeing chunk", "chunk", id, "err", err)
		}
		delete(a.hmem, id)
	}
}

// journal is the server's journal: the books, when there is a keeper.
func (a *agent) journal() server.Journal {
	if a.restart == nil {
		return nil
	}
	return a.restart.books
}
