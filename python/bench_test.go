package python

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/standalone"
)

// BenchmarkPythonOverhead measures b.N offload_stream + reload_stream
// pairs of a 64-page stream (K and V regions of 256 bytes per page,
// scattered pages) on the Go client and the same loop through the Python
// package (python/bench.py, over libkvpool.so and ctypes), each in a process
// of its own against one in-process agent, on the simulator:
//
//	go test -run XXX -bench PythonOverhead -benchtime 2000x ./python
//
// The two clients take turns: b.N pairs are split into rounds, and each
// round runs on the Go client, then on the Python client (the order
// swapping every round), so both see the same load. ns/op is the Python
// pair; go-us/pair and py-us/pair are the wall time of a pair,
// overhead-us/pair their difference and py/go their ratio; the -cpu-
// metrics are the same from each process's CPU time; overhead-med-us/pair
// is the median over rounds of the difference between neighbouring Go and
// Python rounds (steadier than the totals on a loaded machine);
// noop-call-us is a
// ctypes call into the library that does nothing, py-prep-us/call the
// Python layer's own argument work. Goal (issue 15): overhead under 15 µs
// a call, 30 for the pair (docs/benchmarks.md).
//
// KVPOOL_BENCH_SPIN_US sets both clients' spin wait (client.Options.SpinWait,
// spin_wait_us) in µs; unset, each has its default; negative: none.
//
// KVPOOL_BENCH_BASELINE_LIBRARY=/path/libkvpool.so adds a third client in
// the rotation, the Python package over that library (another build, say
// main's), reported as base-us/pair and base-cpu-us/pair.
func BenchmarkPythonOverhead(b *testing.B) {
	py := pythonExe()
	if py == "" {
		b.Skip("no python3")
	}
	if err := exec.Command(py, "-c", "import numpy").Run(); err != nil {
		b.Skipf("%s lacks numpy", py)
	}
	baseline := os.Getenv("KVPOOL_BENCH_BASELINE_LIBRARY")
	if baseline != "" {
		if _, err := os.Stat(baseline); err != nil {
			b.Fatalf("KVPOOL_BENCH_BASELINE_LIBRARY: %v", err)
		}
	}
	spinUS := os.Getenv("KVPOOL_BENCH_SPIN_US")
	if spinUS == "" {
		spinUS = "0"
	}
	if _, err := strconv.Atoi(spinUS); err != nil {
		b.Fatalf("KVPOOL_BENCH_SPIN_US=%q: %v", spinUS, err)
	}
	dir := b.TempDir()
	lib := filepath.Join(dir, "libkvpool.so")
	goBuild(b, context.Background(), lib, "-buildmode=c-shared", "./cmd/libkvpool")

	a, err := standalone.Start(standalone.Config{GPUs: 3, ChunksPerGPU: 1, ChunkBytes: 4 << 20, Tokens: []string{"bench"},
		Socket: filepath.Join(dir, "kv.sock"), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	defer func() { cancel(); <-done; a.Close() }()

	// The Go client (GPU 0) is this test binary re-run as a helper, in a
	// process of its own as the Python client is: cross-process wake-ups
	// cost the same for both.
	gocmd := exec.Command(os.Args[0], "-test.run", "^TestGoBenchHelper$", "-test.count", "1")
	gocmd.Env = append(os.Environ(), "KVPOOL_GO_BENCH_HELPER=1", "KVPOOL_SOCKET="+a.Socket, "KVPOOL_TOKEN=bench", "KVPOOL_BENCH_SPIN_US="+spinUS)
	pyCmd := func(gpu int, library string) *exec.Cmd {
		cmd := exec.Command(py, "bench.py", "--rounds", "--pages", strconv.Itoa(benchPages), "--session-pages", strconv.Itoa(benchSession),
			"--device-pages", strconv.Itoa(benchDevPages), "--page-bytes", strconv.Itoa(benchPageBytes), "--gpu", strconv.Itoa(gpu),
			"--socket", a.Socket, "--token", "bench", "--spin-us", spinUS)
		cmd.Env = append(os.Environ(), "KVPOOL_LIBRARY="+library)
		return cmd
	}
	clients := []*roundClient{{name: "go", cmd: gocmd}, {name: "py", cmd: pyCmd(1, lib)}}
	if baseline != "" {
		clients = append(clients, &roundClient{name: "base", cmd: pyCmd(2, baseline)})
	}
	for _, c := range clients {
		if err := c.start(); err != nil {
			b.Fatal(err)
		}
		defer c.stop()
	}

	rounds := max(1, min(500, b.N/20))
	for r := range rounds {
		n := b.N / rounds
		if r == rounds-1 {
			n = b.N - n*(rounds-1)
		}
		for i := range clients {
			c := clients[i]
			if r%2 == 1 {
				c = clients[len(clients)-1-i]
			}
			if err := c.round(n); err != nil {
				b.Fatal(err)
			}
		}
	}
	var fin struct {
		NoopNs  float64 `json:"noop_call_ns"`
		PrepNs  float64 `json:"prep_ns"`
		Tensors string  `json:"tensors"`
	}
	for _, c := range clients {
		line, err := c.finish()
		if err != nil {
			b.Fatal(err)
		}
		if c.name == "py" {
			if err := json.Unmarshal(line, &fin); err != nil {
				b.Fatalf("bench.py printed %q: %v", line, err)
			}
		}
	}
	g, p := clients[0], clients[1]
	perPair := func(ns float64) float64 { return ns / float64(b.N) / 1e3 }
	b.ReportMetric(p.ns/float64(b.N), "ns/op")
	b.ReportMetric(perPair(g.ns), "go-us/pair")
	b.ReportMetric(perPair(p.ns), "py-us/pair")
	b.ReportMetric(perPair(p.ns-g.ns), "overhead-us/pair")
	// The same from each pair of neighbouring rounds, median: a burst of
	// load from other processes spoils a round or two, not the median.
	diffs := make([]float64, len(g.rounds))
	for i := range diffs {
		diffs[i] = p.rounds[i] - g.rounds[i]
	}
	slices.Sort(diffs)
	b.ReportMetric(diffs[len(diffs)/2]/1e3, "overhead-med-us/pair")
	b.ReportMetric(p.ns/g.ns, "py/go")
	b.ReportMetric(perPair(g.cpu), "go-cpu-us/pair")
	b.ReportMetric(perPair(p.cpu), "py-cpu-us/pair")
	b.ReportMetric(perPair(p.cpu-g.cpu), "overhead-cpu-us/pair")
	if len(clients) > 2 {
		base := clients[2]
		b.ReportMetric(perPair(base.ns), "base-us/pair")
		b.ReportMetric(perPair(base.cpu), "base-cpu-us/pair")
	}
	b.ReportMetric(fin.NoopNs/1e3, "noop-call-us")
	b.ReportMetric(fin.PrepNs/1e3, "py-prep-us/call")
	b.Logf("%d rounds; Python side: %s tensors", rounds, fin.Tensors)
}

// roundClient is one benchmark client process serving rounds: it prints a
// JSON line when ready, then one per line N it reads (N pairs: their wall
// and CPU nanoseconds), and a last line when its stdin ends.
type roundClient struct {
	name     string
	cmd      *exec.Cmd
	in       io.WriteCloser
	out      *bufio.Scanner
	stderr   bytes.Buffer
	ns, cpu  float64
	rounds   []float64 // ns per pair of each round
	finished bool
}

func (c *roundClient) start() error {
	var err error
	if c.in, err = c.cmd.StdinPipe(); err != nil {
		return err
	}
	stdout, err := c.cmd.StdoutPipe()
	if err != nil {
		return err
	}
	c.cmd.Stderr = &c.stderr
	c.out = bufio.NewScanner(stdout)
	if err := c.cmd.Start(); err != nil {
		return fmt.Errorf("%s client: %w", c.name, err)
	}
	var r struct{ Ready bool }
	line, err := c.line()
	if err == nil {
		err = json.Unmarshal(line, &r)
	}
	if err == nil && !r.Ready {
		err = fmt.Errorf("%q is not the ready line", line)
	}
	if err != nil {
		return fmt.Errorf("%s client did not get ready: %w\n%s", c.name, err, c.stderr.String())
	}
	return nil
}

// line returns the next line of the client's that is a JSON object.
func (c *roundClient) line() ([]byte, error) {
	for c.out.Scan() {
		if l := c.out.Bytes(); bytes.HasPrefix(l, []byte("{")) {
			return l, nil
		}
	}
	if err := c.out.Err(); err != nil {
		return nil, err
	}
	return nil, io.ErrUnexpectedEOF
}

func (c *roundClient) round(n int) error {
	if _, err := fmt.Fprintf(c.in, "%d\n", n); err != nil {
		return fmt.Errorf("%s client: %w\n%s", c.name, err, c.stderr.String())
	}
	var r struct {
		Ns    float64 `json:"ns"`
		CPUNs float64 `json:"cpu_ns"`
	}
	line, err := c.line()
	if err == nil {
		err = json.Unmarshal(line, &r)
	}
	if err != nil {
		return fmt.Errorf("%s client, round of %d: %w\n%s", c.name, n, err, c.stderr.String())
	}
	c.ns += r.Ns
	c.rounds = append(c.rounds, r.Ns/float64(n))
	c.cpu += r.CPUNs
	return nil
}

// finish ends the client's stdin and returns its last line.
func (c *roundClient) finish() ([]byte, error) {
	c.in.Close()
	line, err := c.line()
	werr := c.cmd.Wait()
	c.finished = true
	if err == nil {
		err = werr
	}
	if err != nil {
		return nil, fmt.Errorf("%s client: %w\n%s", c.name, err, c.stderr.String())
	}
	return line, nil
}

func (c *roundClient) stop() {
	if !c.finished && c.cmd.Process != nil {
		c.cmd.Process.Kill()
		c.cmd.Wait()
	}
}

// benchShape is the stream both clients move: 64 scattered pages of K and
// V regions of 256 bytes, 256 device pages, a 128-page session.
const benchPages, benchDevPages, benchPageBytes, benchSession = 64, 256, 256, 128

// TestGoBenchHelper is BenchmarkPythonOverhead's Go client process; it runs
// only when that benchmark starts it, and serves rounds as bench.py does.
func TestGoBenchHelper(t *testing.T) {
	if os.Getenv("KVPOOL_GO_BENCH_HELPER") == "" {
		t.Skip("run by BenchmarkPythonOverhead")
	}
	dev, _ := cudart.NewSim(cudart.SimOptions{}).Open(0)
	k, _ := dev.MemAlloc(benchDevPages * benchPageBytes)
	v, _ := dev.MemAlloc(benchDevPages * benchPageBytes)
	spinUS, _ := strconv.Atoi(os.Getenv("KVPOOL_BENCH_SPIN_US"))
	cp, err := client.Open(context.Background(), client.Options{Device: dev, MaxPages: benchSession,
		SpinWait: time.Duration(spinUS) * time.Microsecond,
		Regions: []cudart.Region{{Base: k, Stride: benchPageBytes, PageBytes: benchPageBytes, Pages: benchDevPages},
			{Base: v, Stride: benchPageBytes, PageBytes: benchPageBytes, Pages: benchDevPages}}})
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
	for range 200 {
		pair()
	}
	fmt.Println(`{"ready": true}`)
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		n, err := strconv.Atoi(in.Text())
		if err != nil {
			t.Fatal(err)
		}
		start, cpu0 := time.Now(), cpuTime()
		for range n {
			pair()
		}
		wall, cpu := time.Since(start), cpuTime()-cpu0
		fmt.Printf("{\"ns\": %d, \"cpu_ns\": %d}\n", wall.Nanoseconds(), cpu.Nanoseconds())
	}
	fmt.Println(`{"done": true}`)
}

// cpuTime is the process's user+system CPU time so far.
func cpuTime() time.Duration {
	var ru unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
