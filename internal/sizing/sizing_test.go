package sizing

import (
	"context"
	"log/slog"
	"reflect"
	"strings"
	"testing"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/internal/node"
	"github.com/kvpool/kvpool/pkg/contract"
)

const (
	mib = int64(1) << 20
	gib = int64(1) << 30
)

// host is a node with plenty of everything unless a case changes it.
func host() *node.Info {
	return &node.Info{
		MemTotal: 2048 * gib, MemAvailable: 1900 * gib,
		Cgroup: node.Cgroup{Limit: node.Unlimited, Usage: -1},
		NUMANodes: []node.NUMANode{
			{ID: 0, HugePages: []node.HugePool{{PageSize: 2 * mib, Total: 10240, Free: 10240}}},
			{ID: 1, HugePages: []node.HugePool{{PageSize: 2 * mib, Total: 100, Free: 100}, {PageSize: gib, Total: 64, Free: 64}}},
		},
		HugePages: []node.HugePool{{PageSize: 2 * mib, Total: 10340, Free: 10340}, {PageSize: gib, Total: 64, Free: 64}},
	}
}

func policy() config.Sizing {
	s := config.Default().Sizing
	s.HugePages = config.HugePagesNever
	return s
}

func twoGPUs() []GPU {
	return []GPU{{Index: 0, UUID: "GPU-0", NUMA: 0, Memory: 80 * gib}, {Index: 1, UUID: "GPU-1", NUMA: 1, Memory: 80 * gib}}
}

type want struct {
	bound    string
	perGPU   []int64 // bytes per GPU
	gpuBound []string
	pages    []int64
	warn     string
}

func TestMakeBinds(t *testing.T) {
	cases := []struct {
		name string
		edit func(*config.Sizing, *Input)
		want want
	}{
		{"poolBytes", func(s *config.Sizing, in *Input) { s.PoolBytes = config.Bytes(64 * gib) },
			want{bound: BoundPoolBytes, perGPU: []int64{32 * gib, 32 * gib}}},
		{"fraction", func(s *config.Sizing, in *Input) {
			in.Node.MemAvailable = 108 * gib // usable 100Gi, half is 50Gi
		}, want{bound: BoundFraction, perGPU: []int64{25 * gib, 25 * gib}}},
		{"fraction of the cgroup bound", func(s *config.Sizing, in *Input) {
			s.Fraction = 0.25
			in.Node.Cgroup.Limit = 64*gib + 128*mib + 64*mib + 512*mib // usable 64Gi (and its page tables and links), a quarter is 16Gi
		}, want{bound: BoundFraction, perGPU: []int64{8 * gib, 8 * gib}}},
		{"MemAvailable less reserve", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(512 * gib)
			in.Node.MemAvailable = 100 * gib // 92Gi usable, 46Gi each
		}, want{bound: BoundAvailable, perGPU: []int64{46 * gib, 46 * gib}}},
		{"cgroup limit less headroom", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(512 * gib)
			in.Node.Cgroup.Limit = 40 * gib // 39.5Gi: 19.75Gi each, 19 chunks
		}, want{bound: BoundCgroup, perGPU: []int64{19 * gib, 19 * gib}}},
		{"node allocatable", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(512 * gib)
			in.Allocatable = 30 * gib
		}, want{bound: BoundAllocatable, perGPU: []int64{15 * gib, 15 * gib}}},
		{"maxPerGPU", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(64 * gib)
			s.MaxPerGPU = config.Bytes(10 * gib)
		}, want{bound: BoundPoolBytes, perGPU: []int64{10 * gib, 10 * gib}, gpuBound: []string{BoundMaxPerGPU, BoundMaxPerGPU}}},
		{"memory split", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(48 * gib)
			s.Split = config.SplitMemory
			in.GPUs[1].Memory = 160 * gib
		}, want{bound: BoundPoolBytes, perGPU: []int64{16 * gib, 32 * gib}}},
		{"memory split with a cap on the big GPU", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(48 * gib)
			s.Split = config.SplitMemory
			s.MaxPerGPU = config.Bytes(20 * gib)
			in.GPUs[1].Memory = 160 * gib
		}, want{bound: BoundPoolBytes, perGPU: []int64{16 * gib, 20 * gib}, gpuBound: []string{BoundPoolBytes, BoundMaxPerGPU}}},
		{"chunk rounding", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(10 * gib)
			s.ChunkBytes = config.Bytes(3 * gib) // 5Gi each: one 3Gi chunk
		}, want{bound: BoundPoolBytes, perGPU: []int64{3 * gib, 3 * gib}}},
		{"huge pages preferred: 2Mi on node 0, 1Gi on node 1", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(40 * gib)
			s.HugePages = config.HugePagesPrefer
		}, want{bound: BoundPoolBytes, perGPU: []int64{20 * gib, 20 * gib}, pages: []int64{2 * mib, gib}}},
		{"huge pages short: fallback with a warning", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(200 * gib) // node 1 has 64 1Gi pages, needs 100
			s.HugePages = config.HugePagesPrefer
		}, want{bound: BoundPoolBytes, perGPU: []int64{100 * gib, 100 * gib}, pages: []int64{4096, 4096},
			warn: "GPU 0: not enough huge pages on NUMA node 0 for 100Gi (0 free 1Gi pages of 100 needed, 10240 free 2Mi pages of 51200 needed); using 4Ki pages\nGPU 1: not enough huge pages on NUMA node 1 for 100Gi (64 free 1Gi pages of 100 needed, 100 free 2Mi pages of 51200 needed); using 4Ki pages"}},
		{"huge pages shared by GPUs on one node", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(24 * gib)
			s.HugePages = config.HugePagesPrefer
			in.GPUs[1].NUMA = 0 // both on node 0: 10240 2Mi pages = 20Gi, enough for one
		}, want{bound: BoundPoolBytes, perGPU: []int64{12 * gib, 12 * gib}, pages: []int64{2 * mib, 4096},
			warn: "GPU 1: not enough huge pages on NUMA node 0 for 12Gi (0 free 1Gi pages of 12 needed, 4096 free 2Mi pages of 6144 needed)"}},
		{"unknown NUMA uses the system pool", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(4 * gib)
			s.HugePages = config.HugePagesRequire
			in.GPUs[0].NUMA, in.GPUs[1].NUMA = -1, -1
		}, want{bound: BoundPoolBytes, perGPU: []int64{2 * gib, 2 * gib}, pages: []int64{gib, gib}}},
		{"chunk not a multiple of 1Gi uses 2Mi", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(2 * gib)
			s.ChunkBytes = config.Bytes(512 * mib)
			s.HugePages = config.HugePagesRequire
			in.GPUs[1].NUMA = 0
		}, want{bound: BoundPoolBytes, perGPU: []int64{gib, gib}, pages: []int64{2 * mib, 2 * mib}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := policy()
			in := Input{Node: host(), GPUs: twoGPUs(), PageSize: 4096}
			c.edit(&s, &in)
			p, err := Make(s, in)
			if err != nil {
				t.Fatal(err)
			}
			if p.Bound != c.want.bound {
				t.Errorf("bound %q, want %q (limits %+v)", p.Bound, c.want.bound, p.Limits)
			}
			var total int64
			for i, g := range p.GPUs {
				total += g.Bytes
				if g.Bytes != c.want.perGPU[i] || g.Chunks != int(g.Bytes/p.ChunkBytes) || g.Bytes%p.ChunkBytes != 0 {
					t.Errorf("GPU %d: %d bytes in %d chunks, want %d bytes", i, g.Bytes, g.Chunks, c.want.perGPU[i])
				}
				wb := c.want.bound
				if c.want.gpuBound != nil {
					wb = c.want.gpuBound[i]
				}
				if g.Bound != wb {
					t.Errorf("GPU %d bound %q, want %q", i, g.Bound, wb)
				}
				wp := int64(4096)
				if c.want.pages != nil {
					wp = c.want.pages[i]
				}
				if g.PageSize != wp {
					t.Errorf("GPU %d page size %d, want %d", i, g.PageSize, wp)
				}
			}
			if total != p.Total {
				t.Errorf("Total %d, sum %d", p.Total, total)
			}
			warns := strings.Join(p.Warnings, "\n")
			if (c.want.warn == "") != (warns == "") || !strings.Contains(warns, c.want.warn) {
				t.Errorf("warnings %q, want %q", warns, c.want.warn)
			}
			checkBounds(t, s, in, p)
		})
	}
}

// checkBounds asserts the plan's promises against its inputs: ordinary
// pages fit every bound, huge pages fit what is free, and the policy's
// caps hold.
func checkBounds(t *testing.T, s config.Sizing, in Input, p *Plan) {
	t.Helper()
	var regular, huge int64
	hugeUsed := map[[2]int64]int64{}
	for _, g := range p.GPUs {
		if g.PageSize > 4096 {
			huge += g.Bytes
			hugeUsed[[2]int64{int64(g.NUMA), g.PageSize}] += g.Bytes / g.PageSize
		} else {
			regular += g.Bytes
		}
	}
	for k, pages := range hugeUsed {
		if free := in.Node.HugeFree(int(k[0]), k[1]); pages > free {
			t.Errorf("%d huge pages of %d planned on node %d, %d free", pages, k[1], k[0], free)
		}
	}
	if regular > max(in.Node.MemAvailable-int64(s.ReserveBytes), 0) {
		t.Errorf("ordinary pages %d exceed MemAvailable %d - reserve %d", regular, in.Node.MemAvailable, s.ReserveBytes)
	}
	if in.Node.Cgroup.Limit != node.Unlimited && regular > max(in.Node.Cgroup.Limit-int64(s.CgroupHeadroomBytes), 0) {
		t.Errorf("ordinary pages %d exceed cgroup limit %d - headroom %d", regular, in.Node.Cgroup.Limit, s.CgroupHeadroomBytes)
	}
	if in.Allocatable > 0 && regular > in.Allocatable {
		t.Errorf("ordinary pages %d exceed allocatable %d", regular, in.Allocatable)
	}
	if s.PoolBytes > 0 && p.Total > int64(s.PoolBytes) {
		t.Errorf("total %d exceeds poolBytes %d", p.Total, s.PoolBytes)
	}
	if p.Total != regular+huge {
		t.Errorf("total %d, GPUs add up to %d", p.Total, regular+huge)
	}
	for _, g := range p.GPUs {
		if s.MaxPerGPU > 0 && g.Bytes > int64(s.MaxPerGPU) {
			t.Errorf("GPU %d: %d over maxPerGPU", g.GPU, g.Bytes)
		}
		if g.Bytes < int64(s.MinPerGPU) || g.Chunks < 1 {
			t.Errorf("GPU %d: %d under minPerGPU or no chunk", g.GPU, g.Bytes)
		}
	}
}

// hugeHost has 32Gi of MemAvailable over the reserve, 20Gi of 2Mi pages
// free on node 0 and 64Gi of 1Gi pages free on node 1.
func hugeHost() *node.Info {
	n := host()
	n.MemAvailable = 40 * gib
	n.HugePages = []node.HugePool{{PageSize: 2 * mib, Total: 10240, Free: 10240}, {PageSize: gib, Total: 64, Free: 64}}
	n.NUMANodes[1].HugePages = []node.HugePool{{PageSize: gib, Total: 64, Free: 64}}
	return n
}

func TestMakeHugePagesWidenBounds(t *testing.T) {
	s := policy()
	s.HugePages = config.HugePagesPrefer
	s.PoolBytes = config.Bytes(100 * gib)
	in := Input{Node: hugeHost(), GPUs: twoGPUs(), PageSize: 4096}
	p, err := Make(s, in)
	if err != nil {
		t.Fatal(err)
	}
	// 32Gi + 84Gi of huge pages is more than 100Gi: poolBytes binds, 50Gi
	// each. GPU 0's node has only 20Gi of huge pages: ordinary pages, cut
	// to the 32Gi left under MemAvailable - reserve. GPU 1 takes 50 of
	// node 1's 1Gi pages.
	if p.Bound != BoundPoolBytes {
		t.Errorf("bound %q, limits %+v", p.Bound, p.Limits)
	}
	g0, g1 := p.GPUs[0], p.GPUs[1]
	if g0.PageSize != 4096 || g0.Bytes != 32*gib || g0.Bound != BoundAvailable {
		t.Errorf("GPU 0 %+v", g0)
	}
	if g1.PageSize != gib || g1.Bytes != 50*gib || g1.Bound != BoundPoolBytes {
		t.Errorf("GPU 1 %+v", g1)
	}
	if !strings.Contains(p.Limits[1].How, "40Gi - 8Gi + 84Gi free huge pages") {
		t.Errorf("MemAvailable limit reads %q", p.Limits[1].How)
	}
	checkBounds(t, s, in, p)

	// The same node with huge pages off: MemAvailable - reserve binds.
	s.HugePages = config.HugePagesNever
	p, err = Make(s, in)
	if err != nil {
		t.Fatal(err)
	}
	if p.Bound != BoundAvailable || p.Total != 32*gib {
		t.Errorf("without huge pages: bound %q total %d", p.Bound, p.Total)
	}

	// Only huge pages left: a GPU without them cannot have ordinary pages.
	s.HugePages = config.HugePagesPrefer
	in.Node.MemAvailable = 8 * gib
	_, err = Make(s, in)
	if err == nil || !strings.Contains(err.Error(), "GPU 0 has no huge pages and no room for one chunk of ordinary pages: MemAvailable - sizing.reserveBytes is 8Gi - 8Gi, 0 of it left for 4 KiB pages") {
		t.Errorf("err %v", err)
	}
}

func TestMakeErrors(t *testing.T) {
	cases := []struct {
		name string
		edit func(*config.Sizing, *Input)
		want string
	}{
		{"reserve above MemAvailable", func(s *config.Sizing, in *Input) {
			in.Node.MemAvailable = 6 * gib
		}, "no room for even one chunk (1Gi): MemAvailable - sizing.reserveBytes is 6Gi - 8Gi = -2Gi"},
		{"a chunk too small for the pool", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(1024 * gib)
			s.ChunkBytes = config.Bytes(2 * mib)
		}, "sizing: too many chunks: 1Ti in 524288 chunks of 2Mi, more than the 16384 an agent serves (kubelet's device list, the chunks' memfds and their mappings grow with them): set sizing.chunkBytes to 64Mi or more"},
		{"two chunks past the most", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(32*gib + 4*mib)
			s.ChunkBytes = config.Bytes(2 * mib)
		}, "in 16386 chunks of 2Mi, more than the 16384 an agent serves (kubelet's device list, the chunks' memfds and their mappings grow with them): set sizing.chunkBytes to 4Mi or more"},
		{"reserve above MemAvailable with poolBytes", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(8 * gib)
			in.Node.MemAvailable = 6 * gib
		}, "no room for even one chunk (1Gi): MemAvailable - sizing.reserveBytes is 6Gi - 8Gi = -2Gi"},
		{"cgroup limit below headroom", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(8 * gib)
			in.Node.Cgroup.Limit = 256 * mib
		}, BoundCgroup + " is 256Mi - 512Mi - 0 - 0 = -256Mi"},
		{"less than a chunk per GPU", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(40 * gib)
			in.Allocatable = 1536 * mib
		}, "GPU 0 would get 768Mi, less than one chunk (sizing.chunkBytes 1Gi); bound by node allocatable memory (1.5Gi / 2 GPUs)"},
		{"minPerGPU not met", func(s *config.Sizing, in *Input) {
			s.MinPerGPU = config.Bytes(8 * gib)
			in.Node.MemAvailable = 20 * gib
		}, "GPU 0 would get 3Gi, less than sizing.minPerGPU 8Gi; bound by sizing.fraction (6Gi / 2 GPUs)"},
		{"minPerGPU not met on the small GPU", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(40 * gib)
			s.MinPerGPU = config.Bytes(12 * gib)
			s.Split = config.SplitMemory
			in.GPUs[0].Memory = 16 * gib
		}, "GPU 0 would get 6Gi, less than sizing.minPerGPU 12Gi; bound by sizing.poolBytes (40Gi x 16Gi / 96Gi of GPU memory)"},
		{"huge pages required", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(200 * gib)
			s.HugePages = config.HugePagesRequire
		}, `GPU 0: not enough huge pages on NUMA node 0 for 100Gi (0 free 1Gi pages of 100 needed, 10240 free 2Mi pages of 51200 needed), and sizing.hugePages is "require"`},
		{"huge pages required, none", func(s *config.Sizing, in *Input) {
			s.PoolBytes = config.Bytes(2 * gib)
			s.HugePages = config.HugePagesRequire
			in.Node.NUMANodes, in.Node.HugePages = nil, nil
			in.GPUs[0].NUMA = -1
		}, "GPU 0: not enough huge pages on the node (NUMA unknown) for 1Gi (0 free 1Gi pages of 1 needed, 0 free 2Mi pages of 512 needed)"},
		{"no GPUs", func(s *config.Sizing, in *Input) { in.GPUs = nil }, "no GPUs"},
		{"duplicate GPU", func(s *config.Sizing, in *Input) { in.GPUs[1].Index = 0 }, "GPU index 0 is negative or listed twice"},
		{"memory split without memory", func(s *config.Sizing, in *Input) {
			s.Split = config.SplitMemory
			in.GPUs[1].Memory = 0
		}, `sizing.split is "memory" but GPU 1 reports no device memory`},
		{"no node", func(s *config.Sizing, in *Input) { in.Node = nil }, "no node information"},
		{"zero chunk", func(s *config.Sizing, in *Input) { s.ChunkBytes = 0 }, "sizing.chunkBytes must be positive"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := policy()
			in := Input{Node: host(), GPUs: twoGPUs(), PageSize: 4096}
			c.edit(&s, &in)
			p, err := Make(s, in)
			if err == nil {
				t.Fatalf("Make = %+v, want an error", p)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("error\n%q\ndoes not contain\n%q", err, c.want)
			}
		})
	}
}

func TestMakeDoesNotChangeInputs(t *testing.T) {
	s := policy()
	s.HugePages = config.HugePagesPrefer
	in := Input{Node: host(), GPUs: []GPU{{Index: 1, NUMA: 1, Memory: gib}, {Index: 0, NUMA: 0, Memory: gib}}}
	before := *in.Node
	gpus := append([]GPU(nil), in.GPUs...)
	p, err := Make(s, in)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(before, *in.Node) || !reflect.DeepEqual(gpus, in.GPUs) {
		t.Error("Make changed its inputs")
	}
	if p.GPUs[0].GPU != 0 || p.GPUs[1].GPU != 1 {
		t.Errorf("plan not in GPU order: %+v", p.GPUs)
	}
}

func TestChunkIDs(t *testing.T) {
	if got := (GPUPlan{GPU: 0, NUMA: 1, Chunks: 3}).ChunkIDs(); !reflect.DeepEqual(got, []string{"gpu0-numa1-0", "gpu0-numa1-1", "gpu0-numa1-2"}) {
		t.Errorf("ChunkIDs = %v", got)
	}
	if got := contract.ChunkID(3, -1, 7); got != "gpu3-numaX-7" {
		t.Errorf("ChunkID = %q", got)
	}
}

func TestStandalone(t *testing.T) {
	c := config.Default()
	s := Standalone(&c, 2)
	if s.PoolBytes != 512*config.MiB || s.ChunkBytes != 64*config.MiB {
		t.Errorf("standalone sizing %+v", s)
	}
	in := Input{Node: host(), GPUs: twoGPUs()}
	s.HugePages = config.HugePagesNever
	p, err := Make(s, in)
	if err != nil {
		t.Fatal(err)
	}
	if p.Total != 512*mib || p.GPUs[0].Chunks != 4 {
		t.Errorf("standalone plan %+v", p)
	}
	c.Standalone.PoolBytes = 4 * config.MiB
	if s := Standalone(&c, 8); s.ChunkBytes != 2*config.MiB {
		t.Errorf("tiny standalone chunk %v", s.ChunkBytes)
	}
}

// TestPlanAllocates runs a small plan's specs through hostmem on this
// machine: every chunk comes back, named, sized, locked and on the page
// size and NUMA node planned (or with a warning saying why not).
func TestPlanAllocates(t *testing.T) {
	info, err := node.Read("/")
	if err != nil {
		t.Fatal(err)
	}
	numa := -1
	if len(info.NUMANodes) > 0 {
		numa = info.NUMANodes[0].ID
	}
	s := policy()
	s.PoolBytes = config.Bytes(16 * mib)
	s.ChunkBytes = config.Bytes(4 * mib)
	s.ReserveBytes = 0
	p, err := Make(s, Input{Node: info, GPUs: []GPU{{Index: 0, NUMA: numa}, {Index: 1, NUMA: -1}}})
	if err != nil {
		t.Fatal(err)
	}
	specs := p.Specs(s.HugePages, NodeWorkers(info))
	// The GPUs in turn: each has a chunk after the first round.
	want := []string{contract.ChunkID(0, numa, 0), "gpu1-numaX-0", contract.ChunkID(0, numa, 1), "gpu1-numaX-1"}
	if len(specs) != 4 {
		t.Fatalf("specs %+v", specs)
	}
	for i, sp := range specs {
		if sp.ID != want[i] || sp.Workers < 1 {
			t.Errorf("spec %d: %s with %d workers, want %s", i, sp.ID, sp.Workers, want[i])
		}
	}
	if numa >= 0 && len(specs[0].CPUs) == 0 && info.NUMANodes[0].CPUs != "" {
		t.Errorf("spec %s: no CPUs though node %d lists %q", specs[0].ID, numa, info.NUMANodes[0].CPUs)
	}
	if len(specs[1].CPUs) != 0 {
		t.Errorf("spec %s of an unknown node bound to CPUs %v", specs[1].ID, specs[1].CPUs)
	}
	for r := range hostmem.AllocateAll(context.Background(), specs, slog.New(slog.DiscardHandler)) {
		if r.Err != nil {
			t.Fatal(r.Err)
		}
		c := r.Chunk
		if c.Size != 4*mib || (!c.Locked && len(c.Warnings) == 0) {
			t.Errorf("%s: %+v", r.ID, c)
		}
		if strings.HasPrefix(r.ID, "gpu0-") && numa >= 0 && c.Node != numa && len(c.Warnings) == 0 {
			t.Errorf("%s not bound to node %d and no warning", r.ID, numa)
		}
		if strings.HasPrefix(r.ID, "gpu1-") && c.Node != -1 {
			t.Errorf("%s bound to %d though its NUMA node is unknown", r.ID, c.Node)
		}
		c.Close()
	}
}

// TestPageTablesInTheCgroupBound: a cgroup limit of pool + PageTableBytes
// (pool) + LinkBytes(pool) + headroom, what the chart gives the agent,
// plans exactly the pool it asks for, whatever its size; without the page
// tables and links a pool is cut to what leaves room for them (they would
// otherwise come out of the headroom: all of the default 512Mi for a
// 256Gi pool of 4 KiB pages, and as much again for 2 KiB engine pages).
func TestPageTablesInTheCgroupBound(t *testing.T) {
	for _, c := range []struct{ pool, chunk int64 }{
		{16 * gib, gib}, {256 * gib, gib}, {1024 * gib, gib}, {7 * 1024 * gib, 2 * gib},
		{100_000_000_000, 8 * mib}, {2 * mib, 2 * mib}, {3*gib + 6*mib, 2 * mib},
	} {
		s := policy()
		s.PoolBytes = config.Bytes(c.pool)
		s.ChunkBytes = config.Bytes(c.chunk)
		in := Input{Node: host(), GPUs: twoGPUs()[:1], PageSize: 4096}
		in.Node.MemAvailable = 16 * 1024 * gib
		in.Node.Cgroup.Limit = c.pool + PageTableBytes(c.pool) + LinkBytes(c.pool) + int64(s.CgroupHeadroomBytes)
		p, err := Make(s, in)
		want := c.pool / c.chunk * c.chunk
		if err != nil || p.Total != want || p.Bound != BoundPoolBytes {
			t.Errorf("pool %d with its page tables in the limit: %d bytes bound by %q (%v), want %d by %s", c.pool, p.Total, p.Bound, err, want, BoundPoolBytes)
		}
		in.Node.Cgroup.Limit = c.pool + int64(s.CgroupHeadroomBytes)
		p, err = Make(s, in)
		if c.pool >= 2*c.chunk && (err != nil || p.Total >= c.pool || p.Bound != BoundCgroup) {
			t.Errorf("pool %d without its page tables in the limit: %d bytes bound by %q (%v), want less, by the cgroup", c.pool, p.Total, p.Bound, err)
		}
	}
	if PageTableBytes(1024*gib) != 2*gib || PageTableBytes(1) != 1 || PageTableBytes(0) != 0 {
		t.Errorf("PageTableBytes: 1Ti %d, 1 byte %d, none %d", PageTableBytes(1024*gib), PageTableBytes(1), PageTableBytes(0))
	}
	if LinkBytes(1024*gib) != gib || LinkBytes(gib) != 16*mib || LinkBytes(0) != 16*mib {
		t.Errorf("LinkBytes: 1Ti %d, 1Gi %d, none %d; want 1Gi, and 16Mi at least", LinkBytes(1024*gib), LinkBytes(gib), LinkBytes(0))
	}
}
