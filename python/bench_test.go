package python

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/standalone"
)

// BenchmarkPythonOverhead measures, in one run against one in-process
// agent, b.N offload_stream + reload_stream pairs of a 64-page stream (K
// and V regions of 256 bytes per page, scattered pages) on the Go client
// and the same loop through the Python package (python/bench.py, over
// libkvpool.so and ctypes), on the simulator:
//
//	go test -run XXX -bench PythonOverhead -benchtime 3000x ./python
//
// ns/op is the Python pair; go-us/call and py-us/call are per call (half
// a pair), overhead-us/call their difference and py/go their ratio; the
// -cpu- metrics are the same from each process's CPU time (steadier on a
// shared machine), noop-call-us is a ctypes call into the library that does
// nothing, py-prep-us/call the Python layer's own argument work. Goal
// (issue 15): overhead under 15 µs per call.
func BenchmarkPythonOverhead(b *testing.B) {
	py := pythonExe()
	if py == "" {
		b.Skip("no python3")
	}
	if err := exec.Command(py, "-c", "import numpy").Run(); err != nil {
		b.Skipf("%s lacks numpy", py)
	}
	const pages, devPages, pageBytes = benchPages, benchDevPages, benchPageBytes
	dir := b.TempDir()
	lib := filepath.Join(dir, "libkvpool.so")
	goBuild(b, context.Background(), lib, "-buildmode=c-shared", "./cmd/libkvpool")

	a, err := standalone.Start(standalone.Config{GPUs: 2, ChunksPerGPU: 1, ChunkBytes: 4 << 20, Tokens: []string{"bench"},
		Socket: filepath.Join(dir, "kv.sock"), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	defer func() { cancel(); <-done; a.Close() }()

	// The Go client, GPU 0, in a process of its own (this test binary) as
	// the Python client is: cross-process wake-ups cost the same for both.
	gocmd := exec.Command(os.Args[0], "-test.run", "^TestGoBenchHelper$", "-test.count", "1")
	gocmd.Env = append(os.Environ(), "KVPOOL_GO_BENCH_HELPER="+strconv.Itoa(b.N), "KVPOOL_SOCKET="+a.Socket, "KVPOOL_TOKEN=bench")
	gores, err := gocmd.Output()
	if err != nil {
		b.Fatalf("Go client process: %v\n%s", err, gores)
	}
	var gr struct {
		NsPerPair    float64 `json:"ns_per_pair"`
		CPUNsPerPair float64 `json:"cpu_ns_per_pair"`
	}
	if err := json.Unmarshal(firstJSONLine(gores), &gr); err != nil {
		b.Fatalf("Go client process printed %q: %v", gores, err)
	}

	// The Python client, GPU 1 of the same agent.
	cmd := exec.Command(py, "bench.py", "--iters", strconv.Itoa(b.N), "--pages", strconv.Itoa(pages), "--session-pages", strconv.Itoa(benchSession),
		"--device-pages", strconv.Itoa(devPages), "--page-bytes", strconv.Itoa(pageBytes), "--gpu", "1",
		"--socket", a.Socket, "--token", "bench")
	cmd.Env = append(os.Environ(), "KVPOOL_LIBRARY="+lib)
	res, err := cmd.Output()
	if err != nil {
		b.Fatalf("bench.py: %v", err)
	}
	var r struct {
		NsPerPair    float64 `json:"ns_per_pair"`
		CPUNsPerPair float64 `json:"cpu_ns_per_pair"`
		NoopNs       float64 `json:"noop_call_ns"`
		PrepNs       float64 `json:"prep_ns"`
		Tensors      string  `json:"tensors"`
	}
	if err := json.Unmarshal(firstJSONLine(res), &r); err != nil {
		b.Fatalf("bench.py printed %q: %v", res, err)
	}
	goCall := gr.NsPerPair / 2 / 1e3
	pyCall := r.NsPerPair / 2 / 1e3
	b.ReportMetric(r.NsPerPair, "ns/op")
	b.ReportMetric(goCall, "go-us/call")
	b.ReportMetric(pyCall, "py-us/call")
	b.ReportMetric(pyCall-goCall, "overhead-us/call")
	b.ReportMetric(pyCall/goCall, "py/go")
	goCPU, pyCPU := gr.CPUNsPerPair/2/1e3, r.CPUNsPerPair/2/1e3
	b.ReportMetric(goCPU, "go-cpu-us/call")
	b.ReportMetric(pyCPU, "py-cpu-us/call")
	b.ReportMetric(pyCPU-goCPU, "overhead-cpu-us/call")
	b.ReportMetric(r.NoopNs/1e3, "noop-call-us")
	b.ReportMetric(r.PrepNs/1e3, "py-prep-us/call")
	b.Logf("Python side: %s tensors", r.Tensors)
}

func firstJSONLine(b []byte) []byte {
	for _, l := range bytes.Split(b, []byte("\n")) {
		if bytes.HasPrefix(l, []byte("{")) {
			return l
		}
	}
	return b
}

// benchShape is the stream both clients move: 64 scattered pages of K and
// V regions of 256 bytes, 256 device pages, a 128-page session.
const benchPages, benchDevPages, benchPageBytes, benchSession = 64, 256, 256, 128

// TestGoBenchHelper is BenchmarkPythonOverhead's Go client process; it runs
// only when that benchmark starts it.
func TestGoBenchHelper(t *testing.T) {
	iters, _ := strconv.Atoi(os.Getenv("KVPOOL_GO_BENCH_HELPER"))
	if iters <= 0 {
		t.Skip("run by BenchmarkPythonOverhead")
	}
	dev, _ := cudart.NewSim(cudart.SimOptions{}).Open(0)
	k, _ := dev.MemAlloc(benchDevPages * benchPageBytes)
	v, _ := dev.MemAlloc(benchDevPages * benchPageBytes)
	cp, err := client.Open(context.Background(), client.Options{Device: dev, MaxPages: benchSession,
		Regions: []client.Region{{Base: k, Stride: benchPageBytes, BytesPerPage: benchPageBytes, Pages: benchDevPages},
			{Base: v, Stride: benchPageBytes, BytesPerPage: benchPageBytes, Pages: benchDevPages}}})
	if err != nil {
		t.Fatal(err)
	}
	defer cp.Close()
	out, back := make([]int32, benchPages), make([]int32, benchPages)
	for i := range out {
		out[i], back[i] = int32(2*i), int32(2*i+1)
	}
	pair := func() {
		if ok, err := cp.OffloadStream("bench", "kv", out, 1, 2, 0); err != nil || !ok {
			t.Fatalf("offload: %v %v", ok, err)
		}
		if _, err := cp.ReloadStream("bench", "kv", back); err != nil {
			t.Fatal(err)
		}
	}
	for range min(200, iters) {
		pair()
	}
	start, cpu0 := time.Now(), cpuTime()
	for range iters {
		pair()
	}
	wall, cpu := time.Since(start), cpuTime()-cpu0
	fmt.Printf("{\"ns_per_pair\": %f, \"cpu_ns_per_pair\": %f}\n", float64(wall.Nanoseconds())/float64(iters),
		float64(cpu.Nanoseconds())/float64(iters))
}

// cpuTime is the process's user+system CPU time so far.
func cpuTime() time.Duration {
	var ru unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
