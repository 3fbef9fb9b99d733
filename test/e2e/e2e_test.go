// Package e2e runs the real agent and kvclient binaries as separate OS
// processes: an agent in standalone mode and several clients, each with its
// own simulated GPU, one of them killed with SIGKILL mid-workload.
package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/logging"
)

// goTool finds the go command (go test puts its own on PATH).
func goTool(t *testing.T) string {
	p, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go tool on PATH to build the binaries")
	}
	return p
}

// build compiles the commands into dir as they ship (Dockerfile): the agent
// with cgo (NVML needs it), the kvclient without.
func build(t *testing.T, dir string) (agent, kvclient string) {
	t.Helper()
	agent, kvclient = filepath.Join(dir, "agent"), filepath.Join(dir, "kvclient")
	for _, b := range []struct{ out, pkg, cgo string }{{agent, "./cmd/agent", "1"}, {kvclient, "./cmd/kvclient", "0"}} {
		cmd := exec.Command(goTool(t), "build", "-o", b.out, b.pkg)
		cmd.Dir = "../.."
		cmd.Env = append(os.Environ(), "CGO_ENABLED="+b.cgo)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("build %s: %v\n%s", b.pkg, err, out)
		}
	}
	return agent, kvclient
}

type proc struct {
	cmd   *exec.Cmd
	done  chan error
	out   *logging.SyncBuffer // stdout and stderr, written by two goroutines
	lines chan string
}

// start runs a binary, collecting its stderr and stdout and sending stderr
// lines on p.lines.
func start(t *testing.T, name string, args ...string) *proc {
	t.Helper()
	p := &proc{cmd: exec.Command(name, args...), done: make(chan error, 1), out: &logging.SyncBuffer{}, lines: make(chan string, 1024)}
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.cmd.Stdout = p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			line := sc.Text()
			select {
			case p.lines <- line:
			default:
			}
			fmt.Fprintln(p.cmd.Stdout, line)
		}
	}()
	go func() { <-copied; p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		if p.cmd.ProcessState == nil {
			p.cmd.Process.Kill()
		}
	})
	return p
}

func (p *proc) wait(t *testing.T, d time.Duration) error {
	t.Helper()
	select {
	case err := <-p.done:
		return err
	case <-time.After(d):
		p.cmd.Process.Kill()
		t.Fatalf("%s did not finish in %v; output:\n%s", p.cmd.Path, d, p.out.String())
		return nil
	}
}

// waitLine waits for a stderr line containing s.
func (p *proc) waitLine(t *testing.T, s string, d time.Duration) {
	t.Helper()
	timeout := time.After(d)
	for {
		select {
		case l := <-p.lines:
			if strings.Contains(l, s) {
				return
			}
		case <-timeout:
			t.Fatalf("no line with %q within %v", s, d)
		}
	}
}

func waitSocket(t *testing.T, path string) {
	t.Helper()
	for range 600 {
		if c, err := net.Dial("unixpacket", path); err == nil {
			c.Close()
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("agent socket %s never answered", path)
}

func TestAgentAndClientsAcrossProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs binaries")
	}
	dir := t.TempDir()
	agentBin, clientBin := build(t, dir)
	sock := filepath.Join(dir, "sock", "kvpool.sock")
	const token = "e2e-token"
	agent := start(t, agentBin, "--standalone", "--socket", sock, "--standalone-gpus", "3", "--chunks-per-gpu", "1",
		"--chunk-mib", "4", "--standalone-tokens", token)
	waitSocket(t, sock)

	client := func(gpu int, extra ...string) *proc {
		args := append([]string{"-socket", sock, "-token", token, "-gpu", fmt.Sprint(gpu),
			"-device-pages", "128", "-page-bytes", "4096", "-max-pages", "64", "-max-stream", "12"}, extra...)
		return start(t, clientBin, args...)
	}
	a := client(0, "-ops", "400", "-seed", "1")
	victim := client(1, "-duration", "60s", "-seed", "2")
	// Kill the victim once it is well into its mixed workload, while a is
	// running too.
	victim.waitLine(t, "progress 100 ", 60*time.Second)
	if err := victim.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := victim.wait(t, 10*time.Second); err == nil {
		t.Fatal("the victim exited cleanly; it should have been killed")
	}
	b := client(2, "-ops", "400", "-seed", "3")
	for name, p := range map[string]*proc{"a (GPU 0)": a, "b (GPU 2)": b} {
		if err := p.wait(t, 120*time.Second); err != nil {
			t.Fatalf("client %s failed: %v\n%s", name, err, p.out.String())
		}
		if !strings.Contains(p.out.String(), "kvclient: OK") {
			t.Fatalf("client %s did not report OK:\n%s", name, p.out.String())
		}
	}
	// A new process on the dead client's GPU starts clean: the dead
	// session's pages went back (its full-pool checks would fail
	// otherwise).
	c := client(1, "-ops", "200", "-seed", "4")
	if err := c.wait(t, 120*time.Second); err != nil {
		t.Fatalf("replacement client on GPU 1 failed: %v\n%s", err, c.out.String())
	}
	// The agent is still up and shuts down gracefully on SIGTERM.
	select {
	case err := <-agent.done:
		t.Fatalf("agent exited early: %v\n%s", err, agent.out.String())
	default:
	}
	agent.cmd.Process.Signal(syscall.SIGTERM)
	if err := agent.wait(t, 10*time.Second); err != nil {
		t.Fatalf("agent exit after SIGTERM: %v\n%s", err, agent.out.String())
	}
	out := agent.out.String()
	for _, want := range []string{"session replaced", "session disconnected", "kvpool agent stopped"} {
		if !strings.Contains(out, want) {
			t.Errorf("agent log lacks %q:\n%s", want, out)
		}
	}
	if _, err := os.Stat(sock); err == nil {
		t.Error("agent left its socket file behind")
	}
}

// TestBenchCommand runs `kvbench --json` as a user would (embedded agent,
// worker processes) and checks its report.
func TestBenchCommand(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs binaries")
	}
	dir := t.TempDir()
	bench := filepath.Join(dir, "kvbench")
	b := exec.Command(goTool(t), "build", "-o", bench, "./cmd/kvbench")
	b.Dir = "../.."
	if out, err := b.CombinedOutput(); err != nil {
		t.Fatalf("build ./cmd/kvbench: %v\n%s", err, out)
	}
	cmd := exec.Command(bench, "--json", "--duration", "1s", "--page-kib", "16", "--max-pages", "64")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("kvbench: %v\n%s\n%s", err, out, stderr.String())
	}
	var rep struct {
		Workers    int `json:"workers"`
		Mismatches int `json:"mismatches"`
		Checks     int `json:"checks"`
		Errors     []string
		Ops        []struct {
			Op       string  `json:"op"`
			Count    int     `json:"count"`
			RTTp50us float64 `json:"round_trip_p50_us"`
			Copyp50  float64 `json:"copy_p50_us"`
		} `json:"ops"`
		EchoP50us float64 `json:"echo_floor_p50_us"`
		Full      int     `json:"pool_full_rejects"`
	}
	if err := json.Unmarshal(out, &rep); err != nil {
		t.Fatalf("bench JSON: %v\n%s", err, out)
	}
	if rep.Workers != 2 || rep.Mismatches != 0 || len(rep.Errors) != 0 || rep.Checks == 0 || rep.EchoP50us <= 0 || rep.Full == 0 {
		t.Fatalf("report: %+v", rep)
	}
	seen := map[string]bool{}
	for _, o := range rep.Ops {
		seen[o.Op] = o.Count > 0 && o.RTTp50us > 0
		if (o.Op == "offload" || o.Op == "reload") && o.Copyp50 <= 0 {
			t.Errorf("%s has no copy time", o.Op)
		}
	}
	for _, op := range []string{"offload", "reload", "discard", "remove_request"} {
		if !seen[op] {
			t.Errorf("no %s calls with round trips in %+v", op, rep.Ops)
		}
	}
	if !strings.Contains(stderr.String(), "mixed ops so far") {
		t.Errorf("no progress on stderr:\n%s", stderr.String())
	}
}
