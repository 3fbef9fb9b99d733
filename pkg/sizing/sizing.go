// Package sizing turns the node's capacity, its GPUs and the sizing policy
// into a plan: per GPU, how many chunks of what page size on which NUMA
// node, and which input bound the result. Planning allocates nothing.
package sizing

import (
	"errors"
	"fmt"
	"math/big"
	"os"
	"sort"
	"strings"

	"github.com/kvpool/kvpool/internal/bytesize"
	"github.com/kvpool/kvpool/pkg/config"
	"github.com/kvpool/kvpool/pkg/node"
)

// GPU is one GPU as the plan needs it.
type GPU struct {
	Index  int
	UUID   string
	NUMA   int   // -1 when unknown
	Memory int64 // device memory in bytes, for the memory split
}

// Input is everything the plan is made from besides the policy.
type Input struct {
	Node *node.Info
	// Allocatable is the Node object's allocatable memory in bytes; 0
	// when not running in a cluster.
	Allocatable int64
	GPUs        []GPU
	// PageSize is the base page size; 0 means os.Getpagesize().
	PageSize int64
}

// Names of the inputs that can bind the pool.
const (
	BoundPoolBytes   = "sizing.poolBytes"
	BoundFraction    = "sizing.fraction"
	BoundAvailable   = "MemAvailable - sizing.reserveBytes"
	BoundCgroup      = "cgroup limit - sizing.cgroupHeadroomBytes"
	BoundAllocatable = "node allocatable memory"
	BoundMaxPerGPU   = "sizing.maxPerGPU"
)

// Limit is one bound the plan considered.
type Limit struct {
	Name  string `json:"name"`
	Bytes int64  `json:"bytes"`
	How   string `json:"how"` // the arithmetic, e.g. "480Gi - 8Gi"
}

// Plan is the sizing decision.
type Plan struct {
	ChunkBytes int64     `json:"chunkBytes"`
	Total      int64     `json:"totalBytes"` // bytes over all GPUs, a whole number of chunks each
	Limits     []Limit   `json:"limits"`     // every bound considered; Limits[0] is the policy's target
	Bound      string    `json:"bound"`      // the Limit that set the pool before the per-GPU split
	GPUs       []GPUPlan `json:"gpus"`
	Warnings   []string  `json:"warnings"`
}

// GPUPlan is one GPU's pool.
type GPUPlan struct {
	GPU      int    `json:"gpu"`
	UUID     string `json:"uuid"`
	NUMA     int    `json:"numa"`
	Bytes    int64  `json:"bytes"`
	Chunks   int    `json:"chunks"`
	PageSize int64  `json:"pageSize"` // 4096, 2Mi or 1Gi
	Bound    string `json:"bound"`    // what limited this GPU's share
}

// ChunkID names chunk i of a GPU's pool: gpu<G>-numa<N>-<i>, with numaX
// when the NUMA node is unknown.
func ChunkID(gpu, numa, i int) string {
	if numa < 0 {
		return fmt.Sprintf("gpu%d-numaX-%d", gpu, i)
	}
	return fmt.Sprintf("gpu%d-numa%d-%d", gpu, numa, i)
}

// ChunkIDs lists the GPU's chunk IDs in order.
func (g GPUPlan) ChunkIDs() []string {
	ids := make([]string, g.Chunks)
	for i := range ids {
		ids[i] = ChunkID(g.GPU, g.NUMA, i)
	}
	return ids
}

// hugeSizes are the huge page sizes tried, largest first.
var hugeSizes = []int64{1 << 30, 2 << 20}

// Make plans the pool. The sizing policy must be valid (config.Validate).
// The total never exceeds MemAvailable less ReserveBytes, the cgroup limit
// less CgroupHeadroomBytes, or the Node's allocatable memory. It fails,
// naming the bound, when a GPU would get less than one chunk or less than
// MinPerGPU, or when huge pages are required and too few are free; the
// plan returned with such an error holds the limits and bound found so far,
// for display.
func Make(s config.Sizing, in Input) (*Plan, error) {
	if in.Node == nil {
		return nil, errors.New("sizing: no node information")
	}
	if len(in.GPUs) == 0 {
		return nil, errors.New("sizing: no GPUs to size a pool for")
	}
	seen := map[int]bool{}
	for _, g := range in.GPUs {
		if seen[g.Index] || g.Index < 0 {
			return nil, fmt.Errorf("sizing: GPU index %d is negative or listed twice", g.Index)
		}
		seen[g.Index] = true
		if s.Split == config.SplitMemory && g.Memory <= 0 {
			return nil, fmt.Errorf("sizing: sizing.split is %q but GPU %d reports no device memory", s.Split, g.Index)
		}
	}
	chunk := int64(s.ChunkBytes)
	if chunk <= 0 {
		return nil, errors.New("sizing: sizing.chunkBytes must be positive")
	}
	base := in.PageSize
	if base == 0 {
		base = int64(os.Getpagesize())
	}
	p := &Plan{ChunkBytes: chunk}

	// Hard bounds. Reserved huge pages are neither in MemAvailable nor
	// charged to the memory cgroup or counted in allocatable memory, so
	// where the policy may use them, the free ones widen every bound; the
	// ordinary pages planned must still fit the bounds without them.
	n := in.Node
	var hugeBytes int64
	if s.HugePages != config.HugePagesNever {
		for _, hs := range hugeSizes {
			if chunk%hs == 0 {
				hugeBytes += n.HugeFree(-1, hs) * hs
			}
		}
	}
	plus := ""
	if hugeBytes > 0 {
		plus = " + " + bytesize.Approx(hugeBytes) + " free huge pages"
	}
	hard := []Limit{{BoundAvailable, n.MemAvailable - int64(s.ReserveBytes),
		fmt.Sprintf("%s - %s", bytesize.Approx(n.MemAvailable), bytesize.Approx(int64(s.ReserveBytes)))}}
	if n.Cgroup.Limit != node.Unlimited {
		hard = append(hard, Limit{BoundCgroup, n.Cgroup.Limit - int64(s.CgroupHeadroomBytes),
			fmt.Sprintf("%s - %s", bytesize.Approx(n.Cgroup.Limit), bytesize.Approx(int64(s.CgroupHeadroomBytes)))})
	}
	if in.Allocatable > 0 {
		hard = append(hard, Limit{BoundAllocatable, in.Allocatable, bytesize.Approx(in.Allocatable)})
	}
	// regular is the budget for ordinary pages: the tightest bound alone.
	regular := hard[0]
	for _, l := range hard[1:] {
		if l.Bytes < regular.Bytes {
			regular = l
		}
	}
	regularLeft := regular.Bytes
	for i := range hard {
		hard[i].Bytes += hugeBytes
		hard[i].How += plus
	}
	usable := hard[0]
	for _, l := range hard[1:] {
		if l.Bytes < usable.Bytes {
			usable = l
		}
	}
	// The policy's target.
	var target Limit
	if s.PoolBytes > 0 {
		target = Limit{BoundPoolBytes, int64(s.PoolBytes), bytesize.Approx(int64(s.PoolBytes))}
	} else {
		v := max(usable.Bytes, 0)
		f := new(big.Float).Mul(big.NewFloat(s.Fraction), new(big.Float).SetInt64(v))
		t, _ := f.Int64()
		target = Limit{BoundFraction, t, fmt.Sprintf("%g x %s (%s)", s.Fraction, bytesize.Approx(v), usable.Name)}
	}
	p.Limits = append([]Limit{target}, hard...)
	bound := target
	for _, l := range hard {
		if l.Bytes < bound.Bytes {
			bound = l
		}
	}
	p.Bound = bound.Name
	if bound.Bytes < chunk {
		return p, fmt.Errorf("sizing: no room for even one chunk (%s): %s is %s = %s", bytesize.Approx(chunk), bound.Name, bound.How, bytesize.Approx(bound.Bytes))
	}

	// Split between GPUs.
	gpus := append([]GPU(nil), in.GPUs...)
	sort.Slice(gpus, func(i, j int) bool { return gpus[i].Index < gpus[j].Index })
	var memSum big.Int
	for _, g := range gpus {
		memSum.Add(&memSum, big.NewInt(g.Memory))
	}
	left := map[[2]int64]int64{} // (numa, page size) -> free huge pages not yet planned
	for _, g := range gpus {
		share := bound.Bytes / int64(len(gpus))
		how := fmt.Sprintf("%s / %d GPUs", bytesize.Approx(bound.Bytes), len(gpus))
		if s.Split == config.SplitMemory {
			var x big.Int
			x.Mul(big.NewInt(bound.Bytes), big.NewInt(g.Memory))
			x.Quo(&x, &memSum)
			share = x.Int64()
			how = fmt.Sprintf("%s x %s / %s of GPU memory", bytesize.Approx(bound.Bytes), bytesize.Approx(g.Memory), bytesize.Approx(memSum.Int64()))
		}
		gp := GPUPlan{GPU: g.Index, UUID: g.UUID, NUMA: g.NUMA, Bound: bound.Name}
		if s.MaxPerGPU > 0 && share > int64(s.MaxPerGPU) {
			share, gp.Bound, how = int64(s.MaxPerGPU), BoundMaxPerGPU, bytesize.Approx(int64(s.MaxPerGPU))
		}
		gp.Chunks = int(share / chunk)
		gp.Bytes = int64(gp.Chunks) * chunk
		if gp.Chunks == 0 {
			return p, fmt.Errorf("sizing: GPU %d would get %s, less than one chunk (sizing.chunkBytes %s); bound by %s (%s)",
				g.Index, bytesize.Approx(share), bytesize.Approx(chunk), gp.Bound, how)
		}
		if gp.Bytes < int64(s.MinPerGPU) {
			return p, fmt.Errorf("sizing: GPU %d would get %s, less than sizing.minPerGPU %s; bound by %s (%s)",
				g.Index, bytesize.Approx(gp.Bytes), bytesize.Approx(int64(s.MinPerGPU)), gp.Bound, how)
		}
		ps, warn, err := pageSize(s.HugePages, n, g, gp, chunk, base, left)
		if err != nil {
			return p, err
		}
		if warn != "" {
			p.Warnings = append(p.Warnings, warn)
		}
		gp.PageSize = ps
		if ps == base {
			// Ordinary pages: within the bounds without huge pages.
			if gp.Bytes > regularLeft {
				gp.Chunks = int(max(regularLeft, 0) / chunk)
				gp.Bytes = int64(gp.Chunks) * chunk
				gp.Bound = regular.Name
				how := fmt.Sprintf("%s is %s, %s of it left for 4 KiB pages", regular.Name, regular.How, bytesize.Approx(max(regularLeft, 0)))
				if gp.Chunks == 0 {
					return p, fmt.Errorf("sizing: GPU %d has no huge pages and no room for one chunk of ordinary pages: %s", g.Index, how)
				}
				if gp.Bytes < int64(s.MinPerGPU) {
					return p, fmt.Errorf("sizing: GPU %d would get %s of ordinary pages, less than sizing.minPerGPU %s: %s",
						g.Index, bytesize.Approx(gp.Bytes), bytesize.Approx(int64(s.MinPerGPU)), how)
				}
			}
			regularLeft -= gp.Bytes
		}
		p.Total += gp.Bytes
		p.GPUs = append(p.GPUs, gp)
	}
	return p, nil
}

// pageSize picks the largest huge page size that divides the chunk and of
// which the GPU's NUMA node has enough free pages for the whole GPU pool,
// under the policy; left tracks pages already planned for other GPUs.
func pageSize(policy string, n *node.Info, g GPU, gp GPUPlan, chunk, base int64, left map[[2]int64]int64) (int64, string, error) {
	if policy == config.HugePagesNever {
		return base, "", nil
	}
	where := fmt.Sprintf("NUMA node %d", g.NUMA)
	if g.NUMA < 0 {
		where = "the node (NUMA unknown)"
	}
	var tried []string
	for _, hs := range hugeSizes {
		if chunk%hs != 0 {
			continue
		}
		key := [2]int64{int64(g.NUMA), hs}
		free, ok := left[key]
		if !ok {
			free = n.HugeFree(g.NUMA, hs)
		}
		need := gp.Bytes / hs
		if free >= need {
			left[key] = free - need
			return hs, "", nil
		}
		tried = append(tried, fmt.Sprintf("%d free %s pages of %d needed", free, bytesize.Approx(hs), need))
	}
	msg := fmt.Sprintf("GPU %d: not enough huge pages on %s for %s (%s)", g.Index, where, bytesize.Approx(gp.Bytes), strings.Join(tried, ", "))
	if policy == config.HugePagesRequire {
		return 0, "", fmt.Errorf("sizing: %s, and sizing.hugePages is %q", msg, policy)
	}
	return base, msg + fmt.Sprintf("; using %s pages", bytesize.Approx(base)), nil
}

// Standalone returns the sizing policy used in --standalone mode: the pool
// is c.Standalone.PoolBytes, and the chunk shrinks (to a multiple of 2Mi)
// so that each of gpus GPUs gets at least four chunks.
func Standalone(c *config.Config, gpus int) config.Sizing {
	s := c.Sizing
	s.PoolBytes = c.Standalone.PoolBytes
	if gpus > 0 {
		if most := (s.PoolBytes / config.Bytes(4*gpus)) &^ (2*config.MiB - 1); s.ChunkBytes > most {
			s.ChunkBytes = max(most, 2*config.MiB)
		}
	}
	s.MinPerGPU, s.MaxPerGPU = 0, 0
	return s
}
