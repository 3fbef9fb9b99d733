package sizing

import (
	"runtime"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/internal/node"
	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/cpulist"
)

// Workers says how many threads pre-fault each chunk of NUMA node numa
// (-1: unknown) and which CPUs they run on (nil: any).
type Workers func(numa int) (n int, cpus []int)

// maxWorkers bounds the threads pre-faulting one chunk: more than this
// contend in the kernel for the chunk's page cache rather than add speed.
const maxWorkers = 8

// NodeWorkers is the agent's Workers: half the CPUs of the chunk's NUMA
// node (the other half left to kubelet and the pods starting beside the
// agent), 1 to 8, bound to that node's CPUs; for an unknown node (or one
// whose CPU list is unreadable), half the CPUs the process may run on,
// unbound.
func NodeWorkers(info *node.Info) Workers {
	return func(numa int) (int, []int) {
		if info != nil && numa >= 0 {
			for _, n := range info.NUMANodes {
				if cpus, err := cpulist.Parse(n.CPUs); n.ID == numa && err == nil && len(cpus) > 0 {
					return max(1, min(len(cpus)/2, maxWorkers)), cpus
				}
			}
		}
		return max(1, min(runtime.NumCPU()/2, maxWorkers)), nil
	}
}

// namePrefix begins each chunk's memfd name, its ID after it.
const namePrefix = "kvpool-"

// Specs turns the plan into chunk allocations for hostmem.AllocateAll:
// each chunk named by contract.ChunkID, bound to its GPU's NUMA node when
// known, pre-faulted by workers' threads and locked. The order takes the
// GPUs in turn (chunk 0 of every GPU, then chunk 1, ...), so that every
// GPU has a chunk to serve early while the rest pin; AllocateAll pins each
// NUMA node's chunks in this order, the nodes side by side. Under the
// "prefer" huge page policy a chunk falls back to ordinary pages if its
// huge pages are gone by the time it is allocated.
func (p *Plan) Specs(hugePages string, workers Workers) []hostmem.Spec {
	names := make([][]string, len(p.GPUs)) // "kvpool-" and each chunk's ID: one string, the ID its tail
	type lane struct {
		n    int
		cpus []int
	}
	lanes := make([]lane, len(p.GPUs)) // each GPU's workers, asked once (not a chunk)
	most, total := 0, 0
	for i, g := range p.GPUs {
		names[i] = chunkIDs(g, namePrefix)
		most, total = max(most, g.Chunks), total+g.Chunks
		lanes[i].n, lanes[i].cpus = workers(g.NUMA)
	}
	specs := make([]hostmem.Spec, 0, total)
	for k := range most {
		for i, g := range p.GPUs {
			if k >= len(names[i]) {
				continue
			}
			n, cpus := lanes[i].n, lanes[i].cpus
			name := names[i][k]
			specs = append(specs, hostmem.Spec{ID: name[len(namePrefix):], GPU: g.GPU, Options: hostmem.Options{
				Size:         p.ChunkBytes,
				Name:         name,
				PageSize:     g.PageSize,
				HugeFallback: hugePages != config.HugePagesRequire,
				Bind:         g.NUMA >= 0,
				Node:         max(g.NUMA, 0),
				Prefault:     true,
				Workers:      n,
				CPUs:         cpus,
				Lock:         true,
			}})
		}
	}
	return specs
}

// chunkIDs is prefix and the ID of each of g's chunks, the strings cut
// from one (a node's thousands of chunks are two allocations a GPU, not
// one a chunk).
func chunkIDs(g GPUPlan, prefix string) []string {
	b := make([]byte, 0, g.Chunks*(len(prefix)+24))
	ends := make([]int, g.Chunks)
	for k := range ends {
		b = contract.AppendChunkID(append(b, prefix...), g.GPU, g.NUMA, k)
		ends[k] = len(b)
	}
	all := string(b)
	ids := make([]string, g.Chunks)
	from := 0
	for k, end := range ends {
		ids[k], from = all[from:end], end
	}
	return ids
}
