package cudart_test

import (
	"testing"

	"github.com/kvpool/kvpool/internal/gpu"
	"github.com/kvpool/kvpool/pkg/cudart"
)

// TestSimulatedUUIDsAgree: the simulator's device i and the agent's
// simulated GPU i (internal/gpu) carry the same UUID, and SimOptions.UUIDs names
// devices as a container sees some of the host's GPUs.
func TestSimulatedUUIDsAgree(t *testing.T) {
	sim := cudart.NewSim(cudart.SimOptions{Devices: 3, MemoryBytes: 1 << 20})
	plan := gpu.Simulated(3, 1<<30, nil)
	seen := map[string]bool{}
	for i := range 3 {
		dev, err := sim.Open(i)
		if err != nil {
			t.Fatal(err)
		}
		if dev.UUID() != plan[i].UUID || dev.UUID() != cudart.SimulatedUUID(i) {
			t.Fatalf("device %d: simulator %q, internal/gpu %q", i, dev.UUID(), plan[i].UUID)
		}
		if seen[dev.UUID()] {
			t.Fatalf("UUID %s repeats", dev.UUID())
		}
		seen[dev.UUID()] = true
	}
	pod := cudart.NewSim(cudart.SimOptions{Devices: 3, MemoryBytes: 1 << 20, UUIDs: []string{plan[2].UUID, plan[1].UUID}})
	for i, want := range []string{plan[2].UUID, plan[1].UUID, cudart.SimulatedUUID(2)} {
		dev, _ := pod.Open(i)
		if dev.UUID() != want {
			t.Fatalf("pod device %d: %q, want %q", i, dev.UUID(), want)
		}
	}
}

func TestFormatUUID(t *testing.T) {
	b := [16]byte{0x66, 0x61, 0x6b, 0x65, 0x63, 0x75, 0x64, 0x61, 0, 0, 0, 0, 0, 0, 0x01, 0xff}
	if got, want := cudart.FormatUUID(b), "GPU-66616b65-6375-6461-0000-0000000001ff"; got != want {
		t.Fatalf("%s, want %s", got, want)
	}
}
