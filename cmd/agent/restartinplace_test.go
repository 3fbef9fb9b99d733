package main

import (
	"bufio"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/supervise"
)

// With restartInPlace the agent kubelet would start supervises: a
// SIGKILLed agent is serving again without the supervisor ending, says so
// in its log and metrics, and the kill past the budget ends the
// supervisor with the agent's status (128 + SIGKILL) for kubelet to see.
func TestRestartInPlace(t *testing.T) {
	dir := t.TempDir()
	c := spawnAgent(t, nil, "--standalone", "--socket", filepath.Join(dir, "sock", "kvpool.sock"),
		"--state-dir", filepath.Join(dir, "state"), "--chunks-per-gpu", "1", "--chunk-mib", "2",
		"--log-format", "json", "--restart-in-place-max", "1")
	c.log.wait(t, "supervising the agent: a dead agent is restarted in place", map[string]any{"max": float64(1)})
	c.log.wait(t, "kvpool agent serving", nil)
	first := childOf(t, c.cmd.Process.Pid)
	if err := syscall.Kill(first, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	c.log.wait(t, "agent ended abnormally; restarting it in place", map[string]any{"exit": "signal: killed", "restart": float64(1)})
	c.log.wait(t, "restarted in place: the agent before this one in this container died", map[string]any{"lastExit": "signal: killed", "restartsInPlace": float64(1)})
	for end := time.Now().Add(20 * time.Second); len(c.log.all("kvpool agent serving")) < 2; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("the agent restarted in place never served; log:\n%s", c.log.String())
		}
	}
	second := childOf(t, c.cmd.Process.Pid)
	if second == first {
		t.Fatalf("the same child %d after its SIGKILL", first)
	}
	serving := c.log.all("kvpool agent serving")
	if v := metricValue(t, serving[1]["metrics"].(string), "kvpool_agent_restarts_in_place_total"); v != 1 {
		t.Fatalf("kvpool_agent_restarts_in_place_total %v after one restart in place, want 1", v)
	}

	// The budget is spent: the next kill ends the supervisor, with the
	// status a container's exit code would show.
	if err := syscall.Kill(second, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-c.done:
		c.done <- err
		if c.cmd.ProcessState == nil || c.cmd.ProcessState.ExitCode() != 137 {
			t.Fatalf("the supervisor ended with %v, want exit status 137", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the supervisor did not end past its budget")
	}
	c.log.wait(t, "agent ended abnormally: restarts in place spent, exiting for kubelet to restart the container", map[string]any{"exit": "signal: killed"})
}

// childOf is the one child process of pid.
func childOf(t *testing.T, pid int) int {
	t.Helper()
	for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		var kids []int
		procs, _ := filepath.Glob("/proc/[0-9]*/status")
		for _, p := range procs {
			b, err := os.ReadFile(p)
			if err != nil {
				continue
			}
			if _, rest, ok := strings.Cut(string(b), "\nPPid:\t"); ok && strings.HasPrefix(rest, strconv.Itoa(pid)+"\n") {
				n, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
				kids = append(kids, n)
			}
		}
		if len(kids) == 1 {
			return kids[0]
		}
	}
	t.Fatalf("process %d has not one child", pid)
	return 0
}

// metricValue scrapes one unlabelled series from the agent's /metrics at
// addr (-1 where it is absent).
func metricValue(t *testing.T, addr, name string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(io.LimitReader(resp.Body, 8<<20))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	return -1
}

// The child's view of its supervisor, and a supervisor's variables in the
// environment of an agent that is nobody's child.
func TestRestartedInPlace(t *testing.T) {
	for _, tc := range []struct {
		env    map[string]string
		n      int
		reason string
	}{
		{map[string]string{}, 0, ""},
		{map[string]string{supervise.EnvRestarts: "3", supervise.EnvLastExit: "exit status 2"}, 0, ""}, // not a child
		{map[string]string{supervise.EnvChild: "1", supervise.EnvRestarts: "0"}, 0, ""},
		{map[string]string{supervise.EnvChild: "1", supervise.EnvRestarts: "2", supervise.EnvLastExit: "signal: killed"}, 2, "signal: killed"},
		{map[string]string{supervise.EnvChild: "1", supervise.EnvRestarts: "-1"}, 0, ""},
		{map[string]string{supervise.EnvChild: "1", supervise.EnvRestarts: "many"}, 0, ""},
	} {
		n, reason := restartedInPlace(func(k string) string { return tc.env[k] })
		if n != tc.n || reason != tc.reason {
			t.Errorf("%v: %d %q, want %d %q", tc.env, n, reason, tc.n, tc.reason)
		}
	}
}
