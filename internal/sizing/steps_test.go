package sizing

import (
	"strings"
	"testing"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/node"
)

// The steps of Make, one test each (Make's own tests are in sizing_test.go).

func TestCheckInput(t *testing.T) {
	ok := Input{Node: host(), GPUs: twoGPUs()}
	if err := checkInput(policy(), ok); err != nil {
		t.Fatalf("a good input: %v", err)
	}
	for _, c := range []struct {
		name string
		edit func(*config.Sizing, *Input)
		want string
	}{
		{"no node", func(_ *config.Sizing, in *Input) { in.Node = nil }, "no node information"},
		{"no GPUs", func(_ *config.Sizing, in *Input) { in.GPUs = nil }, "no GPUs"},
		{"negative index", func(_ *config.Sizing, in *Input) { in.GPUs[1].Index = -1 }, "GPU index -1 is negative or listed twice"},
		{"index twice", func(_ *config.Sizing, in *Input) { in.GPUs[1].Index = 0 }, "GPU index 0 is negative or listed twice"},
		{"memory split without memory", func(s *config.Sizing, in *Input) {
			s.Split = config.SplitMemory
			in.GPUs[1].Memory = 0
		}, `sizing.split is "memory" but GPU 1 reports no device memory`},
		{"no chunk size", func(s *config.Sizing, _ *Input) { s.ChunkBytes = 0 }, "sizing.chunkBytes must be positive"},
	} {
		s, in := policy(), Input{Node: host(), GPUs: twoGPUs()}
		c.edit(&s, &in)
		err := checkInput(s, in)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want it to say %q", c.name, err, c.want)
		}
	}
}

func TestHugeBudget(t *testing.T) {
	n := host() // 10340 free 2Mi pages and 64 free 1Gi pages on the node
	s := policy()
	if b := hugeBudget(s, n, gib); b != 0 {
		t.Errorf("hugePages never: budget %d, want 0", b)
	}
	s.HugePages = config.HugePagesPrefer
	if b, want := hugeBudget(s, n, gib), 64*gib+10340*2*mib; b != want {
		t.Errorf("1Gi chunks: budget %d, want %d (both sizes)", b, want)
	}
	if b, want := hugeBudget(s, n, 512*mib), 10340*2*mib; b != want {
		t.Errorf("512Mi chunks: budget %d, want %d (1Gi pages do not divide the chunk)", b, want)
	}
	if b := hugeBudget(s, n, 3*mib); b != 0 {
		t.Errorf("3Mi chunks: budget %d, want 0 (no huge page size divides the chunk)", b)
	}
}

func TestHardBounds(t *testing.T) {
	s := policy() // reserve 8Gi, cgroup headroom 512Mi
	n := host()
	n.MemAvailable = 100 * gib
	n.Cgroup.Limit = 50 * gib
	hard, regular := hardBounds(s, Input{Node: n, Allocatable: 60 * gib}, 0)
	// The cgroup bound leaves room for the page tables of the agent's
	// mapping and the sessions' page links: the largest pool that fits
	// with them in 49.5Gi.
	room := 50*gib - 512*mib
	cg := hard[1].Bytes
	with := func(x, huge int64) int64 { return x + PageTableBytes(x) + LinkBytes(x+huge) }
	if with(cg, 0) > room || with(cg+1, 0) <= room {
		t.Errorf("cgroup bound %d: with its page tables and links %d, room %d", cg, with(cg, 0), room)
	}
	want := []Limit{
		{BoundAvailable, 92 * gib, "100Gi - 8Gi"},
		{BoundCgroup, cg, "50Gi - 512Mi - 98.7Mi - 49.4Mi"},
		{BoundAllocatable, 60 * gib, "60Gi"},
	}
	if len(hard) != len(want) {
		t.Fatalf("bounds %+v, want %+v", hard, want)
	}
	for i := range want {
		if hard[i] != want[i] {
			t.Errorf("bound %d: %+v, want %+v", i, hard[i], want[i])
		}
	}
	if regular != want[1] {
		t.Errorf("regular %+v, want the cgroup bound", regular)
	}

	// Free huge pages widen every bound, but not the budget for ordinary
	// pages, which keeps room for the huge pages' links too.
	hard, regular = hardBounds(s, Input{Node: n, Allocatable: 60 * gib}, 4*gib)
	if hard[0].Bytes != 96*gib || hard[0].How != "100Gi - 8Gi + 4Gi free huge pages" || hard[2].Bytes != 64*gib {
		t.Errorf("widened bounds %+v", hard)
	}
	if cg := regular.Bytes; regular.Name != BoundCgroup || with(cg, 4*gib) > room || with(cg+1, 4*gib) <= room || hard[1].Bytes != cg+4*gib {
		t.Errorf("regular %+v, want the cgroup bound with the huge pages' links, widened by them to %d", regular, hard[1].Bytes)
	}

	// No cgroup limit and no cluster: MemAvailable alone.
	n.Cgroup.Limit = node.Unlimited
	if hard, _ = hardBounds(s, Input{Node: n}, 0); len(hard) != 1 || hard[0].Name != BoundAvailable {
		t.Errorf("unbounded node: %+v", hard)
	}
}

func TestTightest(t *testing.T) {
	a, b, c := Limit{Name: "a", Bytes: 5}, Limit{Name: "b", Bytes: 3}, Limit{Name: "c", Bytes: 3}
	if got := tightest([]Limit{a, b, c}); got.Name != "b" {
		t.Errorf("tightest = %s, want b (the first of the smallest)", got.Name)
	}
	if got := tightest([]Limit{a}); got.Name != "a" {
		t.Errorf("tightest of one = %s", got.Name)
	}
}

func TestPolicyTarget(t *testing.T) {
	s := policy()
	usable := Limit{BoundCgroup, 64 * gib, "64.5Gi - 512Mi"}
	if got, want := policyTarget(s, usable), (Limit{BoundFraction, 32 * gib, "0.5 x 64Gi (" + BoundCgroup + ")"}); got != want {
		t.Errorf("fraction: %+v, want %+v", got, want)
	}
	if got := policyTarget(s, Limit{BoundAvailable, -gib, ""}); got.Bytes != 0 || got.How != "0.5 x 0 ("+BoundAvailable+")" {
		t.Errorf("fraction of a negative bound: %+v, want 0", got)
	}
	s.PoolBytes = config.Bytes(100 * gib)
	if got, want := policyTarget(s, usable), (Limit{BoundPoolBytes, 100 * gib, "100Gi"}); got != want {
		t.Errorf("poolBytes: %+v, want %+v (the target, whatever the bounds)", got, want)
	}
}

func TestSplitShares(t *testing.T) {
	s := policy()
	bound := Limit{Name: BoundPoolBytes, Bytes: 30 * gib}
	gpus := []GPU{{Index: 0, Memory: 40 * gib}, {Index: 1, Memory: 80 * gib}, {Index: 2, Memory: 120 * gib}}
	check := func(name string, got []share, want ...share) {
		t.Helper()
		for i := range want {
			if got[i] != want[i] {
				t.Errorf("%s: GPU %d share %+v, want %+v", name, i, got[i], want[i])
			}
		}
	}
	even := share{10 * gib, BoundPoolBytes, "30Gi / 3 GPUs"}
	check("equal", splitShares(s, bound, gpus), even, even, even)

	s.Split = config.SplitMemory
	how := "30Gi x %s / 240Gi of GPU memory"
	check("memory", splitShares(s, bound, gpus),
		share{5 * gib, BoundPoolBytes, strings.Replace(how, "%s", "40Gi", 1)},
		share{10 * gib, BoundPoolBytes, strings.Replace(how, "%s", "80Gi", 1)},
		share{15 * gib, BoundPoolBytes, strings.Replace(how, "%s", "120Gi", 1)})

	s.MaxPerGPU = config.Bytes(12 * gib)
	capped := share{12 * gib, BoundMaxPerGPU, "12Gi"}
	got := splitShares(s, bound, gpus)
	check("memory, capped", got, share{5 * gib, BoundPoolBytes, strings.Replace(how, "%s", "40Gi", 1)}, got[1], capped)
}

func TestCutChunks(t *testing.T) {
	s := policy()
	g := GPU{Index: 3, UUID: "GPU-3", NUMA: 1}
	gp, err := cutChunks(s, g, share{5*gib + 100*mib, BoundFraction, "x"}, gib)
	if err != nil || gp.Chunks != 5 || gp.Bytes != 5*gib || gp.Bound != BoundFraction || gp.GPU != 3 || gp.UUID != "GPU-3" || gp.NUMA != 1 {
		t.Errorf("cut 5.1Gi into 1Gi chunks: %+v %v", gp, err)
	}
	if _, err := cutChunks(s, g, share{gib - 1, BoundFraction, "1Gi / 1 GPUs"}, gib); err == nil ||
		!strings.Contains(err.Error(), "GPU 3 would get 1024.0Mi, less than one chunk (sizing.chunkBytes 1Gi); bound by sizing.fraction (1Gi / 1 GPUs)") {
		t.Errorf("less than a chunk: %v", err)
	}
	s.MinPerGPU = config.Bytes(6 * gib)
	if _, err := cutChunks(s, g, share{6*gib - 1, BoundMaxPerGPU, "6Gi"}, gib); err == nil ||
		!strings.Contains(err.Error(), "GPU 3 would get 5Gi, less than sizing.minPerGPU 6Gi; bound by sizing.maxPerGPU (6Gi)") {
		t.Errorf("below minPerGPU: %v", err)
	}
}

func TestFitOrdinary(t *testing.T) {
	s := policy()
	regular := Limit{BoundCgroup, 10 * gib, "10.5Gi - 512Mi"}
	gp := GPUPlan{GPU: 1, Bytes: 8 * gib, Chunks: 8, Bound: BoundPoolBytes}
	if got, err := fitOrdinary(s, gp, regular, 8*gib, gib); err != nil || got != gp {
		t.Errorf("fits: %+v %v, want it unchanged", got, err)
	}
	got, err := fitOrdinary(s, gp, regular, 5*gib+gib/2, gib)
	if err != nil || got.Chunks != 5 || got.Bytes != 5*gib || got.Bound != BoundCgroup {
		t.Errorf("shrunk to what is left: %+v %v", got, err)
	}
	if _, err := fitOrdinary(s, gp, regular, -gib, gib); err == nil ||
		!strings.Contains(err.Error(), "GPU 1 has no huge pages and no room for one chunk of ordinary pages: "+BoundCgroup+" is 10.5Gi - 512Mi, 0 of it left") {
		t.Errorf("nothing left: %v", err)
	}
	s.MinPerGPU = config.Bytes(6 * gib)
	if _, err := fitOrdinary(s, gp, regular, 5*gib, gib); err == nil ||
		!strings.Contains(err.Error(), "GPU 1 would get 5Gi of ordinary pages, less than sizing.minPerGPU 6Gi") {
		t.Errorf("below minPerGPU: %v", err)
	}
}
