package sizing

// BoundKept names a GPU's pool held at the chunks a restart adopts
// (Plan.KeepAtLeast).
const BoundKept = "the pool kept across the restart"

// KeepAtLeast raises each GPU's pool to at least kept[GPU index] chunks
// and says whether it raised any: a restart under the sizing policy the
// kept pool was planned with adopts what the keeper holds rather than drop
// it because the node has less free memory now (its sessions and streams
// would go with it, and the memory is held already). A raised GPU's bound,
// and the plan's, read BoundKept.
func (p *Plan) KeepAtLeast(kept map[int]int) bool {
	raised := false
	for i := range p.GPUs {
		g := &p.GPUs[i]
		n := kept[g.GPU]
		if n <= g.Chunks {
			continue
		}
		p.Total += int64(n-g.Chunks) * p.ChunkBytes
		g.Chunks, g.Bytes, g.Bound = n, int64(n)*p.ChunkBytes, BoundKept
		raised = true
	}
	if raised {
		p.Bound = BoundKept
	}
	return raised
}
