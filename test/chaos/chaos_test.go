// Package chaos kills the agent under a verified workload and checks that
// nothing committed is lost: a keeper process (agent keeper), an agent
// process (standalone, with the keeper) and several client processes
// (chaosclient) that keep a checksum of every stream they offloaded. The
// agent is killed with SIGKILL and SIGTERM at random points and restarted
// each time; the clients must end with zero lost or corrupted streams, the
// pool must be adopted whole every time (no chunk pinned twice), and the
// agent's memory and fds and the keeper's memfds must stay bounded.
//
// KVPOOL_CHAOS_KILLS and KVPOOL_CHAOS_TERMS set the numbers of SIGKILLs
// and SIGTERMs (default 100 and 20); KVPOOL_CHAOS_MAX_UP_MS the longest
// the agent runs between two kills, in milliseconds (default 400).
//
// TestKeeperLossChaos (keeperloss_test.go) takes the keeper away instead:
// KVPOOL_CHAOS_KEEPER_ROUNDS rounds (default 6) of SIGKILL, SIGTERM and
// SIGSTOP of the keeper under the same clients. TestSpareRestartChaos
// (spare_test.go) runs the agent as the chart does, under its own
// supervisor with a spare that reads the books ahead, and SIGKILLs the
// serving child KVPOOL_CHAOS_SPARE_KILLS times (default 40).
package chaos

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/keeper"
	"github.com/kvpool/kvpool/internal/logging"
	"github.com/kvpool/kvpool/pkg/wire"
)

const (
	gpus         = 2
	chunksPerGPU = 4
	chunkMiB     = 4
	chunks       = gpus * chunksPerGPU
)

var tokens = []string{"token-a", "token-b"}

func envInt(t *testing.T, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		t.Fatalf("%s=%q: %v", name, v, err)
	}
	return n
}

func build(t *testing.T, dir, pkg string) string {
	t.Helper()
	out := filepath.Join(dir, filepath.Base(pkg))
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Stderr = os.Stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("build %s: %v", pkg, err)
	}
	return out
}

// setup builds the agent and the chaos client, and returns them, where
// the keeper's and the agent's sockets go (the agent's directory is what
// pods mount; the state directory, with the tokens, is not inside it),
// and the standalone agent's arguments.
func setup(t *testing.T) (agentBin, clientBin, keeperSock, agentSock string, args []string) {
	t.Helper()
	bin := t.TempDir()
	agentBin = build(t, bin, "github.com/kvpool/kvpool/cmd/agent")
	clientBin = build(t, bin, "github.com/kvpool/kvpool/test/chaos/chaosclient")
	dir := t.TempDir()
	keeperSock = filepath.Join(dir, "keeper", "keeper.sock")
	agentSock = filepath.Join(dir, "sock", "kv.sock")
	if err := os.Mkdir(filepath.Dir(agentSock), 0o755); err != nil {
		t.Fatal(err)
	}
	args = []string{"--standalone", "--socket", agentSock, "--keeper-socket", keeperSock,
		"--standalone-gpus", strconv.Itoa(gpus), "--chunks-per-gpu", strconv.Itoa(chunksPerGPU), "--chunk-mib", strconv.Itoa(chunkMiB),
		"--state-dir", filepath.Join(dir, "state"), "--log-level", "info", "--standalone-tokens", strings.Join(tokens, ",")}
	return agentBin, clientBin, keeperSock, agentSock, args
}

// startKeeperProc starts a keeper process on keeperSock and waits until
// it answers; it returns the process and its log.
func startKeeperProc(t *testing.T, agentBin, keeperSock string) (*exec.Cmd, *logging.SyncBuffer) {
	t.Helper()
	kp := exec.Command(agentBin, "keeper", "--socket", keeperSock, "--log-level", "warn")
	log := &logging.SyncBuffer{}
	kp.Stderr = log
	if err := kp.Start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { _, err := keeper.Query(keeperSock); return err == nil })
	return kp, log
}

type agentProc struct {
	cmd *exec.Cmd
	log *logging.SyncBuffer
}

// clientResult is what a chaosclient prints (its Result).
type clientResult struct {
	Ops, Offloads, Refused, Reloads, Removes, Checks      int
	Lost, Corrupt, ErrorCount, Final, SlowCalls, Sessions int
	Errors                                                []string
	LongestCall                                           float64
	LongOffloads                                          int
}

func TestAgentRestartChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos test: skipped with -short")
	}
	kills := envInt(t, "KVPOOL_CHAOS_KILLS", 100)
	terms := envInt(t, "KVPOOL_CHAOS_TERMS", 20)
	maxUp := time.Duration(envInt(t, "KVPOOL_CHAOS_MAX_UP_MS", 400)) * time.Millisecond
	agentBin, clientBin, keeperSock, agentSock, args := setup(t)
	kp, keeperLog := startKeeperProc(t, agentBin, keeperSock)
	defer func() {
		kp.Process.Signal(syscall.SIGTERM)
		kp.Wait()
		if _, err := os.Stat(keeperSock); err == nil {
			t.Error("the keeper left its socket behind")
		}
	}()

	start := func() *agentProc {
		a := &agentProc{cmd: exec.Command(agentBin, args...), log: &logging.SyncBuffer{}}
		a.cmd.Stderr = a.log
		if err := a.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		return a
	}
	ag := start()
	defer func() {
		if ag != nil {
			ag.cmd.Process.Kill()
			ag.cmd.Wait()
		}
	}()
	waitFor(t, func() bool { return hello(agentSock) == nil })

	clients := startClients(t, clientBin, agentSock)
	defer stopClients(clients)

	signals := slices.Repeat([]syscall.Signal{syscall.SIGKILL}, kills)
	signals = append(signals, slices.Repeat([]syscall.Signal{syscall.SIGTERM}, terms)...)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	rng.Shuffle(len(signals), func(i, j int) { signals[i], signals[j] = signals[j], signals[i] })
	t.Logf("%d SIGKILLs and %d SIGTERMs, the agent up for up to %v between them", kills, terms, maxUp)

	var gaps, reported []time.Duration
	var maxRSS, maxFDs, maxKeeperFDs int64
	var maxBooks int64
	sample := func() {
		rss, fds := procStats(ag.cmd.Process.Pid)
		maxRSS, maxFDs = max(maxRSS, rss), max(maxFDs, fds)
		_, kfds := procStats(kp.Process.Pid)
		maxKeeperFDs = max(maxKeeperFDs, kfds)
		st, err := keeper.Query(keeperSock)
		if err != nil {
			t.Fatalf("keeper: %v", err)
		}
		// Pinned memory is never allocated twice: the keeper holds the
		// planned chunks, no more.
		if st.Chunks != chunks || st.Bytes != chunks*chunkMiB<<20 {
			t.Fatalf("the keeper holds %d chunks, %d bytes; want %d, %d", st.Chunks, st.Bytes, chunks, chunks*chunkMiB<<20)
		}
		maxBooks = max(maxBooks, st.BooksBytes)
	}
	adoptRE := regexp.MustCompile(`pool adopted from the keeper" chunks=(\d+)`)
	gapRE := regexp.MustCompile(`serving again after a restart" gap=(\S+)`)
	for i, sig := range signals {
		up := time.Duration(rng.Int64N(int64(maxUp)))
		deadline := time.Now().Add(up)
		for time.Now().Before(deadline) {
			time.Sleep(min(20*time.Millisecond, time.Until(deadline)))
			sample()
		}
		killed := time.Now()
		ag.cmd.Process.Signal(sig)
		ag.cmd.Wait()
		if sig == syscall.SIGTERM && !ag.cmd.ProcessState.Success() {
			t.Fatalf("kill %d: SIGTERM: exit %v\n%s", i, ag.cmd.ProcessState, ag.log)
		}
		ag = start()
		waitForAgent(t, ag, i, sig, func() bool { return hello(agentSock) == nil })
		gaps = append(gaps, time.Since(killed))
		// Every restart adopts the whole pool.
		waitForAgent(t, ag, i, sig, func() bool { return gapRE.Match(ag.log.Bytes()) })
		m := adoptRE.FindSubmatch(ag.log.Bytes())
		if m == nil || string(m[1]) != strconv.Itoa(chunks) {
			t.Fatalf("restart %d (%v): the agent did not adopt all %d chunks:\n%s", i, sig, chunks, ag.log)
		}
		if g := gapRE.FindSubmatch(ag.log.Bytes()); g != nil {
			if d, err := time.ParseDuration(string(g[1])); err == nil {
				reported = append(reported, d)
			}
		}
		if strings.Contains(ag.log.String(), "level=ERROR") {
			t.Fatalf("restart %d: the agent logged an error:\n%s", i, ag.log)
		}
		sample()
	}
	// Let the clients run a little on the last agent, then stop them: each
	// verifies every stream it still holds.
	time.Sleep(300 * time.Millisecond)
	total := finishClients(t, clients)
	if total.Offloads < len(signals) || total.Reloads == 0 {
		t.Errorf("too little work to mean anything: %d offloads, %d reloads", total.Offloads, total.Reloads)
	}
	slices.Sort(gaps)
	slices.Sort(reported)
	t.Logf("gap from kill to serving (harness): p50 %v, p99 %v, max %v over %d restarts",
		pct(gaps, 50), pct(gaps, 99), gaps[len(gaps)-1], len(gaps))
	if len(reported) > 0 {
		t.Logf("gap the agent reported (last sign of life to serving): p50 %v, p99 %v", pct(reported, 50), pct(reported, 99))
	}
	t.Logf("bounded: agent RSS max %d MiB, agent fds max %d, keeper fds max %d, books memfd max %d MiB; keeper held %d chunks of %d MiB throughout",
		maxRSS>>20, maxFDs, maxKeeperFDs, maxBooks>>20, chunks, chunkMiB)
	t.Logf("streams: %d offloaded, %d reloaded and verified, %d verified at the end, %d offloads refused", total.Offloads, total.Reloads, total.Final, total.Refused)
	// Bounds: the chunks the agent maps (32 MiB) plus a Go process; fds:
	// chunks, books, keeper, sockets and clients; the keeper: chunks and books.
	if maxRSS > 256<<20 || maxFDs > 64 || maxKeeperFDs > 32 || maxBooks > 64<<20 {
		t.Errorf("resources not bounded: agent RSS %d MiB, fds %d; keeper fds %d; books %d MiB", maxRSS>>20, maxFDs, maxKeeperFDs, maxBooks>>20)
	}
	if strings.Contains(keeperLog.String(), "level=ERROR") {
		t.Errorf("the keeper logged an error:\n%s", keeperLog.String())
	}
}

// clientProc is one chaosclient process.
type clientProc struct {
	cmd   *exec.Cmd
	stdin interface{ Close() error }
	out   bytes.Buffer
	errb  bytes.Buffer
}

// startClients starts the clients: every token on every GPU; the last
// one's streams are sometimes longer than a packet's page list (pages,
// offload and more, resent across kills).
func startClients(t *testing.T, clientBin, agentSock string) []*clientProc {
	t.Helper()
	var clients []*clientProc
	for i, tok := range tokens {
		for g := range gpus {
			c := &clientProc{}
			args := []string{"--socket", agentSock, "--token", tok, "--gpu", strconv.Itoa(g), "--seed", strconv.Itoa(100 + i*gpus + g)}
			if i == len(tokens)-1 && g == gpus-1 {
				args = append(args, "--long")
			}
			c.cmd = exec.Command(clientBin, args...)
			c.cmd.Stdout, c.cmd.Stderr = &c.out, &c.errb
			in, err := c.cmd.StdinPipe()
			if err != nil {
				t.Fatal(err)
			}
			c.stdin = in
			if err := c.cmd.Start(); err != nil {
				t.Fatal(err)
			}
			clients = append(clients, c)
		}
	}
	return clients
}

// stopClients kills the clients still running.
func stopClients(clients []*clientProc) {
	for _, c := range clients {
		if c.cmd.ProcessState == nil {
			c.cmd.Process.Kill()
			c.cmd.Wait()
		}
	}
}

// finishClients stops the clients, each verifying every stream it still
// holds, and wants none lost, corrupt or failed, and one session each. It
// returns their totals.
func finishClients(t *testing.T, clients []*clientProc) clientResult {
	t.Helper()
	var total clientResult
	for _, c := range clients {
		c.stdin.Close()
	}
	for i, c := range clients {
		if err := c.cmd.Wait(); err != nil {
			t.Fatalf("client %d: %v\n%s", i, err, c.errb.String())
		}
		var r clientResult
		if err := json.Unmarshal(c.out.Bytes(), &r); err != nil {
			t.Fatalf("client %d: result %q: %v", i, c.out.String(), err)
		}
		t.Logf("client %d: %d ops, %d offloads (%d refused, %d long), %d reloads, %d removes, %d checks, %d verified at the end; %d calls waited for a restart, the longest %.3fs; sessions %d",
			i, r.Ops, r.Offloads, r.Refused, r.LongOffloads, r.Reloads, r.Removes, r.Checks, r.Final, r.SlowCalls, r.LongestCall, r.Sessions)
		if i == len(clients)-1 && r.LongOffloads == 0 {
			t.Errorf("client %d made no offload longer than one packet", i)
		}
		if r.Lost != 0 || r.Corrupt != 0 || r.ErrorCount != 0 || r.Sessions != 1 {
			t.Errorf("client %d: %d lost, %d corrupt, %d errors, %d sessions: %q", i, r.Lost, r.Corrupt, r.ErrorCount, r.Sessions, r.Errors)
		}
		total.Offloads += r.Offloads
		total.Reloads += r.Reloads
		total.Final += r.Final
		total.Refused += r.Refused
		total.LongestCall = max(total.LongestCall, r.LongestCall)
	}
	return total
}

func pct(d []time.Duration, p int) time.Duration {
	return d[min(len(d)-1, len(d)*p/100)]
}

// hello opens the agent's socket and exchanges a protocol greeting.
func hello(path string) error {
	c, err := net.DialTimeout(wire.Network, path, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	pkt, err := wire.AppendPacket(nil, wire.Header{Op: wire.OpHello, Seq: 1}, &wire.Hello{Version: wire.Version, Client: "chaos"})
	if err != nil {
		return err
	}
	if _, err := c.Write(pkt); err != nil {
		return err
	}
	buf := make([]byte, wire.MaxMessage)
	n, err := c.Read(buf)
	if err != nil {
		return err
	}
	h, _, err := wire.ParseHeader(buf[:n])
	if err != nil {
		return err
	}
	if h.Status != wire.StatusOK {
		return fmt.Errorf("hello: %s", h.Status)
	}
	return nil
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// waitForAgent is waitFor for the restarted agent: it fails at the
// agent's first logged error, and when it times out it says which restart
// it was and prints the agent's log and its goroutines (SIGQUIT), so that
// either can be read from the CI output.
func waitForAgent(t *testing.T, ag *agentProc, i int, sig syscall.Signal, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if bytes.Contains(ag.log.Bytes(), []byte("level=ERROR")) {
			t.Fatalf("restart %d (after %v): the agent logged an error:\n%s", i, sig, ag.log)
		}
		if time.Now().After(deadline) {
			ag.cmd.Process.Signal(syscall.SIGQUIT)
			ag.cmd.Wait()
			t.Fatalf("restart %d (after %v): the agent is not serving after 20s; exit %v; its log:\n%s", i, sig, ag.cmd.ProcessState, ag.log)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// procStats returns a process's resident memory and open fds.
func procStats(pid int) (rss, fds int64) {
	if f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
				kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
				rss = kb << 10
			}
		}
		f.Close()
	}
	if ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid)); err == nil {
		fds = int64(len(ents))
	}
	return rss, fds
}
