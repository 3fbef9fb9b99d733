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
	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/node"
	"github.com/kvpool/kvpool/pkg/pool"
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
	BoundCgroup      = "cgroup limit - sizing.cgroupHeadroomBytes - page tables - page links"
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

// ChunkIDs lists the GPU's chunk IDs in order (contract.ChunkID).
func (g GPUPlan) ChunkIDs() []string { return chunkIDs(g, "") }

// hugeSizes are the huge page sizes tried, largest first.
var hugeSizes = []int64{1 << 30, 2 << 20}

// Make plans the pool. The sizing policy must be valid (config.Validate).
// The total never exceeds MemAvailable less ReserveBytes, the cgroup limit
// less CgroupHeadroomBytes, the page tables of the agent's mapping of the
// pool (PageTableBytes) and the sessions' page links (LinkBytes), or the
// Node's allocatable memory. It fails,
// naming the bound, when a GPU would get less than one chunk or less than
// MinPerGPU, or when huge pages are required and too few are free; the
// plan returned with such an error holds the limits and bound found so far,
// for display.
//
// The steps, each a function below: check the input; find the hard bounds
// (widened by the free huge pages the policy may use); the policy's target;
// the tightest of them bounds the pool; split it between the GPUs; cut each
// share into chunks; pick each GPU's page size; fit the GPUs left on
// ordinary pages into the bound that has no huge pages in it.
func Make(s config.Sizing, in Input) (*Plan, error) {
	if err := checkInput(s, in); err != nil {
		return nil, err
	}
	chunk := int64(s.ChunkBytes)
	base := in.PageSize
	if base == 0 {
		base = int64(os.Getpagesize())
	}
	p := &Plan{ChunkBytes: chunk}

	hard, regular := hardBounds(s, in, hugeBudget(s, in.Node, chunk))
	target := policyTarget(s, tightest(hard))
	p.Limits = append([]Limit{target}, hard...)
	bound := tightest(p.Limits)
	p.Bound = bound.Name
	if bound.Bytes < chunk {
		return p, fmt.Errorf("sizing: no room for even one chunk (%s): %s is %s = %s", bytesize.Approx(chunk), bound.Name, bound.How, bytesize.Approx(bound.Bytes))
	}

	gpus := append([]GPU(nil), in.GPUs...)
	sort.Slice(gpus, func(i, j int) bool { return gpus[i].Index < gpus[j].Index })
	shares := splitShares(s, bound, gpus)
	regularLeft := regular.Bytes
	left := map[[2]int64]int64{} // (numa, page size) -> free huge pages not yet planned
	for i, g := range gpus {
		gp, err := cutChunks(s, g, shares[i], chunk)
		if err != nil {
			return p, err
		}
		ps, warn, err := pageSize(s.HugePages, in.Node, g, gp, chunk, base, left)
		if err != nil {
			return p, err
		}
		if warn != "" {
			p.Warnings = append(p.Warnings, warn)
		}
		gp.PageSize = ps
		if ps == base {
			if gp, err = fitOrdinary(s, gp, regular, regularLeft, chunk); err != nil {
				return p, err
			}
			regularLeft -= gp.Bytes
		}
		p.Total += gp.Bytes
		p.GPUs = append(p.GPUs, gp)
	}
	return p, CheckChunks(p, "sizing.chunkBytes")
}

// MaxChunks is the most chunks a plan cuts the pool into: 16 TiB at the
// default 1 GiB chunk. What holds an entry a chunk grows with them:
// kubelet's device list (a device a chunk, all in one ListAndWatch
// message), the memfds the agent and the keeper hold, the mappings of the
// keeper and of a client (against vm.max_map_count, 65,530 by default),
// and the restart's checks of the kept chunks.
const MaxChunks = 16384

// ErrTooManyChunks is CheckChunks' refusal, which Make returns with the
// whole plan.
var ErrTooManyChunks = errors.New("too many chunks")

// CheckChunks refuses a plan of more than MaxChunks chunks, naming the
// chunk size that would cut the same pool into few enough, and the setting
// that sets it (knob).
func CheckChunks(p *Plan, knob string) error {
	n := 0
	for _, g := range p.GPUs {
		n += g.Chunks
	}
	if n <= MaxChunks {
		return nil
	}
	const step = 2 << 20 // a chunk is a whole number of 2 MiB huge pages
	least := ceilDiv(ceilDiv(p.Total, MaxChunks), step) * step
	return fmt.Errorf("sizing: %w: %s in %d chunks of %s, more than the %d an agent serves (kubelet's device list, the chunks' memfds and their mappings grow with them): "+
		"set %s to %s or more", ErrTooManyChunks, bytesize.Approx(p.Total), n, bytesize.Approx(p.ChunkBytes), MaxChunks, knob, bytesize.Approx(least))
}

// checkInput refuses what no plan can be made from: no node, no GPUs, a GPU
// index negative or twice, a memory split without GPU memory, no chunk size.
func checkInput(s config.Sizing, in Input) error {
	if in.Node == nil {
		return errors.New("sizing: no node information")
	}
	if len(in.GPUs) == 0 {
		return errors.New("sizing: no GPUs to size a pool for")
	}
	seen := map[int]bool{}
	for _, g := range in.GPUs {
		if seen[g.Index] || g.Index < 0 {
			return fmt.Errorf("sizing: GPU index %d is negative or listed twice", g.Index)
		}
		seen[g.Index] = true
		if s.Split == config.SplitMemory && g.Memory <= 0 {
			return fmt.Errorf("sizing: sizing.split is %q but GPU %d reports no device memory", s.Split, g.Index)
		}
	}
	if s.ChunkBytes <= 0 {
		return errors.New("sizing: sizing.chunkBytes must be positive")
	}
	return nil
}

// hugeBudget is the bytes of free huge pages, of the sizes that divide the
// chunk, that the policy may use (none under hugePages: never).
func hugeBudget(s config.Sizing, n *node.Info, chunk int64) int64 {
	var b int64
	if s.HugePages == config.HugePagesNever {
		return 0
	}
	for _, hs := range hugeSizes {
		if chunk%hs == 0 {
			b += n.HugeFree(-1, hs) * hs
		}
	}
	return b
}

// hardBounds lists the node's bounds: MemAvailable less the reserve, the
// cgroup limit less its headroom (when there is one), the Node's
// allocatable memory (in a cluster). Reserved huge pages are neither in
// MemAvailable nor charged to the memory cgroup or counted in allocatable
// memory, so the free ones the policy may use (huge) widen every bound.
// regular is the tightest bound without them: the budget for ordinary
// pages.
func hardBounds(s config.Sizing, in Input, huge int64) (hard []Limit, regular Limit) {
	n := in.Node
	hard = []Limit{{BoundAvailable, n.MemAvailable - int64(s.ReserveBytes),
		fmt.Sprintf("%s - %s", bytesize.Approx(n.MemAvailable), bytesize.Approx(int64(s.ReserveBytes)))}}
	if n.Cgroup.Limit != node.Unlimited {
		room := n.Cgroup.Limit - int64(s.CgroupHeadroomBytes)
		x, pt, links := room, int64(0), int64(0)
		if room > 0 {
			x = fitCgroup(room, huge)
			pt, links = PageTableBytes(x), LinkBytes(x+huge)
		}
		hard = append(hard, Limit{BoundCgroup, x,
			fmt.Sprintf("%s - %s - %s - %s", bytesize.Approx(n.Cgroup.Limit), bytesize.Approx(int64(s.CgroupHeadroomBytes)),
				bytesize.Approx(pt), bytesize.Approx(links))})
	}
	if in.Allocatable > 0 {
		hard = append(hard, Limit{BoundAllocatable, in.Allocatable, bytesize.Approx(in.Allocatable)})
	}
	regular = tightest(hard)
	if huge > 0 {
		for i := range hard {
			hard[i].Bytes += huge
			hard[i].How += " + " + bytesize.Approx(huge) + " free huge pages"
		}
	}
	return hard, regular
}

// ptShare is the bytes of ordinary (4 KiB) pages that one byte of page
// table maps: an 8-byte entry a page.
const ptShare = 512

// PageTableBytes is the page tables of a mapping of b bytes of ordinary
// pages, which the kernel charges to the memory cgroup of the process that
// maps them: the agent, while it maps a chunk to fault it in and lock it
// (a keeper that takes the lock over holds them after; the chart counts
// them in both containers' memory). 2 GiB for 1 TiB: past the default
// headroom from a 256 GiB pool on. The cgroup bound keeps room for them
// and the page links: the largest pool x with x + PageTableBytes(x) +
// LinkBytes(x) within the cgroup limit less the headroom. Huge pages take
// 512 times fewer page tables, left to the headroom.
func PageTableBytes(b int64) int64 { return ceilDiv(b, ptShare) }

// LinkBytes is the most memory the sessions' page links take in a pool of
// b bytes (of any page size) under the default bound on their pages
// (limits.maxPages 0: pool.DefaultMaxPages, pages of 4 KiB or more over
// the whole pool, at least 4 Mi pages): b/1024, at least 16 MiB. The page
// size is the clients' choice, so the agent's memory must hold them
// whatever it is; the chart counts them in the agent's memory limit, and
// the cgroup bound keeps room for them. A larger limits.maxPages needs
// its difference in the headroom.
func LinkBytes(b int64) int64 { return pool.LinkBytes * pool.DefaultMaxPages(b) }

// fitCgroup is the largest pool x of ordinary pages with x, the page
// tables of its mapping and the links of x and the huge pages together
// within room (positive); -1 where not even the links fit.
func fitCgroup(room, huge int64) int64 {
	over := func(x int64) bool { return x+PageTableBytes(x)+LinkBytes(x+huge) > room }
	return int64(sort.Search(int(room)+1, func(i int) bool { return over(int64(i)) })) - 1
}

func ceilDiv(a, b int64) int64 { return (a + b - 1) / b }

// tightest is the limit of fewest bytes; the first of them on a tie.
func tightest(ls []Limit) Limit {
	t := ls[0]
	for _, l := range ls[1:] {
		if l.Bytes < t.Bytes {
			t = l
		}
	}
	return t
}

// policyTarget is the pool the policy asks for: sizing.poolBytes when set,
// else sizing.fraction of the usable memory (the tightest hard bound, none
// when it is negative).
func policyTarget(s config.Sizing, usable Limit) Limit {
	if s.PoolBytes > 0 {
		return Limit{BoundPoolBytes, int64(s.PoolBytes), bytesize.Approx(int64(s.PoolBytes))}
	}
	v := max(usable.Bytes, 0)
	f := new(big.Float).Mul(big.NewFloat(s.Fraction), new(big.Float).SetInt64(v))
	t, _ := f.Int64()
	return Limit{BoundFraction, t, fmt.Sprintf("%g x %s (%s)", s.Fraction, bytesize.Approx(v), usable.Name)}
}

// share is one GPU's part of the pool before it is cut into chunks.
type share struct {
	Bytes int64
	Bound string // what limited it
	How   string // the arithmetic
}

// splitShares divides the bound between the GPUs (sorted by index): evenly,
// or by device memory under split: memory; no share above
// sizing.maxPerGPU.
func splitShares(s config.Sizing, bound Limit, gpus []GPU) []share {
	var memSum big.Int
	for _, g := range gpus {
		memSum.Add(&memSum, big.NewInt(g.Memory))
	}
	out := make([]share, len(gpus))
	for i, g := range gpus {
		sh := share{bound.Bytes / int64(len(gpus)), bound.Name, fmt.Sprintf("%s / %d GPUs", bytesize.Approx(bound.Bytes), len(gpus))}
		if s.Split == config.SplitMemory {
			var x big.Int
			x.Mul(big.NewInt(bound.Bytes), big.NewInt(g.Memory))
			x.Quo(&x, &memSum)
			sh.Bytes = x.Int64()
			sh.How = fmt.Sprintf("%s x %s / %s of GPU memory", bytesize.Approx(bound.Bytes), bytesize.Approx(g.Memory), bytesize.Approx(memSum.Int64()))
		}
		if s.MaxPerGPU > 0 && sh.Bytes > int64(s.MaxPerGPU) {
			sh = share{int64(s.MaxPerGPU), BoundMaxPerGPU, bytesize.Approx(int64(s.MaxPerGPU))}
		}
		out[i] = sh
	}
	return out
}

// cutChunks makes a GPU's pool from its share: whole chunks, at least one
// and at least sizing.minPerGPU.
func cutChunks(s config.Sizing, g GPU, sh share, chunk int64) (GPUPlan, error) {
	gp := GPUPlan{GPU: g.Index, UUID: g.UUID, NUMA: g.NUMA, Bound: sh.Bound}
	gp.Chunks = int(sh.Bytes / chunk)
	gp.Bytes = int64(gp.Chunks) * chunk
	if gp.Chunks == 0 {
		return gp, fmt.Errorf("sizing: GPU %d would get %s, less than one chunk (sizing.chunkBytes %s); bound by %s (%s)",
			g.Index, bytesize.Approx(sh.Bytes), bytesize.Approx(chunk), gp.Bound, sh.How)
	}
	if gp.Bytes < int64(s.MinPerGPU) {
		return gp, fmt.Errorf("sizing: GPU %d would get %s, less than sizing.minPerGPU %s; bound by %s (%s)",
			g.Index, bytesize.Approx(gp.Bytes), bytesize.Approx(int64(s.MinPerGPU)), gp.Bound, sh.How)
	}
	return gp, nil
}

// fitOrdinary shrinks a GPU's pool of ordinary pages to what is left of
// regular, the bound without huge pages, after the GPUs before it; it
// fails when that is less than one chunk or than sizing.minPerGPU.
func fitOrdinary(s config.Sizing, gp GPUPlan, regular Limit, regularLeft, chunk int64) (GPUPlan, error) {
	if gp.Bytes <= regularLeft {
		return gp, nil
	}
	gp.Chunks = int(max(regularLeft, 0) / chunk)
	gp.Bytes = int64(gp.Chunks) * chunk
	gp.Bound = regular.Name
	how := fmt.Sprintf("%s is %s, %s of it left for 4 KiB pages", regular.Name, regular.How, bytesize.Approx(max(regularLeft, 0)))
	if gp.Chunks == 0 {
		return gp, fmt.Errorf("sizing: GPU %d has no huge pages and no room for one chunk of ordinary pages: %s", gp.GPU, how)
	}
	if gp.Bytes < int64(s.MinPerGPU) {
		return gp, fmt.Errorf("sizing: GPU %d would get %s of ordinary pages, less than sizing.minPerGPU %s: %s",
			gp.GPU, bytesize.Approx(gp.Bytes), bytesize.Approx(int64(s.MinPerGPU)), how)
	}
	return gp, nil
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
