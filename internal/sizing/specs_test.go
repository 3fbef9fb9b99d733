package sizing

import (
	"runtime"
	"slices"
	"testing"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/node"
	"github.com/kvpool/kvpool/pkg/contract"
)

func TestNodeWorkers(t *testing.T) {
	info := &node.Info{NUMANodes: []node.NUMANode{
		{ID: 0, CPUs: "0-31"}, {ID: 1, CPUs: "32-35"}, {ID: 2, CPUs: "7"}, {ID: 3, CPUs: "x-1"}, {ID: 4, CPUs: ""},
	}}
	def := max(1, min(runtime.NumCPU()/2, 8))
	w := NodeWorkers(info)
	for _, tc := range []struct {
		numa, n int
		cpus    []int
	}{
		{numa: 0, n: 8, cpus: seq(0, 31)}, // half of 32, bounded by 8
		{numa: 1, n: 2, cpus: seq(32, 35)},
		{numa: 2, n: 1, cpus: []int{7}},
		{numa: 3, n: def}, // unreadable CPU list: unbound
		{numa: 4, n: def}, // a node without CPUs: unbound
		{numa: 9, n: def}, // not on this node
		{numa: -1, n: def},
	} {
		n, cpus := w(tc.numa)
		if n != tc.n || !slices.Equal(cpus, tc.cpus) {
			t.Errorf("node %d: %d workers on %v, want %d on %v", tc.numa, n, cpus, tc.n, tc.cpus)
		}
	}
	if n, cpus := NodeWorkers(nil)(0); n != def || cpus != nil {
		t.Errorf("no node info: %d workers on %v", n, cpus)
	}
}

func seq(lo, hi int) []int {
	var s []int
	for i := lo; i <= hi; i++ {
		s = append(s, i)
	}
	return s
}

// TestSpecsNameEachChunk: every spec of a plan carries its GPU, the chunk
// ID contract.ChunkID gives (an unknown NUMA node, large indexes), and
// that ID in its memfd's name; ChunkIDs lists the same IDs.
func TestSpecsNameEachChunk(t *testing.T) {
	p := &Plan{ChunkBytes: 1 << 20, GPUs: []GPUPlan{
		{GPU: 0, NUMA: 1, Chunks: 3, PageSize: 4096},
		{GPU: 7, NUMA: -1, Chunks: 12, PageSize: 2 << 20},
		{GPU: 12, NUMA: 0, Chunks: 0},
	}}
	specs := p.Specs(config.HugePagesPrefer, func(int) (int, []int) { return 1, nil })
	if len(specs) != 15 {
		t.Fatalf("%d specs, want 15", len(specs))
	}
	seen := map[string]bool{}
	for _, s := range specs {
		gpu, numa, index, err := contract.ParseChunkID(s.ID)
		if err != nil {
			t.Fatal(err)
		}
		g := p.GPUs[slices.IndexFunc(p.GPUs, func(g GPUPlan) bool { return g.GPU == gpu })]
		if s.GPU != gpu || numa != g.NUMA || index >= g.Chunks || s.ID != contract.ChunkID(gpu, numa, index) || seen[s.ID] {
			t.Fatalf("spec %+v: GPU %d, NUMA %d, index %d (the plan: GPU %d on NUMA %d, %d chunks)", s, gpu, numa, index, g.GPU, g.NUMA, g.Chunks)
		}
		seen[s.ID] = true
		if s.Name != "kvpool-"+s.ID || s.PageSize != g.PageSize || s.Size != p.ChunkBytes {
			t.Fatalf("spec %s: name %q, page size %d, size %d", s.ID, s.Name, s.PageSize, s.Size)
		}
	}
	for _, g := range p.GPUs {
		ids := g.ChunkIDs()
		if len(ids) != g.Chunks {
			t.Fatalf("GPU %d: %d IDs, want %d", g.GPU, len(ids), g.Chunks)
		}
		for i, id := range ids {
			if want := contract.ChunkID(g.GPU, g.NUMA, i); id != want {
				t.Fatalf("GPU %d chunk %d: ID %q, want %q", g.GPU, i, id, want)
			}
		}
	}
}
