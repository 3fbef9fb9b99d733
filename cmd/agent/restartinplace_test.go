package main

import (
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/supervise"
)

// With restartInPlace the agent kubelet would start supervises: a
// SIGKILLed agent is serving again without the supervisor ending (with a
// spare: the spare, already started, takes over), says so in its log and
// metrics, and the kill past the budget ends the supervisor with the
// agent's status (128 + SIGKILL) for kubelet to see.
func TestRestartInPlace(t *testing.T) {
	for _, spare := range []bool{false, true} {
		t.Run("spare="+strconv.FormatBool(spare), func(t *testing.T) {
			dir := t.TempDir()
			c := spawnAgent(t, nil, "--standalone", "--socket", filepath.Join(dir, "sock", "kvpool.sock"),
				"--state-dir", filepath.Join(dir, "state"), "--chunks-per-gpu", "1", "--chunk-mib", "2",
				"--log-format", "json", "--restart-in-place-max", "1",
				"--restart-in-place-spare="+strconv.FormatBool(spare), "--restart-in-place-spare-after", "0s")
			c.log.wait(t, "supervising the agent: a dead agent is restarted in place", map[string]any{"max": float64(1), "spare": spare})
			first := servingPID(t, c, 1)
			want := 1
			if spare {
				want = 2
			}
			kids := childrenOf(t, c.cmd.Process.Pid, want)
			if !slices.Contains(kids, first) {
				t.Fatalf("the serving agent %d is not a child of the supervisor (its children: %v)", first, kids)
			}
			if err := syscall.Kill(first, syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			c.log.wait(t, "agent ended abnormally; restarting it in place", map[string]any{"exit": "signal: killed", "restart": float64(1), "spare": spare})
			c.log.wait(t, "restarted in place: the agent before this one in this container died", map[string]any{"lastExit": "signal: killed", "restartsInPlace": float64(1)})
			second := servingPID(t, c, 2)
			switch {
			case second == first:
				t.Fatalf("the same agent %d serving after its SIGKILL", first)
			case spare && !slices.Contains(kids, second):
				t.Fatalf("the agent serving after the restart (%d) was not the spare (the children before: %v)", second, kids)
			}
			serving := c.log.all("kvpool agent serving")
			mresp, err := http.Get("http://" + serving[1]["metrics"].(string) + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(mresp.Body)
			mresp.Body.Close()
			if !regexp.MustCompile(`(?m)^kvpool_agent_restarts_in_place_total 1$`).Match(body) {
				t.Fatalf("no kvpool_agent_restarts_in_place_total of 1 after one restart in place:\n%s", grepLines(string(body), "restarts_in_place"))
			}

			// The budget is spent: the next kill ends the supervisor, with
			// the status a container's exit code would show, and no
			// process of it stays.
			if spare {
				kids = childrenOf(t, c.cmd.Process.Pid, 2) // the next spare
			}
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
			for _, pid := range kids {
				if running(pid) {
					t.Errorf("the supervisor's child %d outlived it", pid)
				}
			}
		})
	}
}

// servingPID is the pid the n-th "kvpool agent serving" line names.
func servingPID(t *testing.T, c *child, n int) int {
	t.Helper()
	for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if l := c.log.all("kvpool agent serving"); len(l) >= n {
			pid, _ := l[n-1]["pid"].(float64)
			return int(pid)
		}
	}
	t.Fatalf("no agent served a %d. time; log:\n%s", n, c.log.String())
	return 0
}

// childrenOf waits until pid has n child processes and returns them.
func childrenOf(t *testing.T, pid, n int) []int {
	t.Helper()
	var kids []int
	for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		kids = kids[:0]
		procs, _ := filepath.Glob("/proc/[0-9]*/status")
		for _, p := range procs {
			b, err := os.ReadFile(p)
			if err != nil {
				continue
			}
			if _, rest, ok := strings.Cut(string(b), "\nPPid:\t"); ok && strings.HasPrefix(rest, strconv.Itoa(pid)+"\n") {
				k, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
				kids = append(kids, k)
			}
		}
		if len(kids) == n {
			return kids
		}
	}
	t.Fatalf("process %d has %d children (%v), want %d", pid, len(kids), kids, n)
	return nil
}

// running says whether pid runs (a zombie has ended).
func running(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	i := strings.LastIndexByte(string(b), ')')
	return i < 0 || i+2 >= len(b) || b[i+2] != 'Z'
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
