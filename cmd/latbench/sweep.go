package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/wire"
)

// The concurrency sweep (-sweep): many callers doing offload+reload pairs
// at once, against one agent, with the client's spin off, always on (the
// rule before issue 25) and under the budgeted rule (the default), all in
// the same run. Callers are goroutines of one process, each with its own
// session (one simulated GPU each), or processes with one session each.

// sweepGPUs is the agent's simulated GPUs in a sweep: one session each, at
// most the agent's sessions per allocation.
const sweepGPUs = 64

// spinModes are the client spin settings a sweep compares.
var spinModes = map[string]struct {
	wait time.Duration
	rule wire.SpinRule
}{
	"off":    {-1, wire.SpinBudgeted},
	"always": {client.DefaultSpinWait, wire.SpinAlways},
	"rule":   {client.DefaultSpinWait, wire.SpinBudgeted},
	// Spin off under another name: against "off" it reads what two
	// identical modes differ by in the same sitting, the sweep's noise.
	"control": {-1, wire.SpinBudgeted},
}

// sweepCell is one measured case: callers×procs sessions under one spin mode.
type sweepCell struct {
	Placement   string
	Spin        string
	Procs       int // client processes
	Sessions    int // sessions (calling goroutines) per process
	Pairs       int
	PairsPerSec float64
	P50, P99    float64 // µs, offload+reload
	Load1       float64 // the 1-minute load average when the cell ended
	// What the clients' spins did, per pair (wire.SpinStats): spins run,
	// yields of the CPU between their polls, replies a spin took.
	Spins, Yields, Taken float64
}

// sweepConfig is what the sweep flags ask for.
type sweepConfig struct {
	sessions, procs []int
	spins           []string
	dur             time.Duration
	repeat          int
	pages           int
	pageBytes       int
}

func parseInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f == "" {
			continue
		}
		v, err := strconv.Atoi(f)
		if err != nil || v < 1 || v > sweepGPUs {
			return nil, fmt.Errorf("%q: want counts from 1 to %d", f, sweepGPUs)
		}
		out = append(out, v)
	}
	return out, nil
}

// sweepCases lists (procs, sessions) pairs: sessions in one process, then
// processes of one session each (the lone caller once).
func (c sweepConfig) cases() [][2]int {
	var out [][2]int
	for _, s := range c.sessions {
		out = append(out, [2]int{1, s})
	}
	for _, p := range c.procs {
		if !slices.Contains(out, [2]int{p, 1}) {
			out = append(out, [2]int{p, 1})
		}
	}
	return out
}

// runSweep measures every case of cfg in the placement: the agent on
// agentCPUs, every client process on clientCPUs. The spin modes of a case
// and their repeats run back to back, in an order that turns from repeat
// to repeat, so that they meet the same machine load.
func runSweep(dir, name string, agentCPUs, clientCPUs []int, cfg sweepConfig) ([]sweepCell, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	sock := filepath.Join(dir, "sweep.sock")
	os.Remove(sock)
	agent := exec.Command(self, "-role", "agent", "-socket", sock, "-gpus", strconv.Itoa(sweepGPUs))
	agent.Stderr = os.Stderr
	aout, _ := agent.StdoutPipe()
	ain, _ := agent.StdinPipe()
	if err := startPinned(agent, agentCPUs); err != nil {
		return nil, err
	}
	defer func() { ain.Close(); _ = agent.Wait() }()
	line, err := bufio.NewReader(aout).ReadString('\n')
	tok, ok := strings.CutPrefix(strings.TrimSpace(line), "ready ")
	if err != nil || !ok {
		return nil, fmt.Errorf("agent did not start: %q %v", line, err)
	}
	var cells []sweepCell
	for _, cs := range cfg.cases() {
		for rep := range cfg.repeat {
			for i := range cfg.spins {
				spin := cfg.spins[(i+rep)%len(cfg.spins)]
				c, err := sweepOne(self, sock, tok, clientCPUs, cs[0], cs[1], spin, cfg)
				if err != nil {
					return cells, fmt.Errorf("%d procs x %d sessions, spin %s: %w", cs[0], cs[1], spin, err)
				}
				c.Placement = name
				cells = append(cells, c)
				fmt.Fprintf(os.Stderr, "latbench: %s, %d x %d, spin %s: %.0f pairs/s, p50 %.1f µs, p99 %.1f µs, %.2f spins and %.2f yields a pair, load %.2f\n",
					name, c.Procs, c.Sessions, c.Spin, c.PairsPerSec, c.P50, c.P99, c.Spins, c.Yields, c.Load1)
			}
		}
	}
	return cells, nil
}

// sweepOne starts procs client processes of sessions sessions each, lets
// them all call for cfg.dur at once and gathers their figures.
func sweepOne(self, sock, tok string, cpus []int, procs, sessions int, spin string, cfg sweepConfig) (sweepCell, error) {
	cell := sweepCell{Spin: spin, Procs: procs, Sessions: sessions}
	type child struct {
		cmd *exec.Cmd
		in  io.WriteCloser
		out *bufio.Reader
	}
	var kids []child
	defer func() {
		for _, k := range kids {
			k.in.Close()
			_ = k.cmd.Wait() // a child that failed said so on stderr
		}
	}()
	for p := range procs {
		cmd := exec.Command(self, "-role", "sweep", "-socket", sock, "-token", tok, "-spin-mode", spin,
			"-gpu-base", strconv.Itoa(p*sessions), "-sessions", strconv.Itoa(sessions),
			"-pages", strconv.Itoa(cfg.pages), "-page-bytes", strconv.Itoa(cfg.pageBytes), "-no-lane="+strconv.FormatBool(noLane))
		cmd.Stderr = os.Stderr
		in, _ := cmd.StdinPipe()
		out, _ := cmd.StdoutPipe()
		if err := startPinned(cmd, cpus); err != nil {
			return cell, err
		}
		kids = append(kids, child{cmd, in, bufio.NewReader(out)})
	}
	for _, k := range kids {
		if line, err := k.out.ReadString('\n'); err != nil || strings.TrimSpace(line) != "ready" {
			return cell, fmt.Errorf("a client did not start: %q %v", line, err)
		}
	}
	for _, k := range kids {
		fmt.Fprintf(k.in, "go %d\n", cfg.dur.Nanoseconds())
	}
	var lat []int64
	var spins [3]int64 // the clients' spins, yields and replies taken
	for _, k := range kids {
		line, err := k.out.ReadString('\n')
		if err != nil {
			return cell, fmt.Errorf("client: %w", err)
		}
		f := strings.Fields(line)
		if len(f) < 6 || f[0] != "done" {
			return cell, fmt.Errorf("client: %.80q", strings.TrimSpace(line))
		}
		count, err1 := strconv.Atoi(f[1])
		elapsed, err2 := strconv.ParseInt(f[2], 10, 64)
		var st [3]int64
		var errs []error
		for i := range st {
			var err error
			st[i], err = strconv.ParseInt(f[3+i], 10, 64)
			errs = append(errs, err)
		}
		l, err3 := parseLatencies(strings.Join(f[6:], " "))
		if err := errors.Join(append(errs, err1, err2, err3)...); err != nil || elapsed <= 0 || len(l) != count {
			return cell, fmt.Errorf("client: bad report %.80q: %v", line, err)
		}
		cell.Pairs += count
		cell.PairsPerSec += float64(count) / (float64(elapsed) / 1e9)
		for i := range st {
			spins[i] += st[i]
		}
		lat = append(lat, l...)
	}
	s := summarize(lat)
	cell.P50, cell.P99 = s.P50, s.P99
	if n := float64(cell.Pairs); n > 0 {
		cell.Spins, cell.Yields, cell.Taken = float64(spins[0])/n, float64(spins[1])/n, float64(spins[2])/n
	}
	cell.Load1 = load1()
	return cell, nil
}

// load1 is the 1-minute load average (0 where /proc says nothing).
func load1() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64) // 0 on a malformed file
	return v
}

// sweepMain is one client process of a sweep: sessions sessions on the
// agent's GPUs base.., each called by its own goroutine for the time the
// "go NS" line on stdin gives; it prints "done PAIRS ELAPSED_NS SPINS
// YIELDS TAKEN" (what its spins did meanwhile, wire.SpinStats) and every
// pair's offload+reload time in ns.
func sweepMain(socket, token, mode string, base, sessions, pages, pageBytes int) error {
	m, ok := spinModes[mode]
	if !ok {
		return fmt.Errorf("unknown spin mode %q (off, always, rule, control)", mode)
	}
	if err := wire.SetSpinRule(m.rule); err != nil {
		return err
	}
	if base < 0 || sessions < 1 || base+sessions > sweepGPUs {
		return fmt.Errorf("GPUs %d..%d outside the agent's %d", base, base+sessions-1, sweepGPUs)
	}
	devPages := 2 * pages
	uuids := make([]string, sessions)
	for i := range uuids {
		uuids[i] = cudart.SimulatedUUID(base + i)
	}
	sim := cudart.NewSim(cudart.SimOptions{Devices: sessions, UUIDs: uuids, MemoryBytes: 2*uint64(devPages*pageBytes) + 1<<20})
	callers := make([]func(timed func()) error, sessions)
	for i := range sessions {
		f, closeFn, err := openCaller(sim, i, socket, token, base+i, pages, pageBytes, m.wait)
		if err != nil {
			return fmt.Errorf("session %d: %w", base+i, err)
		}
		defer closeFn()
		callers[i] = f
	}
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	if !in.Scan() {
		return errors.New("no go line")
	}
	var ns int64
	if _, err := fmt.Sscanf(in.Text(), "go %d", &ns); err != nil || ns <= 0 {
		return fmt.Errorf("bad go line %q", in.Text())
	}
	lats := make([][]int64, sessions)
	errs := make([]error, sessions)
	before := wire.ReadSpinStats()
	start := time.Now()
	end := start.Add(time.Duration(ns))
	var wg sync.WaitGroup
	for i := range sessions {
		wg.Go(func() {
			for errs[i] == nil && time.Now().Before(end) {
				t := time.Now()
				var d time.Duration
				errs[i] = callers[i](func() { d = time.Since(t) })
				lats[i] = append(lats[i], d.Nanoseconds())
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	after := wire.ReadSpinStats()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	out := bufio.NewWriter(os.Stdout)
	var total int
	for _, l := range lats {
		total += len(l)
	}
	fmt.Fprintf(out, "done %d %d %d %d %d", total, elapsed.Nanoseconds(),
		after.Spins-before.Spins, after.Yields-before.Yields, after.Taken-before.Taken)
	for _, l := range lats {
		for _, d := range l {
			_ = out.WriteByte(' ') // bufio keeps the first error for Flush
			_, _ = out.WriteString(strconv.FormatInt(d, 10))
		}
	}
	_ = out.WriteByte('\n')
	return out.Flush()
}

// openCaller opens the session of the agent's GPU gpu on the simulator's
// device ordinal and returns a call that does one offload+reload pair,
// calls timed after the reload's reply, then waits for its copies.
func openCaller(sim *cudart.Sim, ordinal int, socket, token string, gpu, pages, pageBytes int, spin time.Duration) (func(timed func()) error, func(), error) {
	devPages := 2 * pages
	dev, err := sim.Open(ordinal)
	if err != nil {
		return nil, nil, err
	}
	size := uint64(devPages * pageBytes)
	k, err1 := dev.MemAlloc(size)
	v, err2 := dev.MemAlloc(size)
	if err := errors.Join(err1, err2); err != nil {
		dev.Close()
		return nil, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// The same instance per GPU from run to run: a process takes over the
	// session its predecessor on that GPU left.
	p, err := client.Open(ctx, client.Options{Socket: socket, Token: token, Device: dev,
		InstanceID: []byte(fmt.Sprintf("latbench-sweep-%d", gpu)), MaxPages: 4 * pages,
		Name: "kvpool-latbench-sweep", SpinWait: spin, NoLane: noLane, Regions: []cudart.Region{
			{Base: k, Stride: uint64(pageBytes), PageBytes: uint64(pageBytes), Pages: devPages},
			{Base: v, Stride: uint64(pageBytes), PageBytes: uint64(pageBytes), Pages: devPages},
		}})
	if err != nil {
		dev.Close()
		return nil, nil, err
	}
	gpuPages := make([]int32, pages)
	for i := range gpuPages {
		gpuPages[i] = int32(i * 37 % devPages)
	}
	rid := fmt.Sprintf("%s-%d", rid, gpu)
	call := func(timed func()) error {
		ok, err := p.OffloadStream(rid, label, gpuPages, int64(pages)*16, int64(pages)*16, 0)
		if err == nil && !ok {
			err = errors.New("offload refused: pool full")
		}
		if err == nil {
			_, err = p.ReloadStream(rid, label, gpuPages)
		}
		timed()
		if err == nil {
			err = p.Sync(0)
		}
		if err == nil {
			err = dev.StreamSynchronize(0)
		}
		return err
	}
	return call, func() { p.Close(); dev.Close() }, nil
}

// printSweep prints the cells of a sweep, one row per case and placement
// with every spin mode side by side, and each mode's ratio to spin off.
func printSweep(w io.Writer, cells []sweepCell, spins []string) {
	type key struct {
		pl              string
		procs, sessions int
	}
	var keys []key
	by := map[key]map[string][]sweepCell{}
	for _, c := range cells {
		k := key{c.Placement, c.Procs, c.Sessions}
		if by[k] == nil {
			by[k] = map[string][]sweepCell{}
			keys = append(keys, k)
		}
		by[k][c.Spin] = append(by[k][c.Spin], c)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprint(tw, "placement\tprocs x sessions")
	for _, s := range spins {
		fmt.Fprintf(tw, "\t%s: pairs/s, p50/p99 µs", s)
	}
	fmt.Fprint(tw, "\tload\n")
	for _, k := range keys {
		fmt.Fprintf(tw, "%s\t%d x %d", k.pl, k.procs, k.sessions)
		for _, s := range spins {
			var parts []string
			for _, c := range by[k][s] {
				parts = append(parts, fmt.Sprintf("%.0f %.0f/%.0f", c.PairsPerSec, c.P50, c.P99))
			}
			fmt.Fprintf(tw, "\t%s", strings.Join(parts, "; "))
		}
		var loads []string
		for _, c := range by[k][spins[0]] {
			loads = append(loads, strconv.FormatFloat(c.Load1, 'f', 1, 64))
		}
		fmt.Fprintf(tw, "\t%s\n", strings.Join(loads, ","))
	}
	tw.Flush()

	// Then each mode against spin off over the repeats (repeat i of a mode
	// beside repeat i of spin off, run back to back): the median of the
	// ratios, their range and how many fell below 1 (pairs/s) or above 1
	// (p99), and what the mode's spins did a pair.
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprint(tw, "placement\tprocs x sessions\tspin\tpairs/s vs off: median (range, below 1)\tp99 vs off: median (range, above 1)\tspins / yields / replies taken a pair\n")
	for _, k := range keys {
		off := by[k]["off"]
		for _, sp := range spins {
			cs := by[k][sp]
			act := fmt.Sprintf("%.2f / %.2f / %.2f", mean(cs, func(c sweepCell) float64 { return c.Spins }),
				mean(cs, func(c sweepCell) float64 { return c.Yields }), mean(cs, func(c sweepCell) float64 { return c.Taken }))
			tput, tail := "-", "-"
			if sp != "off" && len(off) > 0 {
				tput = pairedRatios(cs, off, func(c sweepCell) float64 { return c.PairsPerSec }, false)
				tail = pairedRatios(cs, off, func(c sweepCell) float64 { return c.P99 }, true)
			}
			fmt.Fprintf(tw, "%s\t%d x %d\t%s\t%s\t%s\t%s\n", k.pl, k.procs, k.sessions, sp, tput, tail, act)
		}
	}
	tw.Flush()
}

// mean is the mean of f over cells (0 for none).
func mean(cells []sweepCell, f func(sweepCell) float64) float64 {
	if len(cells) == 0 {
		return 0
	}
	var sum float64
	for _, c := range cells {
		sum += f(c)
	}
	return sum / float64(len(cells))
}

// pairedRatios sums up f(cells[i]) / f(off[i]) over the repeats both
// have: the median, the range and how many ratios fell on the bad side of
// 1 (below it, or above it where high is bad).
func pairedRatios(cells, off []sweepCell, f func(sweepCell) float64, highIsBad bool) string {
	var rs []float64
	for i := range min(len(cells), len(off)) {
		if d := f(off[i]); d > 0 {
			rs = append(rs, f(cells[i])/d)
		}
	}
	if len(rs) == 0 {
		return "-"
	}
	slices.Sort(rs)
	bad := 0
	for _, r := range rs {
		if (highIsBad && r > 1) || (!highIsBad && r < 1) {
			bad++
		}
	}
	med := rs[len(rs)/2]
	if len(rs)%2 == 0 {
		med = (rs[len(rs)/2-1] + rs[len(rs)/2]) / 2
	}
	return fmt.Sprintf("%.2f (%.2f-%.2f, %d of %d)", med, rs[0], rs[len(rs)-1], bad, len(rs))
}
