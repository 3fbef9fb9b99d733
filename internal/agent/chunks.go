package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/internal/bytesize"
	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/gpu"
	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/internal/node"
	"github.com/kvpool/kvpool/internal/sizing"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/plugin"
	"github.com/kvpool/kvpool/pkg/pool"
)

// SimulatedGPUMemory is the device memory of a simulated GPU (an H100's).
const SimulatedGPUMemory = 80 << 30

// gpusStep is the step "gpus": simulated GPUs in standalone mode
// (standalone.gpus), else those of gpus.
func (a *agent) gpusStep(m mode) step {
	find := a.gpus
	if m.standalone {
		find = func(info *node.Info) ([]gpu.Device, string, error) {
			devs := gpu.Simulated(a.cfg.Standalone.GPUs, SimulatedGPUMemory, numaIDs(info))
			if u := a.opts.GPUUUIDs; len(u) > 0 {
				if len(u) != len(devs) {
					return nil, "", fmt.Errorf("%d GPU UUIDs for %d standalone GPUs", len(u), len(devs))
				}
				for i := range devs {
					devs[i].UUID = u[i]
				}
				return devs, "simulated (standalone), named by the caller", nil
			}
			return devs, "simulated (standalone)", nil
		}
	}
	return step{name: "gpus", start: func(context.Context) error {
		devs, source, err := find(a.info)
		a.devs, a.gpuSource = devs, source
		return err
	}}
}

func numaIDs(info *node.Info) []int {
	var numa []int
	for _, n := range info.NUMANodes {
		numa = append(numa, n.ID)
	}
	return numa
}

// gpus finds a cluster node's GPUs: simulated with --simulate-gpus, else
// through NVML.
func (a *agent) gpus(info *node.Info) ([]gpu.Device, string, error) {
	if n := a.opts.SimulateGPUs; n > 0 {
		return gpu.Simulated(n, SimulatedGPUMemory, numaIDs(info)), "simulated (--simulate-gpus)", nil
	}
	devs, err := gpu.Discover(a.opts.NVML(), a.opts.Root)
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

// planner makes the pool's plan for the GPUs found, and names the huge
// page policy its chunks follow.
type planner func() (*sizing.Plan, string, error)

// planStep is the step "plan" ("fixed-plan" for a fixed layout): the
// pool's plan, logged, turned into chunk specs. Its stop frees every chunk
// the agent holds, whichever step allocated or adopted it.
func (a *agent) planStep(m mode) step {
	name, plan := "plan", a.sizedPlan(m.standalone)
	if m.fixed {
		name, plan = "fixed-plan", a.fixedPlan
	}
	// Simulated GPUs copy with the CPU: pinning gains nothing, so a memlock
	// limit only warns.
	lockFallback := m.standalone || a.opts.SimulateGPUs > 0
	// A huge page fallback is also a Node event where huge pages were
	// asked for (a cluster's "prefer"; standalone's own policy).
	hugeEvents := m.standalone || a.cfg.Sizing.HugePages == config.HugePagesPrefer
	return step{name: name, stop: a.freeChunks, start: func(context.Context) error {
		p, hugePages, err := plan()
		if err != nil {
			return err
		}
		var lim unix.Rlimit
		if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err == nil {
			warning, err := checkOpenFiles(p, a.cfg.Limits.MaxConns, lim.Cur)
			if err != nil {
				return err
			}
			if warning != "" {
				a.log.Warn(warning)
			}
		}
		a.plan = p
		a.specs = p.Specs(hugePages, sizing.NodeWorkers(a.info))
		if lockFallback {
			for i := range a.specs {
				a.specs[i].LockFallback = true
			}
		}
		a.logPlan(a.gpuSource)
		for _, w := range p.Warnings {
			if hugeEvents && strings.Contains(w, "huge pages") {
				a.events.HugePagesFallback(w)
			}
		}
		return nil
	}}
}

// fileHeadroom is the files the agent opens beside its chunks and its
// tenants' connections: the books, the keeper's and the spare's sockets,
// the listeners, the metrics and health servers' connections, kubelet's
// gRPC.
const fileHeadroom = 256

// connFiles is how many descriptors a tenant connection holds in the
// agent: its socket, and the two pipe ends of its lane once its session
// is open (docs/protocol.md).
const connFiles = 3

// checkOpenFiles weighs a plan against limit, the process's RLIMIT_NOFILE:
// a plan whose chunks (a memfd each) need more files than that is refused
// (found at the plan, not as a fill that stops at "too many open files"
// part of the way), and one that leaves less than maxConns tenant
// connections (connFiles each) room is warned of, as the connections past
// the limit would be refused.
func checkOpenFiles(p *sizing.Plan, maxConns int, limit uint64) (warning string, err error) {
	chunks := 0
	for _, g := range p.GPUs {
		chunks += g.Chunks
	}
	need := uint64(chunks) + fileHeadroom
	switch {
	case limit == unix.RLIM_INFINITY:
	case need > limit:
		return "", fmt.Errorf("the plan's %d chunks need a memfd each, about %d open files, and this process may open %d (RLIMIT_NOFILE): "+
			"raise the container's limit on open files, or cut the pool into fewer, larger chunks", chunks, need, limit)
	case need+connFiles*uint64(max(maxConns, 0)) > limit:
		return fmt.Sprintf("the plan's %d chunks and limits.maxConns %d connections (%d descriptors each: the socket and a lane's two pipe ends) need about %d open files, and this process may open %d (RLIMIT_NOFILE): "+
			"connections past the limit will be refused; raise the container's limit on open files", chunks, maxConns, connFiles, need+connFiles*uint64(maxConns), limit), nil
	}
	return "", nil
}

// sizedPlan sizes the pool over the node (the configured sizing; in
// standalone mode sizing.Standalone, a small pool).
func (a *agent) sizedPlan(standalone bool) planner {
	return func() (*sizing.Plan, string, error) {
		policy := a.cfg.Sizing
		if standalone {
			policy = sizing.Standalone(a.cfg, len(a.devs))
		}
		info := a.info
		if kept := a.keptMemory(); len(kept) > 0 {
			// The kept chunks are resident and locked: out of MemAvailable
			// (or the free huge pages) and yet the pool's own. Planned
			// without them, a restart would plan a smaller pool and drop
			// what it is about to adopt.
			info = info.WithKept(kept)
			a.log.Info("planning with the memory the keeper holds for the pool counted as available",
				"chunks", len(kept), bytesize.Attr("kept", node.KeptBytes(kept)))
		}
		in := sizing.Input{Node: info, Allocatable: a.allocatable}
		for _, d := range a.devs {
			in.GPUs = append(in.GPUs, sizing.GPU{Index: d.Index, UUID: d.UUID, NUMA: d.NUMA, Memory: d.Memory})
		}
		p, err := sizing.Make(policy, in)
		kept := a.restart != nil && a.restart.held != nil
		if errors.Is(err, sizing.ErrTooManyChunks) && kept {
			// A pool an earlier agent planned before the bound: the
			// keeper holds it and its sessions; this agent goes on with it.
			a.log.Warn("the pool the keeper holds has more chunks than a new plan may cut; keeping it", "err", err)
			err = nil
		}
		if err != nil {
			return nil, "", fmt.Errorf("sizing the pool: %w", err)
		}
		if kept {
			a.keepKeptPool(p, policy)
		}
		a.policy = &policy
		return p, policy.HugePages, nil
	}
}

// fixedPlan is a fixed layout (embedded agents: pkg/standalone.Start):
// ChunksPerGPU chunks of ChunkBytes per GPU, 4 KiB pages.
func (a *agent) fixedPlan() (*sizing.Plan, string, error) {
	cb, n := a.opts.ChunkBytes, a.opts.ChunksPerGPU
	p := &sizing.Plan{ChunkBytes: cb, Bound: "fixed layout", Limits: []sizing.Limit{}}
	for _, d := range a.devs {
		p.GPUs = append(p.GPUs, sizing.GPUPlan{GPU: d.Index, UUID: d.UUID, NUMA: d.NUMA,
			Bytes: cb * int64(n), Chunks: n, PageSize: int64(os.Getpagesize()), Bound: "fixed layout"})
		p.Total += cb * int64(n)
	}
	return p, config.HugePagesNever, sizing.CheckChunks(p, "the fixed layout's chunk size")
}

// freeChunks unmaps and closes every chunk the agent holds (with a keeper,
// the keeper still holds their memory for the next agent).
func (a *agent) freeChunks() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	var errs []error
	for id, c := range a.hmem {
		if err := c.Close(); err != nil {
			errs = append(errs, fmt.Errorf("freeing chunk %s: %w", id, err))
		}
		delete(a.hmem, id)
	}
	return errors.Join(errs...)
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
	a.install(id, c)
	a.obs.Metrics.ChunkRenewed(g, took)
	a.log.Info("chunk renewed", "chunk", id, "took", took.Round(time.Microsecond), bytesize.Attr("pageSize", int64(c.PageSize)), "node", c.Node, "locked", c.Locked)
	return nil
}

// install makes c the agent's chunk id, once the keeper holds it (keep),
// and only then queues its lock for the keeper (settleLocks): the lock
// loop drops an ID it finds no chunk for, and a chunk queued before it
// was the agent's stayed in the agent's mapping (a restart then waits for
// the kernel to unmap it).
func (a *agent) install(id string, c *hostmem.Chunk) {
	if beforeInstall != nil {
		beforeInstall(id)
	}
	a.mu.Lock()
	a.hmem[id] = c
	a.mu.Unlock()
	if r := a.restart; r != nil && r.locks.Load() && c.Locked {
		r.lockq.push(id)
	}
}

// beforeInstall, when set (tests), runs as install begins.
var beforeInstall func(id string)

// allocateNow is the step "allocate" (standalone tokens): every chunk
// allocated and granted before the socket appears.
func (a *agent) allocateNow(ctx context.Context) error {
	a.allocate(ctx)
	return ctx.Err()
}

// allocateBackground is the step "allocate-background": the chunks are
// allocated while the agent serves, each published as it is ready.
func (a *agent) allocateBackground(ctx context.Context, wg *sync.WaitGroup) error {
	wg.Go(func() { a.allocate(ctx) })
	return nil
}

// filling is one run of allocate: where each chunk goes and how far each
// GPU's pool is.
type filling struct {
	start        time.Time
	gpuOf        map[string]int   // chunk ID -> GPU
	wantPage     map[string]int64 // chunk ID -> planned page size
	left         map[int]int      // GPU -> chunks still to come
	first        map[int]bool     // GPU -> has a chunk of this run in the pool
	laneBytes    map[int]int64    // NUMA lane -> bytes pinned in this run
	fellBack     bool             // a huge page fallback was posted
	ready, total int
}

// allocate allocates the planned chunks one by one, adding each to the
// pool (and so to the device plugin's device list) as soon as it is ready.
func (a *agent) allocate(ctx context.Context) {
	f := &filling{start: time.Now(), left: map[int]int{}, first: map[int]bool{}, laneBytes: map[int]int64{}}
	for _, g := range a.plan.GPUs {
		f.left[g.GPU] = g.Chunks
	}
	var specs []hostmem.Spec
	for _, s := range a.specs {
		if a.restart != nil && a.restart.adopted[s.ID] {
			f.left[s.GPU]-- // adopted from the keeper: already in the pool
			continue
		}
		specs = append(specs, s)
	}
	// The tables of the chunks to allocate only: a restart that adopted
	// them all builds none.
	f.gpuOf, f.wantPage = make(map[string]int, len(specs)), make(map[string]int64, len(specs))
	for _, s := range specs {
		f.gpuOf[s.ID], f.wantPage[s.ID] = s.GPU, s.PageSize
	}
	f.ready, f.total = len(a.specs)-len(specs), len(a.specs)
	for r := range hostmem.AllocateAll(ctx, specs, a.log) {
		if !a.place(f, r) {
			break
		}
	}
	if ctx.Err() != nil {
		return
	}
	if f.ready == f.total {
		a.events.PoolReady(a.plan.Total, f.total, time.Since(f.start))
		a.log.Info("pool ready", "chunks", f.total, bytesize.Attr("bytes", a.plan.Total), "took", time.Since(f.start).Round(time.Millisecond))
	}
	a.grantStatic()
}

// place puts one allocated chunk in service: the keeper gets it, then the
// pool and the device plugin's device list. It returns false when the
// allocation must stop.
func (a *agent) place(f *filling, r hostmem.Result) bool {
	g := f.gpuOf[r.ID]
	if r.Err != nil {
		a.obs.Metrics.ChunkPinFailed(g, r.Err)
		observe.Report(a.obs.Observer, observe.ComponentAllocation, observe.OpPin, fmt.Errorf("chunk %s: %w", r.ID, r.Err))
		a.log.Error("pool allocation stopped; serving the chunks already ready", "chunk", r.ID, "ready", f.ready, "of", f.total, "err", r.Err)
		return false
	}
	now := time.Now()
	c := r.Chunk
	if w := f.wantPage[r.ID]; w > int64(os.Getpagesize()) && c.PageSize < w && !f.fellBack {
		f.fellBack = true
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
		observe.Report(a.obs.Observer, "keeper", "keep", fmt.Errorf("chunk %s: %w", r.ID, err))
		a.log.Error("pool allocation stopped: the keeper does not take the chunk", "chunk", r.ID, "err", err)
		return false
	}
	a.install(r.ID, c)
	if err := a.pool.AddChunk(pc); err != nil {
		a.log.Error("adding chunk to the pool", "chunk", r.ID, "err", err)
		observe.Report(a.obs.Observer, "pool", "add_chunk", err)
		return true
	}
	f.ready++
	if a.restart != nil {
		a.restart.fresh.Add(1)
	}
	f.laneBytes[r.Lane] += c.Size
	a.obs.Metrics.ChunkPinned(g, r.Took)
	a.obs.Metrics.PinRate(r.Lane, f.laneBytes[r.Lane], now.Sub(f.start))
	if !f.first[g] {
		f.first[g] = true
		a.obs.Metrics.FirstChunk(g, now.Sub(f.start))
	}
	if f.left[g]--; f.left[g] == 0 {
		a.obs.Metrics.PoolFilled(g, now.Sub(f.start))
	}
	if a.plug != nil {
		if err := a.plug.Feed.Set(plugin.PoolDevices(a.pool.Chunks())); err != nil {
			a.log.Error("device list", "err", err)
		}
		a.plug.Plugin.GrantPending()
	}
	return true
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
