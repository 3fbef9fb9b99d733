// Command kvbench runs a verified workload against a kvpool agent and
// reports figures: round trip and copy time per operation against the floor
// of a bare echo between the same processes.
//
//	kvbench [--json] [--workers N] [--duration d]     embedded standalone agent
//	kvbench --socket PATH --token T                    a running agent
//	kvbench restart [--streams 1,10000,...]             the restart probe: agent and keeper as processes, SIGKILL, time to serving, and the adopt floor
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/kvpool/kvpool/internal/workload"
	"github.com/kvpool/kvpool/pkg/standalone"
	"github.com/kvpool/kvpool/pkg/wire"
)

// benchReport is what kvbench prints (as a table, or as JSON).
type benchReport struct {
	Workers     int            `json:"workers"`
	DurationSec float64        `json:"duration_s"`
	PageBytes   uint64         `json:"page_bytes"` // host bytes per page (K and V)
	Ops         []benchOpStats `json:"ops"`
	EchoP50us   float64        `json:"echo_floor_p50_us"`
	EchoP99us   float64        `json:"echo_floor_p99_us"`
	RTTOverEcho float64        `json:"round_trip_p50_over_echo_p50"`
	GBps        float64        `json:"gb_per_s"`
	FullRejects int            `json:"pool_full_rejects"`
	Checks      int            `json:"checks"`
	Mismatches  int            `json:"mismatches"`
	Errors      []string       `json:"errors"`
}

type benchOpStats struct {
	Op       string  `json:"op"`
	Count    int     `json:"count"`
	OpsPerS  float64 `json:"ops_per_s"`
	RTTp50us float64 `json:"round_trip_p50_us"`
	RTTp99us float64 `json:"round_trip_p99_us"`
	Copyp50  float64 `json:"copy_p50_us"`
	Copyp99  float64 `json:"copy_p99_us"`
	GBps     float64 `json:"gb_per_s"`
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:])
	stop()
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "kvbench: %v\n", err)
		os.Exit(1)
	}
}

// options are kvbench's flags.
type options struct {
	workers, pageKiB, maxPages int
	dur                        time.Duration
	asJSON                     bool
}

// run is kvbench with its arguments: it parses the flags, starts an
// embedded agent unless --socket names one, runs the workers against it
// beside the echo floor, and prints the report.
func run(ctx context.Context, args []string) error {
	if len(args) > 0 && args[0] == "restart" {
		return runRestart(ctx, args[1:])
	}
	if len(args) > 0 && args[0] == adoptChild {
		return runAdoptChild(args[1:])
	}
	fs := flag.NewFlagSet("kvbench", flag.ContinueOnError)
	socket := fs.String("socket", "", "a running agent's socket (default: start an embedded standalone agent)")
	token := fs.String("token", os.Getenv("KVPOOL_TOKEN"), "allocation token, with --socket")
	var o options
	fs.IntVar(&o.workers, "workers", 2, "client processes, one session each on GPUs 0..workers-1")
	fs.DurationVar(&o.dur, "duration", 3*time.Second, "how long the mixed workload runs")
	fs.IntVar(&o.pageKiB, "page-kib", 64, "KiB per page in each of the K and V regions")
	fs.IntVar(&o.maxPages, "max-pages", 256, "host pages per session")
	fs.BoolVar(&o.asJSON, "json", false, "print the results as JSON")
	worker := fs.Bool("worker", false, "internal: run as one workload process")
	gpu := fs.Int("gpu", 0, "internal: the worker's GPU")
	echoPath := fs.String("echo", "", "internal: the echo socket the worker measures the floor against")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg := workload.Config{Socket: *socket, Token: *token, GPU: *gpu, PageBytes: uint64(o.pageKiB) << 10,
		MaxPages: o.maxPages, DevicePages: 2 * o.maxPages, MaxStream: 64, Duration: o.dur,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	if *worker {
		return benchWorker(ctx, cfg, *echoPath)
	}
	if o.workers < 1 || o.workers > 64 || o.pageKiB < 1 || o.maxPages < 1 {
		return fmt.Errorf("--workers, --page-kib and --max-pages must be positive (workers at most 64)")
	}
	if *socket == "" {
		stop, err := embedAgent(ctx, o, &cfg)
		if err != nil {
			return err
		}
		defer stop()
	} else if cfg.Token == "" {
		return fmt.Errorf("--socket needs --token or $KVPOOL_TOKEN")
	}
	rep, elapsed, err := runWorkers(ctx, o, cfg)
	if err != nil {
		return err
	}
	if o.asJSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return err
		}
	} else {
		printReport(os.Stdout, rep, elapsed)
	}
	if len(rep.Errors) > 0 || rep.Mismatches > 0 {
		return fmt.Errorf("%d errors, %d mismatches", len(rep.Errors), rep.Mismatches)
	}
	return nil
}

// embedAgent starts a standalone agent in this process with one chunk per
// worker's GPU, large enough for --max-pages, and points cfg at it. stop
// ends it.
func embedAgent(ctx context.Context, o options, cfg *workload.Config) (stop func(), err error) {
	log := cfg.Logger
	dir, err := os.MkdirTemp("", "kvpool-bench-")
	if err != nil {
		return nil, err
	}
	hostBytes := int64(2 * o.pageKiB << 10)
	chunk := max(int64(64<<20), (hostBytes*int64(o.maxPages)+(1<<20)-1)/(1<<20)<<20)
	a, err := standalone.Start(standalone.Config{GPUs: o.workers, ChunksPerGPU: 1, ChunkBytes: chunk,
		Socket: filepath.Join(dir, "kvpool.sock"), Logger: log})
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- a.Serve(sctx) }()
	cfg.Socket = a.Socket
	for t := range a.Tokens {
		cfg.Token = t
	}
	fmt.Fprintf(os.Stderr, "kvbench: embedded standalone agent on %s (%d GPUs)\n", a.Socket, o.workers)
	return func() {
		cancel()
		if err := <-done; err != nil {
			log.Warn("bench: embedded agent stopped", "err", err)
		}
		a.Close()
		os.RemoveAll(dir)
	}, nil
}

// runWorkers runs one worker process per GPU against cfg's agent and
// gathers their results. The floor: the workers time bare request/reply
// exchanges of an offload's sizes with an echo server in this process,
// across the same process boundary as their calls to the agent, before
// and after their workload.
func runWorkers(ctx context.Context, o options, cfg workload.Config) (*benchReport, time.Duration, error) {
	echoDir, err := os.MkdirTemp("", "kvpool-echo-")
	if err != nil {
		return nil, 0, err
	}
	defer os.RemoveAll(echoDir)
	echoSock := filepath.Join(echoDir, "echo.sock")
	stopEcho, err := echoServer(echoSock)
	if err != nil {
		return nil, 0, fmt.Errorf("echo floor: %w", err)
	}
	defer stopEcho()
	self, err := os.Executable()
	if err != nil {
		return nil, 0, err
	}
	rep := &benchReport{Workers: o.workers, PageBytes: cfg.PageBytes * 2, Errors: []string{}}
	results := make([]*workerResult, o.workers)
	progress := make([]int, o.workers)
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	for i := range o.workers {
		cmd := exec.CommandContext(ctx, self, "--worker", "--socket", cfg.Socket, "--token", cfg.Token,
			"--gpu", strconv.Itoa(i), "--duration", o.dur.String(), "--page-kib", strconv.Itoa(o.pageKiB),
			"--max-pages", strconv.Itoa(o.maxPages), "--echo", echoSock)
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			return nil, 0, err
		}
		if err := cmd.Start(); err != nil {
			return nil, 0, fmt.Errorf("start worker %d: %w", i, err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, werr := readWorker(out, func(n int) { mu.Lock(); progress[i] = n; mu.Unlock() })
			if err := cmd.Wait(); err != nil && werr == nil {
				werr = err
			}
			mu.Lock()
			defer mu.Unlock()
			results[i] = res
			if werr != nil {
				rep.Errors = append(rep.Errors, fmt.Sprintf("worker %d (GPU %d): %v", i, i, werr))
			}
		}()
	}
	stopProgress := showProgress(start, &mu, progress)
	wg.Wait()
	stopProgress()
	elapsed := time.Since(start)
	rep.DurationSec = o.dur.Seconds()
	summarize(rep, results, o.dur)
	return rep, elapsed, nil
}

// showProgress prints the workers' total op count every half second until
// the returned stop is called.
func showProgress(start time.Time, mu *sync.Mutex, progress []int) (stop func()) {
	done := make(chan struct{})
	go func() {
		t := time.NewTicker(500 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				mu.Lock()
				n := 0
				for _, p := range progress {
					n += p
				}
				mu.Unlock()
				fmt.Fprintf(os.Stderr, "bench: %4.1fs  %d mixed ops so far\n", time.Since(start).Seconds(), n)
			}
		}
	}()
	return func() { close(done) }
}

// workerResult is what a worker reports.
type workerResult struct {
	*workload.Result
	Echo []time.Duration
}

// benchWorker runs the workload and writes progress and the result to
// stdout: "progress N" lines, then "result {json}". Next to each call to
// the agent it times one bare exchange with the echo server: the floor,
// taken in the same conditions as the calls.
func benchWorker(ctx context.Context, cfg workload.Config, echoPath string) error {
	cfg.Progress = func(n int) { fmt.Printf("progress %d\n", n) }
	var echo []time.Duration
	if echoPath != "" {
		e, err := dialEcho(echoPath)
		if err != nil {
			return fmt.Errorf("echo floor: %w", err)
		}
		defer e.Close()
		// Each call gets one exchange, at random just before or just
		// after it, so that the floor and the calls see the same share of
		// cold wake-ups after the workload's own CPU work.
		rng := rand.New(rand.NewPCG(cfg.Seed, 1))
		var now bool
		cfg.Probe = func(before bool) {
			if before {
				now = rng.IntN(2) == 0
			} else {
				now = !now
			}
			if now {
				if d, err := e.exchange(); err == nil {
					echo = append(echo, d)
				}
			}
		}
	}
	res, err := workload.Run(ctx, cfg)
	if res != nil {
		b, _ := json.Marshal(workerResult{Result: res, Echo: echo})
		fmt.Printf("result %s\n", b)
	}
	return err
}

func readWorker(r io.Reader, progress func(int)) (*workerResult, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 256<<20)
	var res *workerResult
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "progress "):
			if n, err := strconv.Atoi(strings.TrimPrefix(line, "progress ")); err == nil {
				progress(n)
			}
		case strings.HasPrefix(line, "result "):
			res = new(workerResult)
			if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "result ")), res); err != nil {
				return nil, fmt.Errorf("worker result: %w", err)
			}
		}
	}
	if res == nil {
		return nil, fmt.Errorf("worker sent no result")
	}
	return res, sc.Err()
}

func summarize(rep *benchReport, results []*workerResult, dur time.Duration) {
	merged := map[workload.Op]*workload.OpStats{}
	var all, echo []time.Duration
	var bytes int64
	for _, r := range results {
		if r == nil || r.Result == nil {
			continue
		}
		echo = append(echo, r.Echo...)
		rep.FullRejects += r.FullRejects
		rep.Checks += r.Checks
		rep.Mismatches += r.Mismatches
		for op, st := range r.Ops {
			m := merged[op]
			if m == nil {
				m = &workload.OpStats{}
				merged[op] = m
			}
			m.Count += st.Count
			m.RoundTrip = append(m.RoundTrip, st.RoundTrip...)
			m.Copy = append(m.Copy, st.Copy...)
			m.Bytes += st.Bytes
			all = append(all, st.RoundTrip...)
			bytes += st.Bytes
		}
	}
	secs := dur.Seconds()
	var names []string
	for op := range merged {
		names = append(names, string(op))
	}
	sort.Strings(names)
	for _, n := range names {
		st := merged[workload.Op(n)]
		rep.Ops = append(rep.Ops, benchOpStats{
			Op: n, Count: st.Count, OpsPerS: float64(st.Count) / secs,
			RTTp50us: us(workload.Percentile(st.RoundTrip, 50)), RTTp99us: us(workload.Percentile(st.RoundTrip, 99)),
			Copyp50: us(workload.Percentile(st.Copy, 50)), Copyp99: us(workload.Percentile(st.Copy, 99)),
			GBps: float64(st.Bytes) / secs / 1e9,
		})
	}
	rep.GBps = float64(bytes) / secs / 1e9
	rep.EchoP50us, rep.EchoP99us = us(workload.Percentile(echo, 50)), us(workload.Percentile(echo, 99))
	if rep.EchoP50us > 0 {
		rep.RTTOverEcho = us(workload.Percentile(all, 50)) / rep.EchoP50us
	}
}

func printReport(w io.Writer, rep *benchReport, elapsed time.Duration) {
	fmt.Fprintf(w, "kvpool bench: %d client processes, %.1fs mixed workload (+checks; %.1fs wall), %d KiB host pages, copies simulated\n\n",
		rep.Workers, rep.DurationSec, elapsed.Seconds(), rep.PageBytes>>10)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "op\tcalls\tops/s\tround trip p50 µs\tp99 µs\tcopy p50 µs\tp99 µs\tGB/s\t")
	for _, o := range rep.Ops {
		cp50, cp99, gb := "-", "-", "-"
		if o.Copyp50 > 0 {
			cp50, cp99, gb = fmt.Sprintf("%.1f", o.Copyp50), fmt.Sprintf("%.1f", o.Copyp99), fmt.Sprintf("%.2f", o.GBps)
		}
		rt50, rt99 := "-", "-"
		if o.RTTp50us > 0 {
			rt50, rt99 = fmt.Sprintf("%.1f", o.RTTp50us), fmt.Sprintf("%.1f", o.RTTp99us)
		}
		fmt.Fprintf(tw, "%s\t%d\t%.0f\t%s\t%s\t%s\t%s\t%s\t\n", o.Op, o.Count, o.OpsPerS, rt50, rt99, cp50, cp99, gb)
	}
	tw.Flush()
	fmt.Fprintf(w, "\necho floor (bare unixpacket request+reply between the same processes, same run): p50 %.1f µs, p99 %.1f µs; round trip p50 / echo p50 = %.2f\n",
		rep.EchoP50us, rep.EchoP99us, rep.RTTOverEcho)
	fmt.Fprintf(w, "copied %.2f GB/s in all; pool-full rejects %d; checks passed %d; mismatches %d; errors %d\n",
		rep.GBps, rep.FullRejects, rep.Checks, rep.Mismatches, len(rep.Errors))
	for _, e := range rep.Errors {
		fmt.Fprintf(w, "error: %s\n", e)
	}
}

// echoServer answers every packet on path with a packet of an offload
// reply's size, until stopped.
func echoServer(path string) (stop func(), err error) {
	l, err := net.ListenUnix(wire.Network, &net.UnixAddr{Name: path, Net: wire.Network})
	if err != nil {
		return nil, err
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []*net.UnixConn
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.AcceptUnix()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				buf := make([]byte, wire.MaxMessage+1)
				reply := make([]byte, 16+2+64*2)
				for {
					if _, err := c.Read(buf); err != nil {
						return
					}
					if _, err := c.Write(reply); err != nil {
						return
					}
				}
			}()
		}
	}()
	return func() {
		l.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	}, nil
}

// echoConn is a worker's connection to the echo server.
type echoConn struct {
	*net.UnixConn
	req, buf []byte
}

func dialEcho(path string) (*echoConn, error) {
	c, err := net.DialUnix(wire.Network, nil, &net.UnixAddr{Name: path, Net: wire.Network})
	if err != nil {
		return nil, err
	}
	return &echoConn{UnixConn: c, req: make([]byte, 16+20+64*2), buf: make([]byte, wire.MaxMessage+1)}, nil
}

// exchange times one bare request and reply of an offload's sizes.
func (c *echoConn) exchange() (time.Duration, error) {
	t := time.Now()
	if _, err := c.Write(c.req); err != nil {
		return 0, err
	}
	if _, err := c.Read(c.buf); err != nil {
		return 0, err
	}
	return time.Since(t), nil
}
