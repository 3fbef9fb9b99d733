package pool

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvpool/kvpool/pkg/poolerr"
)

// node is a GPU node as sizing lays it out: GPU g on NUMA node g*nodes/gpus
// (the first half of the GPUs on node 0 with two nodes), perGPU chunks of
// each GPU's share on its node, named as the agent names them.
type node struct {
	gpus, nodes, perGPU int
	p                   *Pool
}

const bindChunk = 64 << 10

func newNode(t testing.TB, gpus, nodes, perGPU int) *node {
	t.Helper()
	n := &node{gpus: gpus, nodes: nodes, perGPU: perGPU, p: New()}
	for g := range gpus {
		for i := range perGPU {
			must(t, n.p.AddChunk(Chunk{ID: n.id(g, i), GPU: g, NUMA: n.numa(g), Size: bindChunk}))
		}
	}
	return n
}

func (n *node) numa(gpu int) int     { return gpu * n.nodes / n.gpus }
func (n *node) id(gpu, i int) string { return fmt.Sprintf("gpu%d-numa%d-%d", gpu, n.numa(gpu), i) }

// free lists the free chunks on NUMA node numa (all nodes: -1) in ID
// order, as kubelet sees the devices it may give.
func (n *node) free(numa int) []string {
	var out []string
	for _, c := range n.p.Chunks() {
		if c.State == ChunkFree && (numa < 0 || c.NUMA == numa) {
			out = append(out, c.ID)
		}
	}
	slices.Sort(out)
	return out
}

// spec is a session's geometry: 16 KiB pages, 4 per chunk.
func spec(gpu int) Spec { return Spec{GPU: gpu, PageSize: 16 << 10, DevicePages: 64} }

// container is a pod's container with these GPUs, opening one session per
// GPU as a tensor-parallel engine does, each knowing the others.
func (n *node) near(gpus []int, self int) Near {
	near := Near{NUMA: n.numa(gpus[self]), Ranks: len(gpus)}
	for i, g := range gpus {
		if i != self {
			near.Peers = append(near.Peers, Place{GPU: g, NUMA: n.numa(g)})
		}
	}
	return near
}

// bestLocal is the most chunks of an allocation that can lie on their
// rank's NUMA node, given how many each rank holds: per node, the chunks
// there or what the ranks there hold, whichever is smaller.
func bestLocal(chunks map[int]int, ranks map[int]int) int {
	best := 0
	for node, held := range ranks {
		best += min(chunks[node], held)
	}
	return best
}

// openRanks opens one session per GPU of gpus on alloc, in the order
// given by perm, with MaxPages 0, and checks what the binding rule
// promises: every rank opens, all of the allocation's chunks are bound,
// each rank holds an equal part (the first ones opened one more when it
// does not divide), as many chunks lie on their rank's node as any
// division of those parts could place there, and no chunk is bound twice.
func (n *node) openRanks(t *testing.T, alloc string, gpus, perm []int, peers bool) []*Session {
	t.Helper()
	ids, err := n.p.Allocation(alloc)
	must(t, err)
	sessions := make([]*Session, len(gpus))
	for _, r := range perm {
		near := n.near(gpus, r)
		if !peers {
			near.Peers = nil
		}
		s, err := n.p.OpenNear(alloc, spec(gpus[r]), near)
		if err != nil {
			t.Fatalf("rank %d on GPU %d (order %v): %v", r, gpus[r], perm, err)
		}
		sessions[r] = s
	}
	chunksOn, heldOn := map[int]int{}, map[int]int{}
	for _, c := range n.p.Chunks() {
		if slices.Contains(ids, c.ID) {
			chunksOn[c.NUMA]++
		}
	}
	bound, local := map[string]bool{}, 0
	lo, hi := len(ids)/len(gpus), (len(ids)+len(gpus)-1)/len(gpus)
	for i, r := range perm {
		s := sessions[r]
		want := lo
		if i < len(ids)%len(gpus) {
			want = hi
		}
		if got := len(s.Chunks()); got != want {
			t.Errorf("rank %d (opened %d of %d, order %v) holds %d of %d chunks, want %d", r, i+1, len(gpus), perm, got, len(ids), want)
		}
		if s.Capacity() != len(s.Chunks())*int(bindChunk/spec(0).PageSize) {
			t.Errorf("rank %d: capacity %d over %d chunks", r, s.Capacity(), len(s.Chunks()))
		}
		l := s.Locality()
		local += l.Local
		heldOn[n.numa(gpus[r])] += len(s.Chunks())
		if l.Local+l.Remote+l.Unknown != len(s.Chunks()) || l.GPUNUMA != n.numa(gpus[r]) || l.Ranks != len(gpus) {
			t.Errorf("rank %d: locality %+v of %d chunks", r, l, len(s.Chunks()))
		}
		for _, c := range s.Chunks() {
			if bound[c.ID] || !slices.Contains(ids, c.ID) {
				t.Fatalf("chunk %s bound twice or outside allocation %s", c.ID, alloc)
			}
			bound[c.ID] = true
		}
	}
	if len(bound) != len(ids) {
		t.Errorf("%d of %d chunks bound", len(bound), len(ids))
	}
	if best := bestLocal(chunksOn, heldOn); local != best {
		t.Errorf("order %v: %d chunks on their rank's node, %d possible (chunks per node %v, held per node %v)", perm, local, best, chunksOn, heldOn)
	}
	must(t, n.p.Check())
	return sessions
}

var shapes = []struct{ gpus, nodes int }{{1, 1}, {2, 1}, {2, 2}, {4, 1}, {4, 2}, {8, 1}, {8, 2}}

// Single-GPU pods, one per GPU of the node, as two device plugins that
// never talk place them: the chunks of each come from any GPU's share on
// the pod's node (single-numa-node), named under whichever GPU kubelet
// picked first. Every pod binds all of its chunks, on its node; with the
// chunks on the other node (best-effort or none missed), it binds them all
// the same and its locality says they are remote.
func TestBindOneGPUPods(t *testing.T) {
	for _, sh := range shapes {
		t.Run(fmt.Sprintf("%dgpu-%dnuma", sh.gpus, sh.nodes), func(t *testing.T) {
			n := newNode(t, sh.gpus, sh.nodes, 5)
			rng := rand.New(rand.NewPCG(uint64(sh.gpus), uint64(sh.nodes)))
			for _, g := range rng.Perm(sh.gpus) {
				free := n.free(n.numa(g))
				alloc := fmt.Sprint("pod-gpu", g)
				must(t, n.p.Grant(alloc, free[:3])) // the node's first free chunks, whoever's share
				s, err := n.p.OpenNear(alloc, spec(g), Near{NUMA: n.numa(g), Ranks: 1})
				must(t, err)
				if l := s.Locality(); len(s.Chunks()) != 3 || l.Local != 3 {
					t.Errorf("pod on GPU %d: %d chunks, locality %+v", g, len(s.Chunks()), l)
				}
			}
			if sh.nodes < 2 {
				return
			}
			// A pod of GPU 0 (node 0) whose chunks kubelet put on node 1.
			must(t, n.p.Grant("miss", n.free(1)[:2]))
			s, err := n.p.OpenNear("miss", spec(0), Near{NUMA: 0, Ranks: 1})
			must(t, err)
			if l := s.Locality(); len(s.Chunks()) != 2 || l.Remote != 2 || !l.CrossNUMA() {
				t.Errorf("pod with chunks on the other node: %d chunks, locality %+v", len(s.Chunks()), l)
			}
			must(t, n.p.Check())
		})
	}
}

// One container holding every GPU of the node (one rank per GPU) and
// allocations laid out as kubelet may lay them out: every chunk of GPU 0's
// share (kubelet packs a request on one GPU's run), an even spread over the
// GPUs, a spread that does not divide by the ranks, and all chunks on one
// node. The ranks open in random orders, knowing their peers or not.
func TestBindRanksShareFairly(t *testing.T) {
	for _, sh := range shapes {
		layouts := map[string]func(n *node) []string{
			"gpu0's share": func(n *node) []string { return n.free(-1)[:n.perGPU] },
			"even": func(n *node) []string {
				var ids []string
				for g := range n.gpus {
					ids = append(ids, n.id(g, 0), n.id(g, 1))
				}
				return ids
			},
			"uneven": func(n *node) []string {
				var ids []string
				for g := range n.gpus {
					ids = append(ids, n.id(g, 0))
					if g%2 == 0 {
						ids = append(ids, n.id(g, 1), n.id(g, 2))
					}
				}
				return ids
			},
			"one node": func(n *node) []string { return n.free(0)[:min(len(n.free(0)), 3*n.gpus)] },
		}
		for name, layout := range layouts {
			for _, peers := range []bool{true, false} {
				t.Run(fmt.Sprintf("%dgpu-%dnuma/%s/peers=%v", sh.gpus, sh.nodes, name, peers), func(t *testing.T) {
					gpus := make([]int, sh.gpus)
					for g := range gpus {
						gpus[g] = g
					}
					rng := rand.New(rand.NewPCG(uint64(sh.gpus*10+sh.nodes), uint64(len(name))))
					for try := range 6 {
						n := newNode(t, sh.gpus, sh.nodes, 4*sh.gpus)
						ids := layout(n)
						if len(ids) < sh.gpus {
							t.Skipf("%d chunks for %d ranks", len(ids), sh.gpus)
						}
						rng.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
						alloc := fmt.Sprint("tp-", try)
						must(t, n.p.Grant(alloc, ids))
						ss := n.openRanks(t, alloc, gpus, rng.Perm(sh.gpus), peers)
						if name == "even" && peers {
							// Each GPU's own chunks are its rank's.
							for r, s := range ss {
								for _, c := range s.Chunks() {
									if c.GPU != gpus[r] {
										t.Fatalf("rank on GPU %d holds %s", gpus[r], c.ID)
									}
								}
							}
						}
					}
				})
			}
		}
	}
}

// A 2-GPU pod of a two-node machine whose GPUs sit one on each node and
// whose chunks lie 6 on node 0 and 2 on node 1: whichever rank opens
// first, the one on node 1 binds both node-1 chunks (4 chunks each, 6 of 8
// local).
func TestBindLeavesAPeerItsNode(t *testing.T) {
	for _, first := range []int{0, 1} {
		n := newNode(t, 2, 2, 8)
		ids := append(n.free(0)[:6], n.free(1)[:2]...)
		must(t, n.p.Grant("pod", ids))
		ss := n.openRanks(t, "pod", []int{0, 1}, []int{first, 1 - first}, true)
		if l := ss[1].Locality(); l.Local != 2 || l.Remote != 2 {
			t.Errorf("rank on node 1 (rank %d opened first): %+v", first, l)
		}
	}
}

// Three NUMA nodes: a rank with nothing on its node takes the node with a
// surplus, not the chunks a waiting peer on another node needs.
func TestBindRemoteFromTheSurplus(t *testing.T) {
	p := New()
	add := func(id string, gpu, numa int) {
		must(t, p.AddChunk(Chunk{ID: id, GPU: gpu, NUMA: numa, Size: bindChunk}))
	}
	// Node 1: 2 chunks (its rank needs 2); node 2: 4 chunks (its rank
	// needs 2, 2 spare); node 0: none.
	add("a", 1, 1)
	add("b", 1, 1)
	for i := range 4 {
		add(fmt.Sprint("c", i), 2, 2)
	}
	must(t, p.Grant("pod", []string{"a", "b", "c0", "c1", "c2", "c3"}))
	peers := []Place{{GPU: 1, NUMA: 1}, {GPU: 2, NUMA: 2}}
	s, err := p.OpenNear("pod", spec(0), Near{NUMA: 0, Ranks: 3, Peers: peers})
	must(t, err)
	for _, c := range s.Chunks() {
		if c.NUMA != 2 {
			t.Fatalf("the rank on node 0 took %s of node %d, which its peer there needs", c.ID, c.NUMA)
		}
	}
	s1, err := p.OpenNear("pod", spec(1), Near{NUMA: 1, Ranks: 3, Peers: []Place{{0, 0}, {2, 2}}})
	must(t, err)
	s2, err := p.OpenNear("pod", spec(2), Near{NUMA: 2, Ranks: 3, Peers: []Place{{0, 0}, {1, 1}}})
	must(t, err)
	if s1.Locality().Local != 2 || s2.Locality().Local != 2 {
		t.Errorf("peers: %+v, %+v", s1.Locality(), s2.Locality())
	}
}

// An explicit MaxPages is honoured up to what leaves every rank without a
// session its equal part; past that it is refused and nothing changes.
func TestBindExplicitMaxPages(t *testing.T) {
	n := newNode(t, 4, 2, 4)
	must(t, n.p.Grant("pod", n.free(-1)[:8]))
	gpus := []int{0, 1} // both on node 0, with the chunks
	before := poolStateOf(n.p)
	ask := spec(0)
	ask.MaxPages = 5 * 4 // 5 chunks: rank 2 would be left 3 of its 4
	if _, err := n.p.OpenNear("pod", ask, n.near(gpus, 0)); !errors.Is(err, poolerr.ErrNoCapacity) {
		t.Fatalf("5 of 8 chunks with a rank to come: %v", err)
	}
	if after := poolStateOf(n.p); !reflect.DeepEqual(before, after) {
		t.Fatalf("a refused open changed the pool: %+v -> %+v", before, after)
	}
	ask.MaxPages = 3*4 + 1 // 13 pages: 4 chunks, capacity 13
	s, err := n.p.OpenNear("pod", ask, n.near(gpus, 0))
	must(t, err)
	if len(s.Chunks()) != 4 || s.Capacity() != 13 {
		t.Fatalf("13 pages: %d chunks, capacity %d", len(s.Chunks()), s.Capacity())
	}
	s2, err := n.p.OpenNear("pod", spec(1), n.near(gpus, 1))
	must(t, err)
	if len(s2.Chunks()) != 4 || s2.Locality().Local != 4 {
		t.Fatalf("second rank: %d chunks, %+v", len(s2.Chunks()), s2.Locality())
	}
	// Three ranks, 8 chunks: the first may take 8-2*2 = 4 explicitly, not 5.
	must(t, n.p.Grant("three", n.free(-1)[:8]))
	three := []int{0, 1, 3}
	ask.MaxPages = 5 * 4
	if _, err := n.p.OpenNear("three", ask, n.near(three, 0)); !errors.Is(err, poolerr.ErrNoCapacity) {
		t.Fatalf("5 of 8 chunks with two ranks to come: %v", err)
	}
	ask.MaxPages = 4 * 4
	_, err = n.p.OpenNear("three", ask, n.near(three, 0))
	must(t, err)
	for i, want := range []int{2, 2} {
		s, err := n.p.OpenNear("three", spec(three[i+1]), n.near(three, i+1))
		must(t, err)
		if len(s.Chunks()) != want {
			t.Fatalf("rank %d: %d chunks, want %d", i+1, len(s.Chunks()), want)
		}
	}
	if _, err := n.p.OpenNear("three", spec(0), Near{Ranks: -1}); !errors.Is(err, poolerr.ErrBadSize) {
		t.Fatalf("negative ranks: %v", err)
	}
	must(t, n.p.Check())
}

// A rank that closes and reopens, or is replaced, gets its part back; more
// sessions than declared ranks share what is left.
func TestBindReopen(t *testing.T) {
	n := newNode(t, 2, 1, 8)
	must(t, n.p.Grant("pod", n.free(-1)[:6]))
	gpus := []int{0, 1}
	ss := n.openRanks(t, "pod", gpus, []int{1, 0}, true)
	n.p.Close(ss[1])
	s, err := n.p.OpenNear("pod", spec(1), n.near(gpus, 1))
	must(t, err)
	if len(s.Chunks()) != 3 {
		t.Fatalf("reopened rank: %d chunks", len(s.Chunks()))
	}
	if _, err := n.p.OpenNear("pod", spec(0), Near{NUMA: 0, Ranks: 2}); !errors.Is(err, poolerr.ErrNoCapacity) {
		t.Fatalf("a third session with every chunk bound: %v", err)
	}
}

// Fragmentation: containers of 1 to 4 GPUs come and go on a node of 8 GPUs
// (one and two NUMA nodes); their chunks are freed and scrubbed in another
// order than granted, regranted in other orders, and every new container's
// ranks bind fair parts, as local as the parts allow, whatever the names.
func TestBindFragmentation(t *testing.T) {
	for _, nodes := range []int{1, 2} {
		t.Run(fmt.Sprint(nodes, "numa"), func(t *testing.T) {
			n := newNode(t, 8, nodes, 6)
			rng := rand.New(rand.NewPCG(uint64(nodes), 24))
			type pod struct {
				alloc string
				gpus  []int
			}
			var live []pod
			busy := map[int]bool{}
			for round := range 60 {
				// Retire a random pod now and then: revoke, scrub in a shuffled order.
				if len(live) > 0 && (rng.IntN(3) == 0 || len(busy) >= 7) {
					i := rng.IntN(len(live))
					chunks, err := n.p.Revoke(live[i].alloc)
					must(t, err)
					rng.Shuffle(len(chunks), func(a, b int) { chunks[a], chunks[b] = chunks[b], chunks[a] })
					for _, c := range chunks {
						must(t, n.p.Scrubbed(c.ID))
					}
					for _, g := range live[i].gpus {
						delete(busy, g)
					}
					live = slices.Delete(live, i, i+1)
				}
				var gpus []int
				for _, g := range rng.Perm(8) {
					if !busy[g] && len(gpus) < 1+rng.IntN(4) {
						gpus = append(gpus, g)
					}
				}
				// Kubelet picks free chunks: from the first GPU's node, or
				// anywhere (no alignment), in a shuffled order.
				numa := -1
				if rng.IntN(2) == 0 {
					numa = n.numa(gpus[0])
				}
				free := n.free(numa)
				want := len(gpus) + rng.IntN(3*len(gpus))
				if len(gpus) == 0 || len(free) < want {
					continue
				}
				rng.Shuffle(len(free), func(a, b int) { free[a], free[b] = free[b], free[a] })
				alloc := fmt.Sprint("pod-", round)
				must(t, n.p.Grant(alloc, free[:want]))
				n.openRanks(t, alloc, gpus, rng.Perm(len(gpus)), rng.IntN(4) != 0)
				live = append(live, pod{alloc, gpus})
				for _, g := range gpus {
					busy[g] = true
				}
			}
			must(t, n.p.Check())
		})
	}
}

// ReplaceNear counts the session it replaces as gone for the choice and
// the page bound, and closes it only once the new session is open: every
// refusal leaves it open with its streams and chunks.
func TestReplaceNear(t *testing.T) {
	cases := []struct {
		name    string
		open    func(t *testing.T, n *node, old *Session) (*Session, error)
		wantErr error  // nil (and no pageErr, no wantMsg): the replacement succeeds
		pageErr bool   // a *PageBoundError
		wantMsg string // an error saying this
	}{
		{name: "replaced", open: func(t *testing.T, n *node, old *Session) (*Session, error) {
			return n.p.ReplaceNear(old, "pod", spec(0), Near{NUMA: 0, Ranks: 1})
		}},
		{name: "no capacity", wantErr: poolerr.ErrNoCapacity, open: func(t *testing.T, n *node, old *Session) (*Session, error) {
			s := spec(0)
			s.MaxPages = 1 << 20
			return n.p.ReplaceNear(old, "pod", s, Near{NUMA: 0, Ranks: 1})
		}},
		{name: "page bound", pageErr: true, open: func(t *testing.T, n *node, old *Session) (*Session, error) {
			side(t, n)
			n.p.SetMaxPages(16 + 15) // the side's 16 and the new session's 16 do not fit
			return n.p.ReplaceNear(old, "pod", spec(0), Near{NUMA: 0, Ranks: 1})
		}},
		{name: "within the page bound without the owner's pages", open: func(t *testing.T, n *node, old *Session) (*Session, error) {
			side(t, n)
			n.p.SetMaxPages(16 + 16) // fits only with the owner's 16 set aside
			return n.p.ReplaceNear(old, "pod", spec(0), Near{NUMA: 0, Ranks: 1})
		}},
		{name: "bad size", wantErr: poolerr.ErrBadSize, open: func(t *testing.T, n *node, old *Session) (*Session, error) {
			s := spec(0)
			s.PageSize = bindChunk * 2
			return n.p.ReplaceNear(old, "pod", s, Near{NUMA: 0, Ranks: 1})
		}},
		{name: "unknown allocation", wantErr: poolerr.ErrUnknownAllocation, open: func(t *testing.T, n *node, old *Session) (*Session, error) {
			return n.p.ReplaceNear(old, "nobody", spec(0), Near{NUMA: 0, Ranks: 1})
		}},
		{name: "another allocation's session", wantMsg: "another allocation", open: func(t *testing.T, n *node, old *Session) (*Session, error) {
			must(t, n.p.Grant("other", n.free(-1)[:1]))
			return n.p.ReplaceNear(old, "other", spec(1), Near{NUMA: 0, Ranks: 1})
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			n := newNode(t, 2, 1, 4)
			must(t, n.p.Grant("pod", n.free(-1)[:4]))
			old, err := n.p.OpenNear("pod", spec(0), Near{NUMA: 0, Ranks: 1})
			must(t, err)
			if _, err := old.Offload("r", "k", []int32{1, 2, 3}, Meta{}, nil); err != nil {
				t.Fatal(err)
			}
			oldChunks := old.Chunks()
			s, err := c.open(t, n, old)
			if c.wantErr == nil && !c.pageErr && c.wantMsg == "" {
				must(t, err)
				if !old.Closed() || s.Closed() || s.ID() <= old.ID() {
					t.Fatalf("after a replacement: old closed %v, new closed %v, IDs %d -> %d", old.Closed(), s.Closed(), old.ID(), s.ID())
				}
				if !slices.Equal(s.Chunks(), oldChunks) {
					t.Fatalf("the new session bound %v, want the replaced one's %v", s.Chunks(), oldChunks)
				}
				return
			}
			var pb *PageBoundError
			switch {
			case s != nil:
				t.Fatalf("refused replacement returned session %d", s.ID())
			case c.pageErr && !errors.As(err, &pb):
				t.Fatalf("want a page bound error, got %v", err)
			case c.wantMsg != "" && (err == nil || !strings.Contains(err.Error(), c.wantMsg)):
				t.Fatalf("want an error saying %q, got %v", c.wantMsg, err)
			case c.wantErr != nil && !errors.Is(err, c.wantErr):
				t.Fatalf("want %v, got %v", c.wantErr, err)
			}
			if old.Closed() || !old.IsOffloaded("r") || !slices.Equal(old.Chunks(), oldChunks) {
				t.Fatalf("after a refused replacement (%v): closed %v, stream kept %v, chunks %v (were %v)", err, old.Closed(), old.IsOffloaded("r"), old.Chunks(), oldChunks)
			}
			// The owner's chunks are still its own: a second session of
			// the allocation binds none of them (or finds none free).
			if s2, err := n.p.OpenNear("pod", spec(1), Near{NUMA: 0, Ranks: 1}); err == nil {
				for _, ch := range s2.Chunks() {
					if slices.Contains(oldChunks, ch) {
						t.Fatalf("a later session bound %s, the owner's chunk", ch.ID)
					}
				}
			}
		})
	}
}

// side opens a session of 16 pages on another allocation of n, the rest
// of its chunks.
func side(t *testing.T, n *node) {
	t.Helper()
	must(t, n.p.Grant("side", n.free(-1)))
	if _, err := n.p.OpenNear("side", spec(1), Near{NUMA: 0, Ranks: 1}); err != nil {
		t.Fatal(err)
	}
}
