package plugin

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvpool/kvpool/pkg/contract"
)

// GetPreferredAllocation answers each container request with Prefer.
func (p *Plugin) GetPreferredAllocation(_ context.Context, req *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	devs, _ := p.o.Devices.Devices()
	numa := make(map[string]int, len(devs))
	for _, d := range devs {
		numa[d.ID] = d.NUMA
	}
	resp := &pluginapi.PreferredAllocationResponse{}
	for i, cr := range req.GetContainerRequests() {
		ids, err := Prefer(cr.GetAvailableDeviceIDs(), cr.GetMustIncludeDeviceIDs(), int(cr.GetAllocationSize()), numa)
		if err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "preferred allocation, container request %d: %v", i, err)
		}
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: ids})
	}
	return resp, nil
}

type cand struct {
	id             string
	numa, gpu, idx int
	parsed         bool
}

// Prefer picks size devices out of available: every must-include device;
// then, when there are must-include devices, the rest from their NUMA node
// first, then the nodes that fit the rest (spreadFrom); without them, the
// rest spread evenly over the NUMA nodes of the available devices (spread).
// Within a node it takes a run of one GPU's chunks with the closest
// indices. numa gives each known device's node; devices it lacks fall back
// to the node in their ID. The result never holds a device outside
// available and never more than size.
//
// Why spread: kubelet's Topology Manager passes only the devices of the
// NUMA nodes its hint names when they suffice (so a pod whose GPU sits on
// one node sees only that node's chunks), and every node's devices when the
// pod spans nodes (its GPUs do) or there is no hint (policy none). kvpool
// never learns which GPUs a pod got; a pod spanning nodes has its GPUs on
// each of them, and its ranks each bind chunks on their own node when the
// chunks are spread the same way. Without a hint an even spread costs on
// average what one node would, and never all of a pod's chunks.
func Prefer(available, must []string, size int, numa map[string]int) ([]string, error) {
	if size <= 0 {
		return nil, fmt.Errorf("allocation size %d", size)
	}
	if len(must) > size {
		return nil, fmt.Errorf("%d must-include devices exceed the allocation size %d", len(must), size)
	}
	avail := make(map[string]bool, len(available))
	for _, id := range available {
		avail[id] = true
	}
	if len(avail) < size {
		return nil, fmt.Errorf("%d devices available, %d wanted", len(avail), size)
	}
	m, err := takeMust(must, avail, numa, size)
	if err != nil {
		return nil, err
	}
	out := m.out
	need := size - len(out)
	// Group the remaining candidates by NUMA node.
	groups := make(map[int][]cand)
	for _, id := range slices.Sorted(maps.Keys(avail)) {
		if m.taken[id] {
			continue
		}
		c := describe(id, numa)
		groups[c.numa] = append(groups[c.numa], c)
	}
	if len(must) == 0 {
		take := spread(groups, need)
		nodes := slices.Sorted(maps.Keys(groups))
		if len(nodes) > 0 && nodes[0] < 0 {
			nodes = append(nodes[1:], -1) // devices of no known node last
		}
		for _, n := range nodes {
			if k := take[n]; k > 0 {
				out = append(out, bestRun(groups[n], k, nil)...)
			}
		}
		return out, nil
	}
	for _, n := range orderNodes(groups, m.numa, need) {
		if need == 0 {
			break
		}
		g := groups[n]
		pick := bestRun(g, min(need, len(g)), m.gpu)
		out = append(out, pick...)
		need -= len(pick)
	}
	return out, nil
}

// spread divides need devices over the known NUMA nodes of groups: an equal
// part each (the nodes with the most devices take the remainder), no node
// more than it has, what a node lacks taken from those with the most to
// spare; devices of no known node (-1) only when the known ones lack.
func spread(groups map[int][]cand, need int) map[int]int {
	var nodes []int
	for n := range groups {
		if n >= 0 {
			nodes = append(nodes, n)
		}
	}
	// Most devices first, then by node: who takes a remainder or a shortfall.
	slices.SortFunc(nodes, func(a, b int) int { return cmp.Or(cmp.Compare(len(groups[b]), len(groups[a])), cmp.Compare(a, b)) })
	take := make(map[int]int, len(groups))
	left := need
	for i, n := range nodes {
		part := need / len(nodes)
		if i < need%len(nodes) {
			part++
		}
		take[n] = min(part, len(groups[n]))
		left -= take[n]
	}
	for _, n := range append(nodes, -1) {
		if left == 0 {
			break
		}
		extra := min(left, len(groups[n])-take[n])
		take[n] += extra
		left -= extra
	}
	return take
}

// mustPick is the must-include devices taken: in order, by ID, how many
// per NUMA node, and the (gpu, idx) of those with a chunk ID.
type mustPick struct {
	out   []string
	taken map[string]bool
	numa  map[int]int
	gpu   map[[2]int]bool
}

// takeMust takes every must-include device, each available and named once.
func takeMust(must []string, avail map[string]bool, numa map[string]int, size int) (mustPick, error) {
	m := mustPick{out: make([]string, 0, size), taken: make(map[string]bool, size), numa: map[int]int{}, gpu: map[[2]int]bool{}}
	for _, id := range must {
		if !avail[id] {
			return mustPick{}, fmt.Errorf("must-include device %s is not available", id)
		}
		if m.taken[id] {
			return mustPick{}, fmt.Errorf("must-include device %s named twice", id)
		}
		m.taken[id] = true
		m.out = append(m.out, id)
		c := describe(id, numa)
		m.numa[c.numa]++
		if c.parsed {
			m.gpu[[2]int{c.gpu, c.idx}] = true
		}
	}
	return m, nil
}

// orderNodes orders the NUMA nodes to take the need remaining devices
// from: nodes of the must-include devices (most first); then nodes that
// fit the rest alone, smallest first (keeps big nodes whole for big
// requests); then the others, largest first. Unknown node (-1) last among
// equals.
func orderNodes(groups map[int][]cand, mustNUMA map[int]int, need int) []int {
	nodes := make([]int, 0, len(groups))
	for n := range groups {
		nodes = append(nodes, n)
	}
	slices.SortFunc(nodes, func(a, b int) int {
		if c := cmp.Compare(mustNUMA[b], mustNUMA[a]); c != 0 {
			return c
		}
		fa, fb := len(groups[a]) >= need, len(groups[b]) >= need
		switch {
		case fa && !fb:
			return -1
		case fb && !fa:
			return 1
		case fa && fb:
			if c := cmp.Compare(len(groups[a]), len(groups[b])); c != 0 {
				return c
			}
		default:
			if c := cmp.Compare(len(groups[b]), len(groups[a])); c != 0 {
				return c
			}
		}
		if (a < 0) != (b < 0) {
			return cmp.Compare(b, a)
		}
		return cmp.Compare(a, b)
	})
	return nodes
}

func describe(id string, numa map[string]int) cand {
	c := cand{id: id, numa: -1}
	if g, n, i, err := contract.ParseChunkID(id); err == nil {
		c.gpu, c.idx, c.numa, c.parsed = g, i, n, true
	}
	if n, ok := numa[id]; ok {
		c.numa = n
	}
	if c.numa < 0 {
		c.numa = -1
	}
	return c
}

// bestRun picks k candidates from g (sorted by ID) forming the tightest run:
// fewest GPUs spanned, then fewest index gaps, then closest to a
// must-include chunk, then first in order.
func bestRun(g []cand, k int, must map[[2]int]bool) []string {
	slices.SortFunc(g, func(a, b cand) int {
		if a.parsed != b.parsed {
			if a.parsed {
				return -1
			}
			return 1
		}
		if c := cmp.Compare(a.gpu, b.gpu); c != 0 {
			return c
		}
		if c := cmp.Compare(a.idx, b.idx); c != 0 {
			return c
		}
		return cmp.Compare(a.id, b.id)
	})
	best, bestCost := 0, [3]int{-1}
	for s := 0; s+k <= len(g); s++ {
		w := g[s : s+k]
		var cost [3]int
		for i := 1; i < len(w); i++ {
			if !w[i].parsed || w[i].gpu != w[i-1].gpu {
				cost[0]++
			} else {
				cost[1] += w[i].idx - w[i-1].idx - 1
			}
		}
		cost[2] = mustDistance(w, must)
		if bestCost[0] < 0 || cmpCost(cost, bestCost) < 0 {
			best, bestCost = s, cost
		}
	}
	out := make([]string, k)
	for i, c := range g[best : best+k] {
		out[i] = c.id
	}
	return out
}

func cmpCost(a, b [3]int) int {
	for i := range a {
		if c := cmp.Compare(a[i], b[i]); c != 0 {
			return c
		}
	}
	return 0
}

// mustDistance is how far the run lies from the nearest must-include chunk
// of the same GPU (0 when there are none).
func mustDistance(w []cand, must map[[2]int]bool) int {
	if len(must) == 0 {
		return 0
	}
	best := -1
	for m := range must {
		for _, c := range w {
			if !c.parsed || c.gpu != m[0] {
				continue
			}
			d := c.idx - m[1]
			if d < 0 {
				d = -d
			}
			if best < 0 || d < best {
				best = d
			}
		}
	}
	if best < 0 {
		return 1 << 30 // the run is on another GPU than every must-include chunk
	}
	return best
}
