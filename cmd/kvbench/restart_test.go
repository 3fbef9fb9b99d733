package main

import (
	"context"
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
// does not serve every session's streams.
func TestRestartProbe(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the agent and kills it")
	}
	if err := runRestart(context.Background(), []string{"--streams", "2,301", "--sessions", "2", "--chunks", "4", "--restarts", "2", "--settle", "10ms", "--churn", "600"}); err != nil {
		t.Fatal(err)
	}
	// The gap timed by one call that rides out each restart.
	if err := runRestart(context.Background(), []string{"--streams", "1", "--restarts", "2", "--settle", "10ms", "--wait", "client"}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][]string{{"--streams", "0"}, {"--chunks", "0"}, {"--chunks", "1", "--chunk-mib", "16"},
		{"--sessions", "0"}, {"--sessions", "3", "--chunks", "2"}, {"--streams", "131073"}, {"--wait", "sometimes"}, {"--churn", "-1"}} {
		if err := runRestart(context.Background(), bad); err == nil {
			t.Fatalf("%q accepted", bad)
		}
	}
}
