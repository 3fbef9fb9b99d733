package sizing

import (
	"testing"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/node"
)

// FuzzMake: for any valid policy and node, a plan that succeeds keeps every
// promise (checkBounds), and one that fails says why.
func FuzzMake(f *testing.F) {
	f.Add(uint16(64), uint16(100), uint16(8), uint16(0), uint16(0), uint16(0), uint8(1), uint8(2), false, uint8(50), uint16(0), uint16(0), uint16(0))
	f.Add(uint16(0), uint16(1900), uint16(8), uint16(40), uint16(30), uint16(10), uint8(2), uint8(8), true, uint8(25), uint16(4), uint16(64), uint16(4096))
	f.Fuzz(func(t *testing.T, poolGi, availGi, reserveGi, cgroupGi, allocGi, maxGi uint16, chunkGi, ngpu uint8, memSplit bool, pct uint8, minGi, huge1G, huge2M uint16) {
		s := config.Default().Sizing
		s.HugePages = config.HugePagesNever
		if huge1G > 0 || huge2M > 0 {
			s.HugePages = config.HugePagesPrefer
		}
		s.PoolBytes = config.Bytes(poolGi) * config.GiB
		s.ReserveBytes = config.Bytes(reserveGi) * config.GiB
		s.MaxPerGPU = config.Bytes(maxGi) * config.GiB
		s.MinPerGPU = config.Bytes(minGi) * config.GiB
		s.ChunkBytes = config.Bytes(chunkGi%8+1) * config.GiB
		s.Fraction = float64(pct%100+1) / 100
		if memSplit {
			s.Split = config.SplitMemory
		}
		c := config.Default()
		c.Sizing = s
		if c.Validate() != nil {
			return
		}
		n := &node.Info{MemAvailable: int64(availGi) * gib, Cgroup: node.Cgroup{Limit: node.Unlimited}}
		// Huge pages: node 0 has the 1Gi ones, node 1 the 2Mi ones.
		n.NUMANodes = []node.NUMANode{
			{ID: 0, HugePages: []node.HugePool{{PageSize: gib, Total: int64(huge1G), Free: int64(huge1G)}}},
			{ID: 1, HugePages: []node.HugePool{{PageSize: 2 * mib, Total: int64(huge2M), Free: int64(huge2M)}}},
		}
		n.HugePages = []node.HugePool{{PageSize: 2 * mib, Total: int64(huge2M), Free: int64(huge2M)}, {PageSize: gib, Total: int64(huge1G), Free: int64(huge1G)}}
		if cgroupGi > 0 {
			n.Cgroup.Limit = int64(cgroupGi) * gib
		}
		in := Input{Node: n, Allocatable: int64(allocGi) * gib, PageSize: 4096}
		for i := 0; i < int(ngpu%16)+1; i++ {
			in.GPUs = append(in.GPUs, GPU{Index: i, NUMA: i % 2, Memory: int64(i%3+1) * 40 * gib})
		}
		p, err := Make(s, in)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("empty error")
			}
			return
		}
		checkBounds(t, s, in, p)
		if len(p.GPUs) != len(in.GPUs) {
			t.Fatalf("%d GPU plans for %d GPUs", len(p.GPUs), len(in.GPUs))
		}
	})
}
