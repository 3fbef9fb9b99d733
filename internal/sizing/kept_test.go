package sizing

import "testing"

func TestKeepAtLeast(t *testing.T) {
	plan := func() *Plan {
		return &Plan{ChunkBytes: 2, Total: 12, Bound: BoundFraction, GPUs: []GPUPlan{
			{GPU: 0, Chunks: 3, Bytes: 6, Bound: BoundFraction},
			{GPU: 1, Chunks: 3, Bytes: 6, Bound: BoundFraction},
		}}
	}
	for _, c := range []struct {
		name   string
		kept   map[int]int
		raised bool
		chunks [2]int
	}{
		{"nothing kept", nil, false, [2]int{3, 3}},
		{"fewer kept than planned", map[int]int{0: 2, 1: 3}, false, [2]int{3, 3}},
		{"more kept on one GPU", map[int]int{0: 5}, true, [2]int{5, 3}},
		{"more kept on both", map[int]int{0: 4, 1: 6}, true, [2]int{4, 6}},
		{"a GPU the plan does not have", map[int]int{7: 9}, false, [2]int{3, 3}},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := plan()
			if got := p.KeepAtLeast(c.kept); got != c.raised {
				t.Errorf("raised = %v, want %v", got, c.raised)
			}
			var total int64
			for i, g := range p.GPUs {
				if g.Chunks != c.chunks[i] || g.Bytes != int64(g.Chunks)*p.ChunkBytes {
					t.Errorf("GPU %d: %d chunks, %d bytes; want %d chunks", g.GPU, g.Chunks, g.Bytes, c.chunks[i])
				}
				if raised := g.Chunks > 3; raised != (g.Bound == BoundKept) {
					t.Errorf("GPU %d: bound %q with %d chunks", g.GPU, g.Bound, g.Chunks)
				}
				total += g.Bytes
			}
			if p.Total != total {
				t.Errorf("total %d, the GPUs hold %d", p.Total, total)
			}
			if (p.Bound == BoundKept) != c.raised {
				t.Errorf("plan bound %q, raised %v", p.Bound, c.raised)
			}
		})
	}
}
