package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"
	"time"

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

// gpus finds the GPUs: simulated in standalone mode or with
// --simulate-gpus, else through NVML.
func (a *agent) gpus(info *node.Info) ([]gpu.Device, string, error) {
	var numa []int
	for _, n := range info.NUMANodes {
		numa = append(numa, n.ID)
	}
	if a.opts.Standalone {
		return gpu.Simulated(a.cfg.Standalone.GPUs, SimulatedGPUMemory, numa), "simulated (standalone)", nil
	}
	if n := a.opts.SimulateGPUs; n > 0 {
		return gpu.Simulated(n, SimulatedGPUMemory, numa), "simulated (--simulate-gpus)", nil
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

// makePlan sizes the pool and turns it into chunk specs.
func (a *agent) makePlan(info *node.Info, devs []gpu.Device, allocatable int64) error {
	policy := a.cfg.Sizing
	o := a.opts
	if o.Standalone && o.ChunksPerGPU > 0 && o.ChunkBytes > 0 {
		// A fixed layout (embedded agents: pkg/standalone.Start).
		cb, n := o.ChunkBytes, o.ChunksPerGPU
		a.plan = &sizing.Plan{ChunkBytes: cb, Bound: "fixed layout", Limits: []sizing.Limit{}}
		for _, d := range devs {
			a.plan.GPUs = append(a.plan.GPUs, sizing.GPUPlan{GPU: d.Index, UUID: d.UUID, NUMA: d.NUMA,
				Bytes: cb * int64(n), Chunks: n, PageSize: int64(os.Getpagesize()), Bound: "fixed layout"})
			a.plan.Total += cb * int64(n)
		}
		policy.HugePages = config.HugePagesNever
	} else {
		in := sizing.Input{Node: info, Allocatable: allocatable}
		for _, d := range devs {
			in.GPUs = append(in.GPUs, sizing.GPU{Index: d.Index, UUID: d.UUID, NUMA: d.NUMA, Memory: d.Memory})
		}
		if o.Standalone {
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
	if o.Standalone || o.SimulateGPUs > 0 {
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
			observe.Report(a.obs.Observer, observe.ComponentAllocation, observe.OpPin, fmt.Errorf("chunk %s: %w", r.ID, r.Err))
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
			observe.Report(a.obs.Observer, "keeper", "keep", fmt.Errorf("chunk %s: %w", r.ID, err))
			a.log.Error("pool allocation stopped: the keeper does not take the chunk", "chunk", r.ID, "err", err)
			break
		}
		a.mu.Lock()
		a.hmem[r.ID] = c
		a.mu.Unlock()
		if err := a.pool.AddChunk(pc); err != nil {
			a.log.Error("adding chunk to the pool", "chunk", r.ID, "err", err)
			observe.Report(a.obs.Observer, "pool", "add_chunk", err)
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
