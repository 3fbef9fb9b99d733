package sizing

import (
	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/hostmem"
)

// Specs turns the plan into chunk allocations for hostmem.AllocateAll, in
// GPU order: each chunk named by contract.ChunkID, bound to its GPU's NUMA node
// when known, pre-faulted by workers goroutines and locked. Under the
// "prefer" huge page policy a chunk falls back to ordinary pages if its
// huge pages are gone by the time it is allocated.
func (p *Plan) Specs(hugePages string, workers int) []hostmem.Spec {
	var specs []hostmem.Spec
	for _, g := range p.GPUs {
		for _, id := range g.ChunkIDs() {
			specs = append(specs, hostmem.Spec{ID: id, Options: hostmem.Options{
				Size:         p.ChunkBytes,
				Name:         "kvpool-" + id,
				PageSize:     g.PageSize,
				HugeFallback: hugePages != config.HugePagesRequire,
				Bind:         g.NUMA >= 0,
				Node:         max(g.NUMA, 0),
				Prefault:     true,
				Workers:      workers,
				Lock:         true,
			}})
		}
	}
	return specs
}
