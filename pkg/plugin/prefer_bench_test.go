package plugin

import (
	"slices"
	"testing"

	"github.com/kvpool/kvpool/pkg/contract"
)

// benchDevices is a large node: 8 GPUs on 2 NUMA nodes, 256 chunks each,
// every third chunk already taken.
func benchDevices() (avail []string, numa map[string]int) {
	numa = make(map[string]int)
	for g := range 8 {
		for i := range 256 {
			if i%3 == 0 {
				continue
			}
			id := contract.ChunkID(g, g/4, i)
			avail = append(avail, id)
			numa[id] = g / 4
		}
	}
	return avail, numa
}

// BenchmarkPrefer picks 64 of 1,368 chunks with one must-include chunk.
// Compare with BenchmarkPreferFloor, which only sorts the same IDs (the
// least any choice over them must do); report the ratio.
func BenchmarkPrefer(b *testing.B) {
	avail, numa := benchDevices()
	must := []string{avail[len(avail)/2]}
	for b.Loop() {
		if _, err := Prefer(avail, must, 64, numa); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkPreferFloor(b *testing.B) {
	avail, _ := benchDevices()
	buf := make([]string, len(avail))
	for b.Loop() {
		copy(buf, avail)
		slices.Sort(buf)
	}
	b.ReportMetric(float64(len(avail)), "devices")
}
