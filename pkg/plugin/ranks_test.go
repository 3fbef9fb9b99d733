package plugin

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/kvpool/kvpool/pkg/contract"
)

// ContainerGPUs asks kubelet's PodResources (the test server, over gRPC)
// which GPU devices the container holding an allocation has: whole GPUs,
// replicas and MIG devices of the configured resources, no others; the
// answer is kept; a pod not listed yet, or a failed call, is no answer.
func TestContainerGPUs(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	tp := e.mustAllocate(contract.ChunkID(0, 0, 0), contract.ChunkID(0, 0, 1))
	solo := e.mustAllocate(contract.ChunkID(1, 1, 0))
	cpu := e.mustAllocate(contract.ChunkID(1, 1, 1))
	tpID, soloID, cpuID := AllocationID(tp), AllocationID(solo), AllocationID(cpu)
	if _, known, err := e.p.ContainerGPUs(ctx, tpID); known || err != nil {
		t.Fatalf("before the pod is listed: known %v, %v", known, err)
	}
	e.prs.SetPods(map[string]map[string][]string{
		"tp": {contract.DefaultResourceName: {contract.ChunkID(0, 0, 0), contract.ChunkID(0, 0, 1)},
			"nvidia.com/gpu":         {"GPU-aaa", "GPU-bbb::1"},
			"nvidia.com/mig-1g.10gb": {"MIG-ccc"},
			"example.com/nic":        {"nic-0"}},
		"solo": {contract.DefaultResourceName: {contract.ChunkID(1, 1, 0)}, "nvidia.com/gpu": {"GPU-ddd"}},
		"cpu":  {contract.DefaultResourceName: {contract.ChunkID(1, 1, 1)}},
	})
	for _, c := range []struct {
		id   string
		want []string
	}{{tpID, []string{"GPU-aaa", "GPU-bbb::1", "MIG-ccc"}}, {soloID, []string{"GPU-ddd"}}, {cpuID, nil}} {
		ids, known, err := e.p.ContainerGPUs(ctx, c.id)
		slices.Sort(ids)
		if !known || err != nil || !slices.Equal(ids, c.want) {
			t.Errorf("ContainerGPUs(%s) = %v, %v, %v; want %v", c.id, ids, known, err, c.want)
		}
	}
	// Kept: kubelet is not asked again (it fails now, and lists nothing).
	e.prs.SetPods(nil)
	e.prs.SetFail(errors.New("kubelet is restarting"))
	if ids, known, err := e.p.ContainerGPUs(ctx, soloID); !known || err != nil || !slices.Equal(ids, []string{"GPU-ddd"}) {
		t.Errorf("kept answer: %v, %v, %v", ids, known, err)
	}
	other := e.mustAllocate(contract.ChunkID(1, 1, 2))
	if _, known, err := e.p.ContainerGPUs(ctx, AllocationID(other)); known || err == nil {
		t.Errorf("with PodResources failing: known %v, err %v", known, err)
	}
	if _, _, err := e.p.ContainerGPUs(ctx, "alloc-0000000000000000"); err == nil {
		t.Error("an unknown allocation gave no error")
	}
}

func TestMatchResource(t *testing.T) {
	names := []string{"nvidia.com/gpu", "nvidia.com/mig-*"}
	for r, want := range map[string]bool{
		"nvidia.com/gpu": true, "nvidia.com/gpu.shared": false, "nvidia.com/mig-1g.5gb": true,
		"nvidia.com/mig-": true, "nvidia.com/migx": false, "amd.com/gpu": false, "": false,
	} {
		if got := MatchResource(r, names); got != want {
			t.Errorf("MatchResource(%q) = %v", r, got)
		}
	}
}
