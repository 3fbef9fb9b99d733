package python

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"testing"
	"time"

	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
)

// copyBench is what python/gpu_check.py asks of the Go client: the
// realistic layout as one device tensor [regions, pages, page bytes] and a
// stream of n pages moved each way, reps times.
type copyBench struct {
	Backend     string `json:"backend"`
	Device      int    `json:"device"`
	Regions     int    `json:"regions"`
	DevicePages int    `json:"device_pages"`
	PageBytes   uint64 `json:"page_bytes"`
	Pages       int    `json:"pages"`
	Reps        int    `json:"reps"`
}

// TestGoClientCopyBench runs only when gpu_check.py starts this test binary
// with KVPOOL_GO_COPY_BENCH set to a copyBench in JSON; it prints the
// median seconds per batch of each direction as one JSON line.
func TestGoClientCopyBench(t *testing.T) {
	spec := os.Getenv("KVPOOL_GO_COPY_BENCH")
	if spec == "" {
		t.Skip("run by python/gpu_check.py")
	}
	var c copyBench
	if err := json.Unmarshal([]byte(spec), &c); err != nil {
		t.Fatal(err)
	}
	drv, choice, err := cudart.Load(cudart.Options{Backend: c.Backend})
	if err != nil {
		t.Fatal(err)
	}
	dev, err := drv.Open(c.Device)
	if err != nil {
		t.Fatal(err)
	}
	regionBytes := uint64(c.DevicePages) * c.PageBytes
	base, err := dev.MemAlloc(uint64(c.Regions) * regionBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.MemFree(base)
	regions := make([]cudart.Region, c.Regions)
	for i := range regions {
		regions[i] = cudart.Region{Base: base + cudart.DevicePtr(uint64(i)*regionBytes), Stride: c.PageBytes, PageBytes: c.PageBytes, Pages: c.DevicePages}
	}
	p, err := client.Open(context.Background(), client.Options{Device: dev, Regions: regions, MaxPages: c.Pages, Name: "gpu_check go"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	out, back := make([]int32, c.Pages), make([]int32, c.Pages)
	for i := range out {
		out[i], back[i] = int32(2*i), int32(2*i+1) // scattered: no two pages merge
	}
	// Each direction's time, and the part of it until the call returned
	// (enqueued, not yet waited for).
	var off, rel, eoff, erel []float64
	for r := 0; r < c.Reps+1; r++ {
		t0 := time.Now()
		if ok, err := p.OffloadStream("bench", "kv", out, 1, 1, 0); err != nil || !ok {
			t.Fatalf("offload: %v %v", ok, err)
		}
		te := time.Now()
		if err := p.Synchronize(); err != nil {
			t.Fatal(err)
		}
		t1 := time.Now()
		if _, err := p.ReloadStream("bench", "kv", back); err != nil {
			t.Fatal(err)
		}
		tr := time.Now()
		if err := p.Synchronize(); err != nil {
			t.Fatal(err)
		}
		t2 := time.Now()
		if r > 0 { // the first is a warm-up
			off, rel = append(off, t1.Sub(t0).Seconds()), append(rel, t2.Sub(t1).Seconds())
			eoff, erel = append(eoff, te.Sub(t0).Seconds()), append(erel, tr.Sub(t1).Seconds())
		}
	}
	fmt.Printf("{\"backend\": %q, \"offload_s\": %g, \"reload_s\": %g, \"offload_enqueue_s\": %g, \"reload_enqueue_s\": %g}\n",
		choice.Backend, median(off), median(rel), median(eoff), median(erel))
}

func median(v []float64) float64 {
	sort.Float64s(v)
	return v[len(v)/2]
}
