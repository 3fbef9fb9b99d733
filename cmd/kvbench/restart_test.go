package main

import (
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMain lets the test binary serve as the adopt floor's child, which
// adoptFloor starts from its own executable.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == adoptChild {
		if err := runAdoptChild(os.Args[2:]); err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestAdoptFloor maps 1 MiB (and a size that is not a whole page) of
// stamped memfd pages in child processes, which check every page's
// stamp; bad sizes are refused.
func TestAdoptFloor(t *testing.T) {
	for _, n := range []int64{1 << 20, 3*adoptPage + 5} {
		ms, err := adoptFloor(n, 2)
		if err != nil {
			t.Fatal(err)
		}
		if len(ms) != 2 || ms[0] <= 0 || ms[1] <= 0 {
			t.Fatalf("%d bytes: %v ms", n, ms)
		}
	}
	if _, err := adoptFloor(0, 1); err == nil {
		t.Fatal("0 bytes accepted")
	}
	// Pages without their stamps (a fresh memfd reads zeros): page 1 fails.
	fd, err := unix.MemfdCreate("unstamped", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "unstamped")
	defer f.Close()
	if err := f.Truncate(2 * adoptPage); err != nil {
		t.Fatal(err)
	}
	c := exec.Command(os.Args[0], adoptChild, strconv.Itoa(2*adoptPage))
	c.ExtraFiles = []*os.File{f}
	if out, err := c.CombinedOutput(); err == nil || !strings.Contains(string(out), "page 1 reads 0") {
		t.Fatalf("unstamped pages: %v, %s", err, out)
	}
	for _, bad := range [][]string{nil, {"x"}, {"0"}, {"-4096"}, {"4095"}, {"4096", "8192"}} {
		if err := runAdoptChild(bad); err == nil {
			t.Fatalf("%q accepted", bad)
		}
	}
}

// TestRestartProbe runs the restart probe small: a keeper and an agent
// built from this tree, 2 and 301 streams over two sessions, churned by
// 600 calls, two SIGKILLs each; the probe fails when a restarted agent
// does not serve every session's streams. Each gap is split into its
// steps by the agents' log, and the steps add up to it.
func TestRestartProbe(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the agent and kills it")
	}
	out := captureStdout(t, func() error {
		return runRestart(context.Background(), []string{"--streams", "2,301", "--sessions", "2", "--chunks", "4", "--restarts", "2", "--settle", "10ms", "--churn", "600", "--json"})
	})
	var rep restartReport
	if err := json.Unmarshal(out, &rep); err != nil || len(rep.Cases) != 2 {
		t.Fatalf("the report: %v, %d cases\n%s", err, len(rep.Cases), out)
	}
	for _, c := range rep.Cases {
		if len(c.Steps) != len(c.GapsMs) {
			t.Fatalf("%d streams: %d gaps split of %d\n%s", c.Streams, len(c.Steps), len(c.GapsMs), out)
		}
		for i, s := range c.Steps {
			sum := s.total()
			if d := sum - c.GapsMs[i]; d > 0.01 || d < -0.01 || s.Load <= 0 || s.Rebuild <= 0 || s.Start <= 0 || s.Exit < c.ExitsMs[i] || s.After < 0 {
				t.Errorf("%d streams, restart %d: steps %+v add up to %.3f ms, the gap %.3f (exit %.3f)", c.Streams, i, s, sum, c.GapsMs[i], c.ExitsMs[i])
			}
		}
	}
	// Restarted by the agent's own supervisor, with a spare and without:
	// every restart from the spare in the first, none in the second, and
	// the steps (the exit and the start read from the supervisor's log)
	// adding up to each gap.
	for _, by := range []struct {
		name  string
		spare int
	}{{"spare", 2}, {"supervisor", 0}} {
		out := captureStdout(t, func() error {
			return runRestart(context.Background(), []string{"--streams", "1", "--restarts", "2", "--settle", "400ms", "--restart-by", by.name, "--json"})
		})
		var rep restartReport
		if err := json.Unmarshal(out, &rep); err != nil || len(rep.Cases) != 1 {
			t.Fatalf("--restart-by %s, the report: %v\n%s", by.name, err, out)
		}
		c := rep.Cases[0]
		if rep.RestartBy != by.name || c.FromSpare != by.spare || len(c.Steps) != 2 {
			t.Fatalf("--restart-by %s: %q, %d restarts from a spare, %d split\n%s", by.name, rep.RestartBy, c.FromSpare, len(c.Steps), out)
		}
		// The first spare had the fill and the settle to read the books
		// ahead (a later one may be woken before its first read).
		if ahead := c.Steps[0].ReadAhead; ahead != (by.spare > 0) {
			t.Fatalf("--restart-by %s: the first restart's books read ahead: %v\n%s", by.name, ahead, out)
		}
		for i, s := range c.Steps {
			sum := s.total()
			// The supervisor's and the agent's lines are timed to the ms.
			if d := sum - c.GapsMs[i]; d > 0.01 || d < -0.01 || s.Exit < -1 || s.Start < -1 {
				t.Errorf("--restart-by %s, restart %d: steps %+v add up to %.3f ms, the gap %.3f", by.name, i, s, sum, c.GapsMs[i])
			}
		}
	}
	// The gap timed by one call that rides out each restart, with request
	// IDs of an engine's length.
	if err := runRestart(context.Background(), []string{"--streams", "1", "--restarts", "2", "--settle", "10ms", "--wait", "client", "--rid-bytes", "48"}); err != nil {
		t.Fatal(err)
	}
	// Chunks over several simulated GPUs, a session's allocation taking
	// some of each.
	if err := runRestart(context.Background(), []string{"--streams", "1", "--restarts", "1", "--settle", "10ms", "--gpus", "2", "--chunks", "4"}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][]string{{"--streams", "0"}, {"--chunks", "0"}, {"--chunks", "1", "--chunk-mib", "16"},
		{"--sessions", "0"}, {"--sessions", "3", "--chunks", "2"}, {"--streams", "131073"}, {"--wait", "sometimes"}, {"--churn", "-1"}, {"--restart-by", "kubelet"}, {"--spare-after", "-1s"},
		{"--rid-bytes", "10"}, {"--rid-bytes", "1025"}, {"--gpus", "0"}, {"--gpus", "3", "--chunks", "4"}} {
		if err := runRestart(context.Background(), bad); err == nil {
			t.Fatalf("%q accepted", bad)
		}
	}
}

// captureStdout runs f with os.Stdout going to a pipe and returns what it
// wrote there.
func captureStdout(t *testing.T, f func() error) []byte {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	old := os.Stdout
	os.Stdout = w
	got := make(chan []byte)
	go func() {
		b, _ := io.ReadAll(r)
		got <- b
	}()
	ferr := f()
	os.Stdout = old
	w.Close()
	out := <-got
	r.Close()
	if ferr != nil {
		t.Fatalf("%v\n%s", ferr, out)
	}
	return out
}
