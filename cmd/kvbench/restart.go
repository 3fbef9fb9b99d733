package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/kvpool/kvpool/internal/keeper"
	"github.com/kvpool/kvpool/internal/logging"
	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
	poolpkg "github.com/kvpool/kvpool/pkg/pool"
)

// restartReport is what `kvbench restart` prints: per stream count, the
// time from SIGKILL of the agent until a client call succeeds on the
// restarted one, the agent's memory before and after, and the adopt floor
// (adoptFloor) for the memory after.
type restartReport struct {
	Load string `json:"load_average"` // /proc/loadavg when the probe began
	Wait string `json:"wait"`         // how the gap ends: "poll" or "client" (--wait)
	// RestartBy is who started the agent again (--restart-by): "kvbench",
	// "supervisor" or "spare".
	RestartBy string       `json:"restart_by"`
	Cases     []restartRow `json:"cases"`
}

type restartRow struct {
	Streams    int       `json:"streams"`  // over every session
	Sessions   int       `json:"sessions"` // the streams' sessions, each its own allocation
	PoolMiB    int       `json:"pool_mib"`
	GapsMs     []float64 `json:"gaps_ms"` // one per restart
	GapP50Ms   float64   `json:"gap_p50_ms"`
	ExitsMs    []float64 `json:"exits_ms"`                // per restart, the part of the gap until the killed agent had exited (its memory unmapped)
	OverFloor  float64   `json:"gap_p50_over_one_stream"` // the 1-stream case's p50 measured in the same run
	RSSBefore  int64     `json:"rss_before_bytes"`        // the first agent, filled and settled
	RSSAfter   []int64   `json:"rss_after_bytes"`         // each restarted agent, settled
	AnonBefore int64     `json:"rss_anon_before_bytes"`
	AnonAfter  []int64   `json:"rss_anon_after_bytes"`
	PeakAfter  []int64   `json:"rss_peak_after_bytes"` // each restarted agent's VmHWM: the restore's peak, the pool it faulted in included
	// AdoptMs: what mapping the restarted agent's anonymous memory (the
	// median of AnonAfter: its whole heap, the state rebuilt included)
	// from a kept memfd takes a fresh process (adoptFloor), three times:
	// the floor of a restart that adopted its state instead of rebuilding it.
	AdoptMs    []float64 `json:"adopt_floor_ms"`
	AdoptP50Ms float64   `json:"adopt_floor_p50_ms"`
	// Churn: the calls of --churn before the first restart, with the
	// books as full as the streams make them (each a change the agent
	// records before it answers: the books' compactions fall among them).
	Churn *churnStats `json:"churn,omitempty"`
	// Steps: where each restart's gap went, from the agents' own log
	// (splitGaps); absent when it does not say (--agent-log-level above
	// info).
	Steps []gapSteps `json:"steps,omitempty"`
	// FromSpare counts the restarts in place that woke a spare
	// (--restart-by spare).
	FromSpare int `json:"restarts_from_a_spare,omitempty"`
}

// churnStats are the round trips of the churn's calls.
type churnStats struct {
	Calls   int     `json:"calls"`
	Seconds float64 `json:"seconds"`
	P50us   float64 `json:"p50_us"`
	P99us   float64 `json:"p99_us"`
	P999us  float64 `json:"p999_us"`
	MaxUs   float64 `json:"max_us"`
}

// runRestart is `kvbench restart`: a keeper and an agent as real
// processes, client sessions (in this process, on a simulated GPU, one
// standalone token each) filled with N one-page streams in all, then the
// agent killed with SIGKILL and started again, restarts times, each timed
// until IsOffloaded of the first session's first stream succeeds (polled
// every ms, or one call riding out the restart with the client's own
// retries: --wait); every session's streams are verified after the last.
func runRestart(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("kvbench restart", flag.ContinueOnError)
	counts := fs.String("streams", "1,10000,100000,131072", "stream counts to probe, comma-separated (the first is the floor)")
	restarts := fs.Int("restarts", 3, "restarts per stream count")
	agentBin := fs.String("agent-bin", "", "the agent binary (default: ./cmd/agent built as the image builds it, stripped, into a temporary directory)")
	settle := fs.Duration("settle", time.Second, "how long after a fill and after a restart before the RSS is read")
	asJSON := fs.Bool("json", false, "print the results as JSON")
	fs.StringVar(&agentLogLevel, "agent-log-level", "", "the agents' --log-level; when set, their logs go to stderr at the end of each count (default: info, shown only when an agent logs an error; the gap's steps are read from it)")
	chunks := fs.Int("chunks", 2, "the agent's pool chunks, spread over --gpus simulated GPUs")
	gpus := fs.Int("gpus", 1, "simulated GPUs, each holding chunks/gpus chunks (an agent serves at most 4,096 chunks a GPU)")
	chunkMiB := fs.Int("chunk-mib", 16, "MiB per chunk: the pool is chunks x chunk-mib, pinned at the first start and adopted at every restart")
	sessions := fs.Int("sessions", 1, "sessions the streams are spread over, each its own standalone token and allocation (chunks/sessions chunks each)")
	churn := fs.Int("churn", 0, "before the first restart, this many discards of a stream of the first session, each followed by its offload again, every call timed (the books fill, and compact, as the calls go on)")
	fs.StringVar(&restartBy, "restart-by", "kvbench", `who starts the agent again after each SIGKILL: "kvbench" (at once: the agent's own gap), "supervisor" (the agent's restartInPlace supervisor, as the chart runs it) or "spare" (the supervisor, waking a spare agent process that has already started)`)
	fs.DurationVar(&spareAfter, "spare-after", 250*time.Millisecond, "with --restart-by spare: the agent's restartInPlace.spareAfter, how long after a restart the next spare starts (250ms, so that one stands behind the agent by the next kill)")
	fs.IntVar(&ridBytes, "rid-bytes", 11, "bytes of each request ID (11 to 1024): the streams' names, which the agent's heap, the books and a restore carry")
	wait := fs.String("wait", "poll", `how the gap is timed: "poll" (a call without retries every ms: when the agent serves again) or "client" (one call in flight from the killed agent's exit, riding out the restart with the client's default retries: what an engine waits)`)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *wait != "poll" && *wait != "client" {
		return fmt.Errorf("--wait: %q is not poll or client", *wait)
	}
	if restartBy != "kvbench" && restartBy != "supervisor" && restartBy != "spare" {
		return fmt.Errorf("--restart-by: %q is not kvbench, supervisor or spare", restartBy)
	}
	if spareAfter < 0 || spareAfter > time.Hour {
		return fmt.Errorf("--spare-after: %v is not 0s to 1h", spareAfter)
	}
	if ridBytes < 11 || ridBytes > 1024 {
		return fmt.Errorf("--rid-bytes: %d is not 11 to 1024", ridBytes)
	}
	if *sessions < 1 || *sessions > maxProbeSessions {
		return fmt.Errorf("--sessions: %d is not 1 to %d", *sessions, maxProbeSessions)
	}
	if *chunks < *sessions || *chunkMiB < 1 || (*chunks / *sessions)**chunkMiB < 32 {
		return errors.New("--chunks and --chunk-mib: at least one chunk and 32 MiB a session (room for a session at its stream bound)")
	}
	if *gpus < 1 || *chunks%*gpus != 0 {
		return errors.New("--gpus: at least one, and a divisor of --chunks")
	}
	pool := poolShape{chunks: *chunks, chunkMiB: *chunkMiB, sessions: *sessions, gpus: *gpus}
	most := min(*sessions<<17, 1<<19) // the agent's bounds: 2^17 streams a session, 2^19 in all
	var ns []int
	for _, f := range strings.Split(*counts, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < *sessions || n > most {
			return fmt.Errorf("--streams: %q is not a count of %d (a stream a session) to %d", f, *sessions, most)
		}
		ns = append(ns, n)
	}
	if *churn < 0 {
		return errors.New("--churn must not be negative")
	}
	if *restarts < 1 {
		return errors.New("--restarts must be at least 1")
	}
	bin := *agentBin
	if bin == "" {
		dir, err := os.MkdirTemp("", "kvbench-agent-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		bin = filepath.Join(dir, "agent")
		// Built as the image builds it (Dockerfile): a new process's own
		// start is part of every gap, and the symbol tables an unstripped
		// binary carries made it 2-3 ms longer here.
		build := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, "github.com/kvpool/kvpool/cmd/agent")
		if out, err := build.CombinedOutput(); err != nil {
			return fmt.Errorf("build the agent: %v\n%s", err, out)
		}
	}
	load, _ := os.ReadFile("/proc/loadavg")
	rep := restartReport{Load: strings.TrimSpace(string(load)), Wait: *wait, RestartBy: restartBy}
	for _, n := range ns {
		row, err := probeRestart(ctx, bin, pool, n, *restarts, *churn, *settle, *wait == "client")
		if err != nil {
			return fmt.Errorf("%d streams: %w", n, err)
		}
		row.OverFloor = row.GapP50Ms / max(rep.floor(row), 1e-9)
		rep.Cases = append(rep.Cases, row)
	}
	if *asJSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	printRestart(os.Stdout, &rep)
	return nil
}

// floor is the first case's p50 gap (row itself when it is the first).
func (r *restartReport) floor(row restartRow) float64 {
	if len(r.Cases) == 0 {
		return row.GapP50Ms
	}
	return r.Cases[0].GapP50Ms
}

func printRestart(w io.Writer, rep *restartReport) {
	ends := map[string]string{"poll": "a call polled every ms succeeds (--wait poll)", "client": "one call made as the killed agent is gone returns, with the client's retries (--wait client)"}
	fmt.Fprintf(w, "load average at start: %s; the gap ends when %s\n", rep.Load, ends[rep.Wait])
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "pool MiB\tsessions\tstreams\tgap p50 ms\tgaps ms\texits ms\tover 1st\tadopt floor ms\tRSS before MiB\tRSS after MiB\tanon before MiB\tanon after MiB\tpeak after MiB")
	mib := func(v int64) string { return fmt.Sprintf("%.1f", float64(v)/(1<<20)) }
	list := func(vs []int64) string {
		var s []string
		for _, v := range vs {
			s = append(s, mib(v))
		}
		return strings.Join(s, " ")
	}
	ms := func(vs []float64) string {
		var s []string
		for _, v := range vs {
			s = append(s, fmt.Sprintf("%.1f", v))
		}
		return strings.Join(s, " ")
	}
	for _, c := range rep.Cases {
		fmt.Fprintf(tw, "%d\t%d\t%d\t%.1f\t%s\t%s\t%.2f\t%.1f\t%s\t%s\t%s\t%s\t%s\n", c.PoolMiB, c.Sessions, c.Streams, c.GapP50Ms, ms(c.GapsMs), ms(c.ExitsMs), c.OverFloor,
			c.AdoptP50Ms, mib(c.RSSBefore), list(c.RSSAfter), mib(c.AnonBefore), list(c.AnonAfter), list(c.PeakAfter))
	}
	tw.Flush()
	if rep.RestartBy != "kvbench" {
		for _, c := range rep.Cases {
			ahead := 0
			for _, s := range c.Steps {
				ahead += btoi(s.ReadAhead)
			}
			fmt.Fprintf(w, "%d streams: restarted by the agent's supervisor (--restart-by %s), %d of %d restarts by waking a spare, %d of them with the books read ahead\n",
				c.Streams, rep.RestartBy, c.FromSpare, len(c.GapsMs), ahead)
		}
	}
	printSteps(w, rep)
	for _, c := range rep.Cases {
		if ch := c.Churn; ch != nil {
			fmt.Fprintf(w, "churn before the restarts, %d streams: %d calls in %.1f s, round trip p50 %.1f µs, p99 %.1f, p99.9 %.1f, max %.1f\n",
				c.Streams, ch.Calls, ch.Seconds, ch.P50us, ch.P99us, ch.P999us, ch.MaxUs)
		}
	}
}

// agentLogLevel is the agents' --log-level (--agent-log-level); empty:
// info, their log not shown unless it holds an error.
var agentLogLevel = ""

// restartBy is who starts the agent again (--restart-by): kvbench, or the
// agent's own supervisor (restartInPlace), with a spare or without;
// spareAfter is when the spare starts (--spare-after).
var (
	restartBy  = "kvbench"
	spareAfter = 250 * time.Millisecond
)

// poolShape is the probe agent's pool: chunks of chunkMiB, 256-byte host
// pages, on gpus simulated GPUs, shared by sessions tokens.
type poolShape struct{ chunks, chunkMiB, sessions, gpus int }

// probePageBytes is the probe's host page: its two 64-byte regions,
// rounded up to the agent's host page alignment.
const probePageBytes = 256

// maxProbeSessions bounds --sessions.
const maxProbeSessions = 64

// probeToken is the standalone token of the probe's session i.
func probeToken(i int) string { return fmt.Sprintf("bench-token-%d", i) }

// probeRestart runs one stream count: a fresh keeper and agent, the fill,
// restarts kills and restarts, the check of every stream.
func probeRestart(ctx context.Context, bin string, pool poolShape, n, restarts, churn int, settle time.Duration, clientWait bool) (restartRow, error) {
	row := restartRow{Streams: n, Sessions: pool.sessions, PoolMiB: pool.chunks * pool.chunkMiB}
	pr, err := startProbe(bin, pool)
	if err != nil {
		return row, err
	}
	defer pr.stop(n)
	dev, regions, err := probeDevice()
	if err != nil {
		return row, err
	}
	defer dev.Close()
	p, counts, err := pr.fill(ctx, dev, regions, n, pool.sessions, clientWait)
	if err != nil {
		return row, err
	}
	defer p.Close()
	if churn > 0 {
		if row.Churn, err = churnCalls(p, counts[0], churn); err != nil {
			return row, err
		}
	}
	time.Sleep(settle)
	row.RSSBefore, row.AnonBefore, _ = procRSS(pr.servingPID())
	var times []restartTimes
	for range restarts {
		gap, exit, tm, err := pr.restart(p, clientWait)
		if err != nil {
			return row, err
		}
		times = append(times, tm)
		row.GapsMs = append(row.GapsMs, float64(gap.Microseconds())/1e3)
		row.ExitsMs = append(row.ExitsMs, float64(exit.Microseconds())/1e3)
		time.Sleep(settle)
		rss, anon, peak := procRSS(pr.servingPID())
		row.RSSAfter, row.AnonAfter = append(row.RSSAfter, rss), append(row.AnonAfter, anon)
		row.PeakAfter = append(row.PeakAfter, peak)
	}
	for j, m := range counts {
		if j > 0 { // the other sessions' instances take them over again
			if p, err = openProbe(ctx, pr.sock, j, dev, regions, 10*time.Second); err != nil {
				return row, fmt.Errorf("session %d after the restarts: %w", j, err)
			}
			defer p.Close()
		}
		u, err := p.Usage()
		if err != nil || u.Streams != m {
			return row, fmt.Errorf("session %d after the restarts: %d streams (%v), want %d", j, u.Streams, err, m)
		}
		for _, i := range []int{0, m / 2, m - 1} {
			if k, err := p.NumPages(probeRid(i), "kv"); err != nil || k != 1 {
				return row, fmt.Errorf("session %d's stream %s after the restarts: %d pages (%v), want 1", j, probeRid(i), k, err)
			}
		}
	}
	row.GapP50Ms = median(row.GapsMs)
	if restartBy != "kvbench" {
		// The supervisor's restart line is when the next agent began.
		restarts := inPlaceRestarts(pr.log.String())
		if len(restarts) != len(times) {
			return row, fmt.Errorf("%d restarts in place logged for %d kills:\n%s", len(restarts), len(times), pr.log.String())
		}
		for i, r := range restarts {
			times[i].exec = r.at
			row.ExitsMs[i] = float64(r.at.Sub(times[i].kill).Microseconds()) / 1e3
			if r.spare {
				row.FromSpare++
			}
		}
	}
	row.Steps = splitGaps(pr.log.String(), times)
	anon := make([]float64, len(row.AnonAfter))
	for i, a := range row.AnonAfter {
		anon[i] = float64(a)
	}
	if heap := int64(median(anon)); heap > 0 { // 0: /proc could not be read
		if row.AdoptMs, err = adoptFloor(heap, 3); err != nil {
			return row, err
		}
	}
	row.AdoptP50Ms = median(row.AdoptMs)
	return row, nil
}

// ridBytes is the length of the request IDs probeRid makes (--rid-bytes).
var ridBytes int

// probeRid is the i-th request ID: "req-" and i in 7 digits, padded to
// ridBytes (an engine's IDs are often 40-60 bytes: a prefix and a UUID).
func probeRid(i int) string {
	r := fmt.Sprintf("req-%07d", i)
	if len(r) < ridBytes {
		r += strings.Repeat("x", ridBytes-len(r))
	}
	return r
}

// churnCalls discards the streams of p's session in turn, m of them, and
// offloads each again (one page, as the fill did), calls times in all,
// and returns the calls' round trips.
func churnCalls(p *client.CPUPagePool, m, calls int) (*churnStats, error) {
	took := make([]time.Duration, 0, calls)
	t0 := time.Now()
	for i := 0; len(took) < calls; i++ {
		rid := probeRid(i % m)
		t := time.Now()
		if err := p.Discard(rid, "kv"); err != nil {
			return nil, fmt.Errorf("churn: discard %s: %w", rid, err)
		}
		took = append(took, time.Since(t))
		t = time.Now()
		if ok, err := p.OffloadStream(rid, "kv", []int32{int32(i % 16)}, int64(i), int64(i), 0); err != nil || !ok {
			return nil, fmt.Errorf("churn: offload %s: %v, %v", rid, ok, err)
		}
		took = append(took, time.Since(t))
	}
	el := time.Since(t0)
	slices.Sort(took)
	at := func(q float64) float64 { return float64(took[int(q*float64(len(took)-1))].Nanoseconds()) / 1e3 }
	return &churnStats{Calls: len(took), Seconds: el.Seconds(), P50us: at(0.5), P99us: at(0.99), P999us: at(0.999), MaxUs: at(1)}, nil
}

// probe is one stream count's keeper and agent processes.
type probe struct {
	dir, sock string
	args      []string
	bin       string
	keeper    *exec.Cmd
	agent     *exec.Cmd
	log       logging.SyncBuffer // every agent's stderr
	// firstWait bounds the first start: 10 s and 10 ms a MiB of the pool
	// (the dev VM pinned 4 GiB of 1 MiB chunks in 5.6-6.5 s; a VM whose
	// host backs fresh memory as it is touched pinned 16 GiB at 267-276
	// MiB/s, past a bound of 3 ms a MiB).
	firstWait time.Duration
}

// startProbe starts a keeper and an agent on it in a fresh directory.
func startProbe(bin string, pool poolShape) (*probe, error) {
	dir, err := os.MkdirTemp("", "kvbench-restart-")
	if err != nil {
		return nil, err
	}
	pr := &probe{dir: dir, bin: bin, sock: filepath.Join(dir, "sock", "kv.sock"),
		firstWait: 10*time.Second + time.Duration(pool.chunks*pool.chunkMiB)*10*time.Millisecond}
	keeperSock := filepath.Join(dir, "keeper.sock")
	pr.keeper = exec.Command(bin, "keeper", "--socket", keeperSock, "--log-level", "warn")
	pr.keeper.Stderr = os.Stderr
	if err := pr.keeper.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := waitUntil(10*time.Second, func() bool { _, err := keeper.Query(keeperSock); return err == nil }); err != nil {
		pr.stop(0)
		return nil, fmt.Errorf("keeper: %w", err)
	}
	if err := os.Mkdir(filepath.Dir(pr.sock), 0o755); err != nil {
		pr.stop(0)
		return nil, err
	}
	// By default two chunks of 16 MiB of 256-byte host pages (the probe's
	// two 64-byte regions, rounded up to the host page alignment): 131,072
	// pages, room for one session at its stream bound.
	tokens := make([]string, pool.sessions)
	for i := range tokens {
		tokens[i] = probeToken(i)
	}
	pr.args = []string{"--standalone", "--socket", pr.sock, "--keeper-socket", keeperSock, "--standalone-gpus", strconv.Itoa(pool.gpus),
		"--chunks-per-gpu", strconv.Itoa(pool.chunks / pool.gpus), "--chunk-mib", strconv.Itoa(pool.chunkMiB), "--state-dir", filepath.Join(dir, "state"),
		"--log-level", cmp.Or(agentLogLevel, "info"), "--standalone-tokens", strings.Join(tokens, ",")}
	// The probe's pages are smaller than the agent's default bound on the
	// sessions' pages assumes (4 KiB): past it, the bound is raised to
	// every page of the pool (an agent older than the bound never sees
	// the flag).
	if pages := int64(pool.chunks*pool.chunkMiB) << 20 / probePageBytes; pages > poolpkg.DefaultMaxPages(int64(pool.chunks*pool.chunkMiB)<<20) {
		pr.args = append(pr.args, "--max-pages", strconv.FormatInt(pages, 10))
	}
	if restartBy != "kvbench" {
		pr.args = append(pr.args, "--restart-in-place-max", "100", "--restart-in-place-window", "1h")
	}
	if restartBy == "spare" {
		pr.args = append(pr.args, "--restart-in-place-spare=true", "--restart-in-place-spare-after", spareAfter.String())
	}
	if err := pr.startAgent(); err != nil {
		pr.stop(0)
		return nil, err
	}
	return pr, nil
}

// servingPID is the agent that serves: the process kvbench started, or
// the supervisor's child that last said it serves.
func (pr *probe) servingPID() int {
	if restartBy == "kvbench" {
		return pr.agent.Process.Pid
	}
	pid := 0
	for _, line := range strings.Split(pr.log.String(), "\n") {
		if f := logFields(line); f["msg"] == "kvpool agent serving" {
			pid, _ = strconv.Atoi(f["pid"])
		}
	}
	return pid
}

// inPlaceRestart is one restart in place as the supervisor logged it.
type inPlaceRestart struct {
	at    time.Time
	spare bool
}

// inPlaceRestarts reads the supervisor's restarts from the agents' log.
func inPlaceRestarts(log string) []inPlaceRestart {
	var out []inPlaceRestart
	for _, line := range strings.Split(log, "\n") {
		if f := logFields(line); f["msg"] == "agent ended abnormally; restarting it in place" {
			at, err := time.Parse(time.RFC3339Nano, f["time"])
			if err != nil {
				continue
			}
			out = append(out, inPlaceRestart{at: at, spare: f["spare"] == "true"})
		}
	}
	return out
}

func (pr *probe) startAgent() error {
	pr.agent = exec.Command(pr.bin, pr.args...)
	pr.agent.Stderr = &pr.log
	if err := pr.agent.Start(); err != nil {
		pr.agent = nil
		return err
	}
	return nil
}

// stop ends the agent and the keeper (SIGTERM) and removes the
// directory; the agents' log goes to stderr when it has errors or when
// asked for (--agent-log-level).
func (pr *probe) stop(n int) {
	for _, c := range []*exec.Cmd{pr.agent, pr.keeper} {
		if c != nil && c.Process != nil {
			_ = c.Process.Signal(syscall.SIGTERM)
			_ = c.Wait()
		}
	}
	if s := pr.log.String(); strings.Contains(s, "level=ERROR") || agentLogLevel != "" {
		fmt.Fprintf(os.Stderr, "kvbench: the agents' log (%d streams):\n%s", n, s)
	}
	os.RemoveAll(pr.dir)
}

// fill offloads n one-page streams over sessions sessions (the first
// takes what does not divide) and returns the pool the probe times the
// gap with (the first session's instance, taking it over: with the
// client's default retries for clientWait, else with none, as it polls
// itself) and each session's stream count.
func (pr *probe) fill(ctx context.Context, dev cudart.Device, regions []cudart.Region, n, sessions int, clientWait bool) (*client.CPUPagePool, []int, error) {
	var counts []int
	for j := range sessions {
		m := n / sessions
		if j == 0 {
			m += n % sessions
		}
		fill, err := openProbe(ctx, pr.sock, j, dev, regions, pr.firstWait)
		if err != nil {
			return nil, nil, err
		}
		for i := range m {
			ok, err := fill.OffloadStream(probeRid(i), "kv", []int32{int32(i % 16)}, int64(i), int64(i), 0)
			if err != nil || !ok {
				fill.Close()
				return nil, nil, fmt.Errorf("session %d, offload %d: %v, %v", j, i, ok, err)
			}
		}
		if err := fill.Synchronize(); err != nil {
			fill.Close()
			return nil, nil, err
		}
		fill.Disconnect()
		counts = append(counts, m)
	}
	retry := time.Duration(-1)
	if clientWait {
		retry = 0 // client.DefaultRetryFor
	}
	p, err := openProbe(ctx, pr.sock, 0, dev, regions, retry)
	return p, counts, err
}

// restart kills the agent with SIGKILL, starts another and returns the
// time until p's is_offloaded of the first stream succeeds, and the part
// of it until the killed agent had exited (the kernel unmaps its memory
// first: the larger the pool, the longer). With clientWait the call is
// made once, as soon as the killed agent is gone (made before, it could
// still be answered by it), and rides out the restart with p's retries;
// else it is made every ms until one succeeds.
func (pr *probe) restart(p *client.CPUPagePool, clientWait bool) (gap, exit time.Duration, tm restartTimes, err error) {
	type answer struct {
		ok  bool
		err error
		at  time.Duration
	}
	var call chan answer
	var t0 time.Time
	if restartBy != "kvbench" {
		// The supervisor reaps the agent and starts the next: the exit
		// and the start are read from its log afterwards.
		pid := pr.servingPID()
		if pid <= 0 {
			return 0, 0, tm, fmt.Errorf("no serving agent's pid in the log:\n%s", pr.log.String())
		}
		t0 = time.Now()
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			return 0, 0, tm, err
		}
		tm.kill = t0
	} else {
		t0 = time.Now()
		if err := pr.agent.Process.Signal(syscall.SIGKILL); err != nil {
			return 0, 0, tm, err
		}
		_ = pr.agent.Wait() // killed: the error says so
		exit = time.Since(t0)
		tm.kill = t0
	}
	if clientWait {
		call = make(chan answer, 1)
		go func() {
			ok, err := p.IsOffloaded(probeRid(0))
			call <- answer{ok, err, time.Since(t0)}
		}()
	}
	if restartBy == "kvbench" {
		tm.exec = time.Now()
		if err := pr.startAgent(); err != nil {
			return 0, 0, tm, err
		}
	}
	if clientWait {
		a := <-call
		switch {
		case a.err != nil:
			return 0, 0, tm, fmt.Errorf("the call through the restart: %w\n%s", a.err, pr.log.String())
		case !a.ok:
			return 0, 0, tm, errors.New("the restarted agent lost the first stream")
		}
		tm.ok = t0.Add(a.at)
		return a.at, exit, tm, nil
	}
	for {
		ok, err := p.IsOffloaded(probeRid(0))
		if err == nil {
			if !ok {
				return 0, 0, tm, errors.New("the restarted agent lost the first stream")
			}
			tm.ok = time.Now()
			return tm.ok.Sub(t0), exit, tm, nil
		}
		if time.Since(t0) > 30*time.Second {
			return 0, 0, tm, fmt.Errorf("not serving 30 s after the kill: %w\n%s", err, pr.log.String())
		}
		time.Sleep(time.Millisecond)
	}
}

// probeDevice makes the probe's simulated GPU: 16 device pages in two
// regions of 64 bytes a page.
func probeDevice() (cudart.Device, []cudart.Region, error) {
	uuid := cudart.SimulatedUUID(0)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1, UUIDs: []string{uuid}, MemoryBytes: 1 << 20})
	dev, err := sim.Open(0)
	if err != nil {
		return nil, nil, err
	}
	k, err1 := dev.MemAlloc(16 * 64)
	v, err2 := dev.MemAlloc(16 * 64)
	if err := errors.Join(err1, err2); err != nil {
		dev.Close()
		return nil, nil, err
	}
	return dev, []cudart.Region{{Base: k, Stride: 64, PageBytes: 64, Pages: 16}, {Base: v, Stride: 64, PageBytes: 64, Pages: 16}}, nil
}

// openProbe opens (or takes over) the probe's session i.
func openProbe(ctx context.Context, sock string, i int, dev cudart.Device, regions []cudart.Region, retry time.Duration) (*client.CPUPagePool, error) {
	return client.Open(ctx, client.Options{Socket: sock, Token: probeToken(i), Device: dev, Regions: regions, RetryFor: retry,
		InstanceID: []byte(fmt.Sprintf("kvbench-restart-%d", i)), Name: "kvbench-restart", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
}

func waitUntil(d time.Duration, cond func() bool) error {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return errors.New("timed out")
		}
		time.Sleep(2 * time.Millisecond)
	}
	return nil
}

// procRSS returns a process's resident memory and its anonymous part.
func procRSS(pid int) (rss, anon, peak int64) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, 0
	}
	defer f.Close()
	kb := func(v string) int64 {
		n, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
		return n << 10
	}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			rss = kb(v)
		}
		if v, ok := strings.CutPrefix(sc.Text(), "RssAnon:"); ok {
			anon = kb(v)
		}
		if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			peak = kb(v)
		}
	}
	return rss, anon, peak
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
