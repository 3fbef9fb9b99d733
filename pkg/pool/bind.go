package pool

import (
	"cmp"
	"fmt"
	"slices"

	"github.com/kvpool/kvpool/pkg/poolerr"
)

// Binding: locality, not identity. A chunk's GPU is the GPU whose share of
// the pool it was sized under; on a node where one device plugin picks a
// pod's GPU and another its chunks, that name says nothing about the GPU
// the pod runs on. A session therefore binds the chunks of its allocation
// by how close they are to its GPU, never refusing them for their name, and
// the ranks (GPUs) of one container share the allocation fairly.

// Near is where a session's GPU sits and who shares its allocation: what
// OpenNear binds by.
type Near struct {
	// NUMA is the NUMA node of the session's GPU, -1 when unknown.
	NUMA int
	// Ranks is the number of sessions (one per GPU of the container: its
	// tensor-parallel ranks) that share the allocation, this one included.
	// 0: one per GPU that the allocation's chunks were sized under (a
	// standalone token holds chunks of every GPU, for one session each).
	Ranks int
	// Peers are the GPUs of the other ranks, when known. Chunks close to a
	// peer that has no session yet are bound last, so that it finds them.
	Peers []Place
}

// Place is a GPU and its NUMA node (-1: unknown).
type Place struct {
	GPU  int
	NUMA int
}

// Locality is how a session's chunks lie relative to its GPU.
type Locality struct {
	GPUNUMA int // NUMA node of the session's GPU, -1 when unknown
	Ranks   int // the ranks the allocation was shared among when the session opened; 0 after a restore
	Local   int // chunks on the GPU's NUMA node
	Remote  int // chunks on another NUMA node
	Unknown int // chunks whose node, or whose GPU's node, is unknown
}

// CrossNUMA reports whether any chunk lies on another NUMA node than the GPU.
func (l Locality) CrossNUMA() bool { return l.Remote > 0 }

// Locality says where the session's chunks lie relative to its GPU.
func (s *Session) Locality() Locality {
	l := Locality{GPUNUMA: s.near.NUMA, Ranks: s.near.Ranks}
	for _, ch := range s.chunks {
		switch {
		case ch.NUMA < 0 || s.near.NUMA < 0:
			l.Unknown++
		case ch.NUMA == s.near.NUMA:
			l.Local++
		default:
			l.Remote++
		}
	}
	return l
}

// share is how many of an allocation's unbound chunks a new session takes.
type share struct {
	unbound int // chunks of the allocation no session holds
	ranks   int // ranks sharing the allocation (at least the sessions it has, plus this one)
	waiting int // ranks without a session yet, this one included (at least 1)
}

// fair is what a session that names no page count binds: an equal part
// of the unbound chunks among the ranks still to come, rounded up.
func (sh share) fair() int { return (sh.unbound + sh.waiting - 1) / sh.waiting }

// limit is the most a session may bind while every other waiting rank is
// left its equal part, rounded down.
func (sh share) limit() int { return sh.unbound - (sh.waiting-1)*(sh.unbound/sh.waiting) }

// shareOf works out the share of a new session on a.
func shareOf(a *allocation, unbound, ranks int) share {
	if ranks <= 0 {
		gpus := map[int]bool{}
		for _, ch := range a.chunks {
			gpus[ch.GPU] = true
		}
		ranks = len(gpus)
	}
	waiting := max(1, ranks-len(a.sessions))
	return share{unbound: unbound, ranks: waiting + len(a.sessions), waiting: waiting}
}

// closeness orders a new session's candidate chunks, nearest first:
//
//  0. on the GPU's NUMA node;
//  1. on a node that is unknown (or the GPU's node is);
//  2. on another node, within that node's surplus: what is left there once
//     each waiting peer on it has its equal part;
//  3. on another node, beyond its surplus (a waiting peer's part).
//
// Within each: the session's own GPU's chunks, then chunks of GPUs no
// waiting peer runs on, then a waiting peer's own; then the order of the
// grant.
type closeness struct {
	gpu, numa  int
	peerGPUs   map[int]int // waiting peers per GPU
	peerNodes  map[int]int // waiting peers per NUMA node
	grantOrder map[*chunk]int
	tiers      map[*chunk]int
}

func newCloseness(a *allocation, spec Spec, near Near) closeness {
	c := closeness{gpu: spec.GPU, numa: near.NUMA, peerGPUs: map[int]int{}, peerNodes: map[int]int{},
		grantOrder: map[*chunk]int{}, tiers: map[*chunk]int{}}
	for i, ch := range a.chunks {
		c.grantOrder[ch] = i
	}
	open := map[int]int{} // GPUs that already have a session of the allocation
	for s := range a.sessions {
		open[s.spec.GPU]++
	}
	for _, p := range near.Peers {
		if open[p.GPU] > 0 {
			open[p.GPU]-- // that peer has its session and its chunks
			continue
		}
		c.peerGPUs[p.GPU]++
		if p.NUMA >= 0 {
			c.peerNodes[p.NUMA]++
		}
	}
	return c
}

// order sorts unbound nearest first for a share sh.
func (c closeness) order(unbound []*chunk, sh share) {
	perNode := map[int]int{}
	for _, ch := range unbound {
		switch {
		case ch.NUMA < 0 || c.numa < 0:
			c.tiers[ch] = 1
		case ch.NUMA == c.numa:
			c.tiers[ch] = 0
		default:
			c.tiers[ch] = 2
			perNode[ch.NUMA]++
		}
	}
	slices.SortStableFunc(unbound, c.compare)
	// The remote chunks beyond their node's surplus drop to tier 3; the
	// owner order keeps a waiting peer's own chunks the last to go.
	part := sh.unbound / sh.waiting
	taken := map[int]int{}
	for _, ch := range unbound {
		if c.tiers[ch] != 2 {
			continue
		}
		if taken[ch.NUMA] >= perNode[ch.NUMA]-c.peerNodes[ch.NUMA]*part {
			c.tiers[ch] = 3
			continue
		}
		taken[ch.NUMA]++
	}
	slices.SortStableFunc(unbound, c.compare)
}

// owner: 0 the session's GPU's chunk, 1 of a GPU no waiting peer runs on,
// 2 a waiting peer's own.
func (c closeness) owner(ch *chunk) int {
	switch {
	case ch.GPU == c.gpu:
		return 0
	case c.peerGPUs[ch.GPU] > 0:
		return 2
	}
	return 1
}

func (c closeness) compare(x, y *chunk) int {
	return cmp.Or(cmp.Compare(c.tiers[x], c.tiers[y]), cmp.Compare(c.owner(x), c.owner(y)),
		cmp.Compare(c.grantOrder[x], c.grantOrder[y]))
}

// choose picks the chunks of a new session on a: how many its share (or
// spec.MaxPages) says, nearest first. It returns them in binding order
// (page order: the nearest hold the first pages), the pages per chunk and
// the share it was given.
func choose(a *allocation, alloc string, spec Spec, near Near) ([]*chunk, int, share, error) {
	var unbound []*chunk
	for _, ch := range a.chunks {
		if ch.session == nil {
			unbound = append(unbound, ch)
		}
	}
	if len(unbound) == 0 {
		return nil, 0, share{}, fmt.Errorf("open on %s for GPU %d: %w: all %d chunks of the allocation are bound to its %d other sessions",
			alloc, spec.GPU, poolerr.ErrNoCapacity, len(a.chunks), len(a.sessions))
	}
	// All chunks of one allocation should share a size; the smallest decides
	// the pages per chunk so that every chunk holds the same count.
	size := unbound[0].Size
	for _, ch := range unbound {
		size = min(size, ch.Size)
	}
	if spec.PageSize > size {
		return nil, 0, share{}, fmt.Errorf("open on %s: %w: page size %d exceeds chunk size %d", alloc, poolerr.ErrBadSize, spec.PageSize, size)
	}
	ppc := int(size / spec.PageSize)
	sh := shareOf(a, len(unbound), near.Ranks)
	want := sh.fair()
	if spec.MaxPages > 0 {
		want = (spec.MaxPages + ppc - 1) / ppc
		if lim := sh.limit(); want > lim {
			return nil, 0, share{}, fmt.Errorf("open on %s for GPU %d: %w: %d pages of %d bytes need %d chunks; %d of the allocation are unbound, shared by %d ranks without a session yet, so this one may bind %d",
				alloc, spec.GPU, poolerr.ErrNoCapacity, spec.MaxPages, spec.PageSize, want, sh.unbound, sh.waiting, lim)
		}
	}
	if int64(want)*int64(ppc) > maxPages {
		return nil, 0, share{}, fmt.Errorf("open on %s: %w: %d pages exceed the limit of %d", alloc, poolerr.ErrBadSize, int64(want)*int64(ppc), maxPages)
	}
	newCloseness(a, spec, near).order(unbound, sh)
	return unbound[:want:want], ppc, sh, nil
}

// homeNUMA is the NUMA node of gpu's own chunks (sizing puts each GPU's
// share on its node), -1 when the pool holds none or they disagree.
// Called with p.mu held.
func (p *Pool) homeNUMA(gpu int) int {
	n := -2
	for _, ch := range p.order {
		if ch.GPU != gpu {
			continue
		}
		switch {
		case n == -2:
			n = ch.NUMA
		case n != ch.NUMA:
			return -1
		}
	}
	return max(n, -1)
}
