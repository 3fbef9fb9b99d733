// Command latbench measures the cross-process round trip of kvpool calls
// against a blocking echo floor measured in the same run.
//
//	go run ./cmd/latbench [-n 20000] [-cpus 0,1] [-json]
//
// It compiles testdata/echo.c (a plain blocking SOCK_SEQPACKET echo in C)
// with $CC, cc or gcc, starts an embedded standalone agent in a child
// process and a Go client (pkg/client over the simulator) in another, and
// for each CPU placement times, in alternating rounds:
//
//   - is_offloaded through the client against one echo exchange of the same
//     packet sizes;
//   - an offload of 64 pages followed by their reload against two echo
//     exchanges of those packets' sizes.
//
// Two rows more set the transport beside the floor, with is_offloaded's
// packet sizes and no kvpool: a bare echo between two Go processes over
// wire.Conn (the socket as kvpool uses it), and one over a pair of pipes
// (read and write, blocking, by raw system calls: what a transport that
// left the socket for the hot path could start from; hack/floors.c has
// the C side of it).
//
// Placements: "one CPU" (both processes pinned to the first CPU, as taskset
// -c 0 would), "two CPUs" (the agent on the first, the client on the
// second) and "shared" (both allowed on both). The C client and server are
// pinned exactly as the Go ones. Each child computes its GOMAXPROCS from
// the CPUs it may use, as under taskset.
package main

import (
	"bufio"
	"context"
	_ "embed"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/standalone"
	"github.com/kvpool/kvpool/pkg/wire"
)

//go:embed testdata/echo.c
var echoC []byte

const (
	rid   = "request-000001"
	label = "layer-group-0"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "latbench:", err)
		os.Exit(1)
	}
}

// run reads better whole (over 80 lines): the flag list, then the roles and placements it dispatches to.
func run(args []string) error {
	fs := flag.NewFlagSet("latbench", flag.ContinueOnError)
	n := fs.Int("n", 20000, "timed calls of each kind per placement")
	warm := fs.Int("warmup", 500, "untimed calls before each timed batch")
	// Many short rounds: a KVM guest's round trips came in phases of
	// 0.1-1 s, 12-14 µs in some and 16-21 in others (the host's doing),
	// and four rounds of 10,000 calls let a phase fall on one side: the
	// Go echo's p50 ratio to the C echo went 1.13-1.36 from run to run
	// with four rounds, 1.08-1.19 over 21 runs of forty.
	rounds := fs.Int("rounds", 40, "alternating floor/kvpool rounds the calls are split into")
	pages := fs.Int("pages", 64, "pages per offload and reload")
	pageBytes := fs.Int("page-bytes", 128, "bytes per page in each of the K and V regions (the simulator copies them)")
	cpus := fs.String("cpus", "", "two CPUs to place the processes on (default: the first two this process may use)")
	only := fs.String("placements", "one,two,shared", "placements to run")
	spin := fs.Duration("spin", 0, "the client's SpinWait: how long a call polls for the reply before sleeping (0: the client's default, negative: never)")
	fs.BoolVar(&noLane, "no-lane", false, "the clients keep their calls on the socket (client.Options.NoLane): the transport before lanes, for comparison")
	asJSON := fs.Bool("json", false, "print JSON")
	role := fs.String("role", "", "internal: agent or client")
	socket := fs.String("socket", "", "internal: agent socket")
	token := fs.String("token", "", "internal: allocation token")
	profile := fs.String("profile-dir", "", "write CPU profiles of the agent and client processes (agent-*.pprof, client-*.pprof) here")
	sweep := fs.Bool("sweep", false, "run the concurrency sweep instead: offload+reload pairs from many sessions at once, per spin mode")
	sessions := fs.String("sessions", "1,4,16,64", "sweep: sessions (calling goroutines) in one client process")
	procs := fs.String("procs", "1,4,16,64", "sweep: client processes of one session each")
	spins := fs.String("spins", "off,always,rule", "sweep: the client spin modes compared (off, always: the spin before issue 25, rule: the default, control: spin off again, what two identical modes read apart)")
	sweepTime := fs.Duration("sweep-time", time.Second, "sweep: how long each case calls")
	repeat := fs.Int("repeat", 3, "sweep: repeats of every case")
	gpus := fs.Int("gpus", 1, "internal: the agent's simulated GPUs")
	spinMode := fs.String("spin-mode", "rule", "internal: the sweep client's spin mode")
	gpuBase := fs.Int("gpu-base", 0, "internal: the sweep client's first GPU")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *profile != "" && *role != "" {
		f, err := os.Create(filepath.Join(*profile, fmt.Sprintf("%s-%d.pprof", *role, os.Getpid())))
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	switch *role {
	case "agent":
		return agentMain(*socket, *gpus)
	case "sweep":
		n, err := strconv.Atoi(*sessions)
		if err != nil {
			return fmt.Errorf("-sessions %q: %w", *sessions, err)
		}
		return sweepMain(*socket, *token, *spinMode, *gpuBase, n, *pages, *pageBytes)
	case "client":
		return clientMain(*socket, *token, *pages, *pageBytes, *spin)
	case "echo":
		return echoMain(*socket)
	case "echo-client":
		return echoClientMain(*socket, fs.Args())
	case "pipe-echo":
		return pipeEchoMain(fs.Args())
	case "pipe-echo-client":
		return pipeEchoClientMain(fs.Args())
	case "":
	default:
		return fmt.Errorf("unknown role %q", *role)
	}
	if *n < 100 || *rounds < 1 || *n/(*rounds) < 1 || *pages < 1 || *pageBytes < 1 || *warm < 0 {
		return errors.New("-n at least 100, -rounds, -pages and -page-bytes positive")
	}
	cpuA, cpuB, err := pickCPUs(*cpus)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "kvpool-latbench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	echo, cc, err := buildEcho(dir)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "latbench: echo floor built with %s; CPUs %d and %d\n", cc, cpuA, cpuB)
	placements := []struct {
		name           string
		agent, clientC []int
	}{
		{"one CPU", []int{cpuA}, []int{cpuA}},
		{"two CPUs", []int{cpuA}, []int{cpuB}},
		{"shared", []int{cpuA, cpuB}, []int{cpuA, cpuB}},
	}
	if *sweep {
		cfg := sweepConfig{spins: strings.Split(*spins, ","), dur: *sweepTime, repeat: *repeat, pages: *pages, pageBytes: *pageBytes}
		if cfg.sessions, err = parseInts(*sessions); err != nil {
			return fmt.Errorf("-sessions: %w", err)
		}
		if cfg.procs, err = parseInts(*procs); err != nil {
			return fmt.Errorf("-procs: %w", err)
		}
		for _, m := range cfg.spins {
			if _, ok := spinModes[m]; !ok {
				return fmt.Errorf("-spins: unknown mode %q (off, always, rule, control)", m)
			}
		}
		if cfg.dur <= 0 || cfg.repeat < 1 {
			return errors.New("-sweep-time and -repeat must be positive")
		}
		var cells []sweepCell
		for _, pl := range placements {
			if !slices.Contains(strings.Split(*only, ","), strings.Fields(pl.name)[0]) {
				continue
			}
			c, err := runSweep(dir, pl.name, pl.agent, pl.clientC, cfg)
			cells = append(cells, c...)
			if err != nil {
				return fmt.Errorf("%s: %w", pl.name, err)
			}
		}
		if *asJSON {
			e := json.NewEncoder(os.Stdout)
			e.SetIndent("", "  ")
			return e.Encode(cells)
		}
		printSweep(os.Stdout, cells, cfg.spins)
		return nil
	}
	sizes := packetSizes(*pages)
	var reps []placementReport
	for _, pl := range placements {
		key := strings.Fields(pl.name)[0]
		if !slices.Contains(strings.Split(*only, ","), key) {
			continue
		}
		r, err := runPlacement(dir, echo, pl.name, pl.agent, pl.clientC, sizes, *n, *warm, *rounds, *pages, *pageBytes, *spin, *profile)
		if err != nil {
			return fmt.Errorf("%s: %w", pl.name, err)
		}
		reps = append(reps, r)
	}
	if *asJSON {
		e := json.NewEncoder(os.Stdout)
		e.SetIndent("", "  ")
		return e.Encode(reps)
	}
	printReports(os.Stdout, reps)
	return nil
}

// pickCPUs returns the two CPUs to use.
func pickCPUs(spec string) (int, int, error) {
	if spec != "" {
		f := strings.Split(spec, ",")
		if len(f) != 2 {
			return 0, 0, fmt.Errorf("-cpus %q: want two CPUs, A,B", spec)
		}
		a, err1 := strconv.Atoi(f[0])
		b, err2 := strconv.Atoi(f[1])
		if err1 != nil || err2 != nil || a < 0 || b < 0 {
			return 0, 0, fmt.Errorf("-cpus %q: want two CPU numbers", spec)
		}
		return a, b, nil
	}
	var s unix.CPUSet
	if err := unix.SchedGetaffinity(0, &s); err != nil {
		return 0, 0, err
	}
	var got []int
	for c := 0; c < 1024 && len(got) < 2; c++ {
		if s.IsSet(c) {
			got = append(got, c)
		}
	}
	if len(got) < 2 {
		return 0, 0, errors.New("fewer than two CPUs available; pass -placements one")
	}
	return got[0], got[1], nil
}

// buildEcho compiles the C echo floor.
func buildEcho(dir string) (string, string, error) {
	src := filepath.Join(dir, "echo.c")
	if err := os.WriteFile(src, echoC, 0o600); err != nil {
		return "", "", err
	}
	var tried []string
	for _, cc := range []string{os.Getenv("CC"), "cc", "gcc", "clang"} {
		if cc == "" {
			continue
		}
		path, err := exec.LookPath(cc)
		if err != nil {
			tried = append(tried, cc)
			continue
		}
		bin := filepath.Join(dir, "echo")
		out, err := exec.Command(path, "-O2", "-o", bin, src).CombinedOutput()
		if err != nil {
			return "", "", fmt.Errorf("compile the echo floor with %s: %v: %s", cc, err, out)
		}
		return bin, cc, nil
	}
	return "", "", fmt.Errorf("no C compiler to build the echo floor (tried %s); install gcc or set $CC", strings.Join(tried, ", "))
}

// sizes are the packet sizes of the measured calls, encoded as the client
// and the agent encode them.
type sizes struct {
	isOffReq, isOffRep int
	offReq, offRep     int
	relReq, relRep     int
}

func packetSizes(n int) sizes {
	dev, host := make([]int32, n), make([]int32, n)
	for i := range dev {
		dev[i], host[i] = int32(i*37%(2*n)), int32(i)
	}
	enc := func(op wire.Op, m proto.Message) int {
		pkt, err := wire.AppendPacket(nil, wire.Header{Op: op, Seq: 1 << 20, Fence: 1 << 20}, m)
		if err != nil {
			panic(err)
		}
		return len(pkt)
	}
	return sizes{
		isOffReq: enc(wire.OpIsOffloaded, &wire.Request{Rid: rid}),
		isOffRep: enc(wire.OpIsOffloaded, &wire.IsOffloadedReply{Offloaded: true}),
		offReq:   enc(wire.OpOffload, &wire.Offload{Rid: rid, Label: label, GpuPages: dev, StoredLen: int64(n) * 16, Position: int64(n) * 16}),
		offRep:   enc(wire.OpOffload, &wire.OffloadReply{Ok: true, HostPages: host}),
		relReq:   enc(wire.OpReload, &wire.Reload{Rid: rid, Label: label, GpuPages: dev}),
		relRep:   enc(wire.OpReload, &wire.ReloadReply{HostPages: host, StoredLen: int64(n) * 16, Position: int64(n) * 16, Ticket: 1 << 20}),
	}
}

// startPinned starts cmd allowed only on cpus: the child inherits the
// affinity of the thread that forks it.
func startPinned(cmd *exec.Cmd, cpus []int) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var old, set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &old); err != nil {
		return err
	}
	for _, c := range cpus {
		set.Set(c)
	}
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		return fmt.Errorf("pin to CPUs %v: %w", cpus, err)
	}
	err := cmd.Start()
	if rerr := unix.SchedSetaffinity(0, &old); err == nil {
		err = rerr
	}
	return err
}

type stats struct {
	P50, P90, P99 float64 // µs
	N             int
}

func summarize(ns []int64) stats {
	slices.Sort(ns)
	q := func(p float64) float64 { return float64(ns[int(p*float64(len(ns)-1))]) / 1e3 }
	return stats{P50: q(.5), P90: q(.9), P99: q(.99), N: len(ns)}
}

type row struct {
	What   string
	Floor  stats
	KVPool stats
	Ratio  [3]float64 // p50, p90, p99
}

type placementReport struct {
	Placement      string
	AgentCPUs      []int
	ClientCPUs     []int
	ClientMaxProcs int
	Rows           []row
}

// runPlacement measures one placement. It reads better whole (over 80
// lines): the processes it starts are stopped by its defers, after every
// measurement of the placement.
func runPlacement(dir, echo, name string, agentCPUs, clientCPUs []int, sz sizes, n, warm, rounds, pages, pageBytes int, spin time.Duration, profile string) (placementReport, error) {
	rep := placementReport{Placement: name, AgentCPUs: agentCPUs, ClientCPUs: clientCPUs}
	self, err := os.Executable()
	if err != nil {
		return rep, err
	}
	sock := filepath.Join(dir, "kv.sock")
	esock := filepath.Join(dir, "echo.sock")
	os.Remove(sock)
	os.Remove(esock)

	agent := exec.Command(self, "-role", "agent", "-socket", sock, "-profile-dir", profile)
	agent.Stderr = os.Stderr
	aout, _ := agent.StdoutPipe()
	ain, _ := agent.StdinPipe()
	if err := startPinned(agent, agentCPUs); err != nil {
		return rep, err
	}
	defer func() { ain.Close(); _ = agent.Wait() }() // its exit status after stdin closes says nothing more
	ar := bufio.NewReader(aout)
	line, err := ar.ReadString('\n')
	tok, ok := strings.CutPrefix(strings.TrimSpace(line), "ready ")
	if err != nil || !ok {
		return rep, fmt.Errorf("agent did not start: %q %v", line, err)
	}

	srv := exec.Command(echo, "serve", esock)
	sout, _ := srv.StdoutPipe()
	if err := startPinned(srv, agentCPUs); err != nil {
		return rep, err
	}
	defer func() { _ = srv.Process.Kill(); _ = srv.Wait() }() // killed: the status is "killed"
	if line, err := bufio.NewReader(sout).ReadString('\n'); err != nil || strings.TrimSpace(line) != "ready" {
		return rep, fmt.Errorf("echo server did not start: %q %v", line, err)
	}

	gsock := filepath.Join(dir, "goecho.sock")
	os.Remove(gsock)
	gsrv := exec.Command(self, "-role", "echo", "-socket", gsock)
	gsrv.Stderr = os.Stderr
	gout, _ := gsrv.StdoutPipe()
	gin, _ := gsrv.StdinPipe()
	if err := startPinned(gsrv, agentCPUs); err != nil {
		return rep, err
	}
	defer func() { gin.Close(); _ = gsrv.Wait() }()
	if line, err := bufio.NewReader(gout).ReadString('\n'); err != nil || strings.TrimSpace(line) != "ready" {
		return rep, fmt.Errorf("the Go echo server did not start: %q %v", line, err)
	}

	cl := exec.Command(self, "-role", "client", "-socket", sock, "-token", tok,
		"-pages", strconv.Itoa(pages), "-page-bytes", strconv.Itoa(pageBytes), "-spin", spin.String(), "-profile-dir", profile,
		"-no-lane="+strconv.FormatBool(noLane))
	cl.Stderr = os.Stderr
	cin, _ := cl.StdinPipe()
	cout, _ := cl.StdoutPipe()
	if err := startPinned(cl, clientCPUs); err != nil {
		return rep, err
	}
	defer func() { cin.Close(); _ = cl.Wait() }()
	cr := bufio.NewReader(cout)
	line, err = cr.ReadString('\n')
	mp, ok := strings.CutPrefix(strings.TrimSpace(line), "ready ")
	if err != nil || !ok {
		return rep, fmt.Errorf("client did not start: %q %v", line, err)
	}
	rep.ClientMaxProcs, _ = strconv.Atoi(mp)

	goCall := func(kind string, count int) ([]int64, error) {
		fmt.Fprintf(cin, "%s %d %d\n", kind, count, warm)
		line, err := cr.ReadString('\n')
		if err != nil {
			return nil, fmt.Errorf("client: %w", err)
		}
		return parseLatencies(line)
	}
	// timed runs an echo client on the client's CPUs and returns the
	// latencies it printed, less the warm-up's.
	timed := func(what string, c *exec.Cmd) ([]int64, error) {
		var out strings.Builder
		c.Stdout, c.Stderr = &out, os.Stderr
		if err := startPinned(c, clientCPUs); err != nil {
			return nil, err
		}
		if err := c.Wait(); err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		l, err := parseLatencies(strings.ReplaceAll(out.String(), "\n", " "))
		if err != nil {
			return nil, err
		}
		return l[warm:], nil
	}
	cCall := func(count int, pairs ...int) ([]int64, error) {
		args := []string{"call", esock, strconv.Itoa(count + warm)}
		for _, p := range pairs {
			args = append(args, strconv.Itoa(p))
		}
		return timed("echo client", exec.Command(echo, args...))
	}
	kinds := []struct {
		what, kind string
		pairs      []int
	}{
		{"is_offloaded", "isoff", []int{sz.isOffReq, sz.isOffRep}},
		{fmt.Sprintf("offload+reload, %d pages", pages), "offrel", []int{sz.offReq, sz.offRep, sz.relReq, sz.relRep}},
	}
	per := n / rounds
	// The transport alone: a bare echo between two Go processes over
	// wire.Conn, with is_offloaded's packet sizes. Its client is a process
	// of its own, as the C echo's: the kvpool client's process has its
	// session's connection open, which would leave the echo's Conn to the
	// poller (wire.Conn's direct Conns are limited to GOMAXPROCS-1, at
	// least one).
	goEcho := func(count int) ([]int64, error) {
		return timed("the Go echo client", exec.Command(self, "-role", "echo-client", "-socket", gsock,
			strconv.Itoa(count+warm), strconv.Itoa(sz.isOffReq), strconv.Itoa(sz.isOffRep)))
	}
	// alternated times rounds of per calls of call against as many of the
	// C echo with the floor's packet sizes, round by round, into a row.
	alternated := func(what string, floor []int, call func() ([]int64, error)) error {
		var fl, kv []int64
		for range rounds {
			f, err := cCall(per, floor...)
			if err != nil {
				return err
			}
			g, err := call()
			if err != nil {
				return err
			}
			fl, kv = append(fl, f...), append(kv, g...)
		}
		r := row{What: what, Floor: summarize(fl), KVPool: summarize(kv)}
		r.Ratio = [3]float64{r.KVPool.P50 / r.Floor.P50, r.KVPool.P90 / r.Floor.P90, r.KVPool.P99 / r.Floor.P99}
		rep.Rows = append(rep.Rows, r)
		return nil
	}
	isOff := []int{sz.isOffReq, sz.isOffRep}
	if err := alternated("Go echo over wire.Conn (no kvpool)", isOff, func() ([]int64, error) { return goEcho(per) }); err != nil {
		return rep, err
	}
	pipes, err := startPipeEcho(self, sz.isOffReq, sz.isOffRep, agentCPUs)
	if err != nil {
		return rep, err
	}
	defer func() { _ = pipes.stop() }() // its status after its input ends says nothing more
	if err := alternated("Go echo over a pipe pair (no kvpool)", isOff, func() ([]int64, error) {
		return timed("the Go pipe echo client", pipes.client(self, per+warm))
	}); err != nil {
		return rep, err
	}
	for _, k := range kinds {
		if err := alternated(k.what, k.pairs, func() ([]int64, error) { return goCall(k.kind, per) }); err != nil {
			return rep, err
		}
	}
	return rep, nil
}

// pipeEchoServer is the pipe echo's server process, started once a
// placement as the other echo servers are, with the parent's ends of its
// pipes, which each round's client inherits (exec.Cmd.ExtraFiles).
type pipeEchoServer struct {
	cmd                *exec.Cmd
	toSrv, toCli       *os.File // the parent's ends: the server's input, written, and its output, read
	reqBytes, repBytes int
}

// startPipeEcho starts the pipe echo's server on cpus, answering every
// request of req bytes with rep bytes.
func startPipeEcho(self string, req, rep int, cpus []int) (*pipeEchoServer, error) {
	toSrvR, toSrvW, err := blockingPipe()
	if err != nil {
		return nil, err
	}
	toCliR, toCliW, err := blockingPipe()
	if err != nil {
		toSrvR.Close()
		toSrvW.Close()
		return nil, err
	}
	cmd := exec.Command(self, "-role", "pipe-echo", strconv.Itoa(rep))
	cmd.ExtraFiles = []*os.File{toSrvR, toCliW}
	cmd.Stderr = os.Stderr
	err = startPinned(cmd, cpus)
	toSrvR.Close() // the server's ends are the server's now
	toCliW.Close()
	if err != nil {
		toSrvW.Close()
		toCliR.Close()
		return nil, err
	}
	return &pipeEchoServer{cmd: cmd, toSrv: toSrvW, toCli: toCliR, reqBytes: req, repBytes: rep}, nil
}

// blockingPipe is os.Pipe kept out of this process's network poller: with
// descriptors registered there, the pipe's traffic between the children
// also woke this process (0.4 wake-ups and one context switch more a
// call, counted with sched:sched_wakeup and sched:sched_switch), and the
// row read 1.4-1.5x the C echo at p90 on one CPU instead of 0.73-0.75.
func blockingPipe() (r, w *os.File, err error) {
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC); err != nil {
		return nil, nil, os.NewSyscallError("pipe2", err)
	}
	// Blocking descriptors: os.NewFile leaves them to the caller.
	return os.NewFile(uintptr(fds[0]), "pipe-echo-r"), os.NewFile(uintptr(fds[1]), "pipe-echo-w"), nil
}

// client returns a pipe echo client that times count exchanges.
func (p *pipeEchoServer) client(self string, count int) *exec.Cmd {
	c := exec.Command(self, "-role", "pipe-echo-client", strconv.Itoa(count), strconv.Itoa(p.reqBytes), strconv.Itoa(p.repBytes))
	c.ExtraFiles = []*os.File{p.toSrv, p.toCli}
	return c
}

// stop ends the server's input and waits for it.
func (p *pipeEchoServer) stop() error {
	p.toSrv.Close()
	err := p.cmd.Wait()
	p.toCli.Close()
	return err
}

// pipeBuf is PIPE_BUF on Linux: a write of at most that many bytes to a
// pipe is atomic, so one read takes one message whole.
const pipeBuf = 4096

// The pipe echo's descriptors in its processes (exec.Cmd.ExtraFiles): the
// server reads pipeToServer and writes pipeToClient, the client the other
// way round.
const pipeToServer, pipeToClient = 3, 4

// pipeRead and pipeWrite move one message over a blocking pipe by raw
// system calls, as the C echo does: the kernel's path and nothing of the
// runtime's. (A raw read that blocks delays a stop of the world until
// its data comes; these processes allocate nothing while they time.)
func pipeRead(fd int, b []byte) (int, error) {
	n, _, e := unix.RawSyscall(unix.SYS_READ, uintptr(fd), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	if e != 0 {
		return 0, os.NewSyscallError("read", e)
	}
	return int(n), nil
}

func pipeWrite(fd int, b []byte) error {
	n, _, e := unix.RawSyscall(unix.SYS_WRITE, uintptr(fd), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	if e != 0 {
		return os.NewSyscallError("write", e)
	}
	if int(n) != len(b) {
		return fmt.Errorf("short write %d of %d bytes", n, len(b))
	}
	return nil
}

// pipeEchoMain answers every message on its input pipe with args[0] bytes
// on its output pipe, until the input ends.
func pipeEchoMain(args []string) error {
	if len(args) != 1 {
		return fmt.Errorf("pipe-echo: want the reply's size, got %q", args)
	}
	r, err := strconv.Atoi(args[0])
	if err != nil || r < 1 || r > pipeBuf {
		return fmt.Errorf("pipe-echo: bad reply size %q (1 to %d)", args[0], pipeBuf)
	}
	buf, reply := make([]byte, pipeBuf), make([]byte, r)
	for {
		n, err := pipeRead(pipeToServer, buf)
		if err != nil || n == 0 {
			return err
		}
		if err := pipeWrite(pipeToClient, reply); err != nil {
			return err
		}
	}
}

// pipeEchoClientMain times args[0] exchanges of args[1] bytes, each
// answered by args[2], over its pipes, and prints their durations in ns
// on one line. A message up to PIPE_BUF bytes is written whole and, one
// at a time, read whole.
func pipeEchoClientMain(args []string) error {
	if len(args) != 3 {
		return fmt.Errorf("pipe-echo-client: want count, request and reply sizes, got %q", args)
	}
	var v [3]int
	for i := range v {
		x, err := strconv.Atoi(args[i])
		if err != nil || x < 1 || (i > 0 && x > pipeBuf) {
			return fmt.Errorf("pipe-echo-client: bad argument %q", args[i])
		}
		v[i] = x
	}
	req, buf := make([]byte, v[1]), make([]byte, pipeBuf)
	lat := make([]int64, 0, v[0])
	for range v[0] {
		t := time.Now()
		if err := pipeWrite(pipeToServer, req); err != nil {
			return err
		}
		n, err := pipeRead(pipeToClient, buf)
		d := time.Since(t)
		if err != nil {
			return err
		}
		if n != v[2] {
			return fmt.Errorf("pipe echo of %d bytes, want %d", n, v[2])
		}
		lat = append(lat, d.Nanoseconds())
	}
	out := bufio.NewWriter(os.Stdout)
	writeLatencies(out, lat)
	return out.Flush()
}

func parseLatencies(line string) ([]int64, error) {
	if msg, ok := strings.CutPrefix(line, "error "); ok {
		return nil, errors.New(strings.TrimSpace(msg))
	}
	f := strings.Fields(line)
	out := make([]int64, len(f))
	for i, s := range f {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("bad latency %q", s)
		}
		out[i] = v
	}
	if len(out) == 0 {
		return nil, errors.New("no latencies")
	}
	return out, nil
}

func printReports(w io.Writer, reps []placementReport) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "placement\tcall\tkvpool p50/p90/p99 µs\tC echo floor p50/p90/p99 µs\tratio p50/p90/p99")
	for _, r := range reps {
		for _, x := range r.Rows {
			fmt.Fprintf(tw, "%s (agent %v, client %v, client GOMAXPROCS %d)\t%s\t%.1f / %.1f / %.1f\t%.1f / %.1f / %.1f\t%.2f / %.2f / %.2f\n",
				r.Placement, r.AgentCPUs, r.ClientCPUs, r.ClientMaxProcs, x.What,
				x.KVPool.P50, x.KVPool.P90, x.KVPool.P99, x.Floor.P50, x.Floor.P90, x.Floor.P99, x.Ratio[0], x.Ratio[1], x.Ratio[2])
		}
	}
	tw.Flush()
}

// agentMain runs an embedded standalone agent until stdin closes.
func agentMain(socket string, gpus int) error {
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	chunk := int64(64 << 20)
	if gpus > 1 {
		chunk = 4 << 20 // a sweep's sessions take 256 pages each
	}
	a, err := standalone.Start(standalone.Config{GPUs: gpus, ChunksPerGPU: 1, ChunkBytes: chunk, Socket: socket, Logger: log})
	if err != nil {
		return err
	}
	defer a.Close()
	done := make(chan error, 1)
	ctx, cancel := contextWithCancel()
	go func() { done <- a.Serve(ctx) }()
	for t := range a.Tokens {
		fmt.Printf("ready %s\n", t)
		break
	}
	_, _ = io.Copy(io.Discard, os.Stdin) // the parent closes stdin to stop us
	cancel()
	return <-done
}

// clientMain opens a session and answers "KIND COUNT WARMUP" lines on
// stdin with one line of round-trip times in ns. It reads better whole
// (over 80 lines): the session and the calls it times live for its command
// loop.
// noLane is -no-lane: the kvpool clients (roles client and sweep) keep
// their calls on the socket.
var noLane bool

func clientMain(socket, token string, pages, pageBytes int, spin time.Duration) error {
	devPages := 2 * pages
	sim := cudart.NewSim(cudart.SimOptions{MemoryBytes: 2*uint64(devPages*pageBytes) + 1<<20})
	dev, err := sim.Open(0)
	if err != nil {
		return err
	}
	defer dev.Close()
	size := uint64(devPages * pageBytes)
	k, err := dev.MemAlloc(size)
	if err != nil {
		return err
	}
	v, err := dev.MemAlloc(size)
	if err != nil {
		return err
	}
	ctx, cancel := contextWithCancel()
	defer cancel()
	var p *client.CPUPagePool
	inst := []byte(fmt.Sprintf("latbench-%d", os.Getpid()))
	for try := 0; ; try++ {
		p, err = client.Open(ctx, client.Options{Socket: socket, Token: token, Device: dev, InstanceID: inst, MaxPages: 4 * pages,
			Name: "kvpool-latbench", SpinWait: spin, NoLane: noLane, Regions: []cudart.Region{
				{Base: k, Stride: uint64(pageBytes), PageBytes: uint64(pageBytes), Pages: devPages},
				{Base: v, Stride: uint64(pageBytes), PageBytes: uint64(pageBytes), Pages: devPages},
			}})
		var ce *client.Error
		if err == nil || try == 50 || !errors.As(err, &ce) || ce.Status != wire.StatusBusy {
			break
		}
		time.Sleep(20 * time.Millisecond) // the previous placement's session is still going away
	}
	if err != nil {
		return err
	}
	defer p.Close()
	gpu := make([]int32, pages)
	for i := range gpu {
		gpu[i] = int32(i * 37 % devPages)
	}
	isoff := func() error {
		ok, err := p.IsOffloaded(rid)
		if err == nil && ok {
			err = errors.New("is_offloaded: true for a request never offloaded")
		}
		return err
	}
	offrel := func() error {
		ok, err := p.OffloadStream(rid, label, gpu, int64(pages)*16, int64(pages)*16, 0)
		if err == nil && !ok {
			err = errors.New("offload refused: pool full")
		}
		if err == nil {
			_, err = p.ReloadStream(rid, label, gpu)
		}
		return err
	}
	settle := func() error {
		if err := p.Sync(0); err != nil {
			return err
		}
		return dev.StreamSynchronize(0)
	}
	fmt.Printf("ready %d\n", runtime.GOMAXPROCS(0))
	in := bufio.NewScanner(os.Stdin)
	out := bufio.NewWriter(os.Stdout)
	var lat []int64
	for in.Scan() {
		var kind string
		var count, warm int
		if _, err := fmt.Sscan(in.Text(), &kind, &count, &warm); err != nil || count < 1 || warm < 0 {
			return fmt.Errorf("bad command %q", in.Text())
		}
		f := isoff
		if kind == "offrel" {
			f = offrel
		}
		lat = lat[:0]
		var ferr error
		for i := 0; i < warm+count && ferr == nil; i++ {
			t := time.Now()
			ferr = f()
			d := time.Since(t)
			if ferr == nil && kind == "offrel" {
				ferr = settle()
			}
			if i >= warm {
				lat = append(lat, d.Nanoseconds())
			}
		}
		if ferr != nil {
			fmt.Fprintf(out, "error %v\n", ferr)
		} else {
			writeLatencies(out, lat)
		}
		if err := out.Flush(); err != nil {
			return err
		}
	}
	return in.Err()
}

// echoClientMain times args[0] exchanges with the Go echo at socket, of
// args[1] bytes asking for args[2] back, and prints their durations in ns
// on one line, as testdata/echo.c's client.
func echoClientMain(socket string, args []string) error {
	var n, q, r int
	if len(args) != 3 {
		return fmt.Errorf("echo-client: want count, request and reply sizes, got %q", args)
	}
	for i, p := range []*int{&n, &q, &r} {
		v, err := strconv.Atoi(args[i])
		if err != nil || v < 1 || (i > 0 && v > wire.MaxMessage) {
			return fmt.Errorf("echo-client: bad argument %q", args[i])
		}
		*p = v
	}
	if q < 4 {
		return errors.New("echo-client: a request has at least 4 bytes (the reply's size)")
	}
	c, err := wire.Dial(socket)
	if err != nil {
		return err
	}
	defer c.Close()
	c.RefuseFiles() // as a client's once its session is open
	req, buf := make([]byte, q), make([]byte, wire.MaxMessage+1)
	binary.LittleEndian.PutUint32(req, uint32(r))
	lat := make([]int64, 0, n)
	for range n {
		t := time.Now()
		if err := c.Send(req, nil); err != nil {
			return err
		}
		pkt, _, err := c.Recv(buf)
		d := time.Since(t)
		if err != nil {
			return err
		}
		if len(pkt) != r {
			return fmt.Errorf("echo of %d bytes, want %d", len(pkt), r)
		}
		lat = append(lat, d.Nanoseconds())
	}
	out := bufio.NewWriter(os.Stdout)
	writeLatencies(out, lat)
	return out.Flush()
}

// writeLatencies writes durations in ns on one line, as parseLatencies
// reads them; out keeps the first error for its Flush.
func writeLatencies(out *bufio.Writer, lat []int64) {
	for i, d := range lat {
		if i > 0 {
			_ = out.WriteByte(' ')
		}
		_, _ = out.WriteString(strconv.FormatInt(d, 10))
	}
	_ = out.WriteByte('\n')
}

// echoMain serves a bare echo over wire.Conn until stdin closes: the
// request's first 4 bytes give the reply's size, as testdata/echo.c.
func echoMain(socket string) error {
	l, err := net.ListenUnix(wire.Network, &net.UnixAddr{Name: socket, Net: wire.Network})
	if err != nil {
		return err
	}
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin) // the parent closes stdin to stop us
		l.Close()
	}()
	fmt.Println("ready")
	for {
		uc, err := l.AcceptUnix()
		if err != nil {
			return nil
		}
		go func() {
			c := wire.NewConn(uc)
			c.TryDirect()   // as the agent's session connections,
			c.RefuseFiles() // which take no files
			defer c.Close()
			buf := make([]byte, wire.MaxMessage+1)
			for {
				pkt, files, err := c.Recv(buf)
				for _, f := range files {
					f.Close()
				}
				if err != nil || len(pkt) < 4 {
					return
				}
				n := int(binary.LittleEndian.Uint32(pkt))
				if n < 1 || n > wire.MaxMessage || n > len(buf) {
					n = len(pkt)
				}
				if c.Send(buf[:n], nil) != nil {
					return
				}
			}
		}()
	}
}

func contextWithCancel() (context.Context, context.CancelFunc) {
	return context.WithCancel(context.Background())
}
