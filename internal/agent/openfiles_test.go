package agent

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/sizing"
)

// A plan whose chunks need more files than the process may open is
// refused, and says what to change; one that leaves too little room for
// the tenants' connections is warned of; one that fits, or a limit of
// none, passes.
func TestCheckOpenFiles(t *testing.T) {
	plan := func(chunks ...int) *sizing.Plan {
		p := &sizing.Plan{}
		for _, n := range chunks {
			p.GPUs = append(p.GPUs, sizing.GPUPlan{Chunks: n})
		}
		return p
	}
	const refused, warned, fine = "refused", "warned", "fine"
	for _, c := range []struct {
		name     string
		p        *sizing.Plan
		maxConns int
		limit    uint64
		want     string
	}{
		{"a few chunks", plan(4, 4), 1024, 4096, fine},
		{"a few chunks under a limit of 1,024", plan(4, 4), 1024, 1024, warned},
		{"a few chunks under a limit of 3,072", plan(4, 4), 1024, 3072, warned},
		{"just fits", plan(8000, 8000), 1024, 16000 + connFiles*1024 + fileHeadroom, fine},
		{"one connection's file short", plan(8000, 8000), 1024, 16000 + connFiles*1024 + fileHeadroom - 1, warned},
		{"the chunks just fit", plan(8000, 8000), 1024, 16000 + fileHeadroom, warned},
		{"one chunk's file short", plan(8000, 8000), 1024, 16000 + fileHeadroom - 1, refused},
		{"the chunk bound under a limit of 20,000", plan(4096, 4096, 4096, 4096), 1024, 20000, fine},
		{"the chunk bound under 16,384", plan(4096, 4096, 4096, 4096), 1024, 16384, refused},
		{"no limit", plan(16384), 1 << 20, unix.RLIM_INFINITY, fine},
	} {
		t.Run(c.name, func(t *testing.T) {
			warning, err := checkOpenFiles(c.p, c.maxConns, c.limit)
			got := fine
			switch {
			case err != nil:
				got = refused
				if !strings.Contains(err.Error(), "RLIMIT_NOFILE") || !strings.Contains(err.Error(), "fewer, larger chunks") {
					t.Fatalf("the refusal names neither the limit nor the remedy: %v", err)
				}
			case warning != "":
				got = warned
				if !strings.Contains(warning, "RLIMIT_NOFILE") || !strings.Contains(warning, "limits.maxConns") {
					t.Fatalf("the warning names neither the limit nor the connections: %s", warning)
				}
			}
			if got != c.want {
				t.Fatalf("checkOpenFiles: %s (%q, %v), want %s", got, warning, err, c.want)
			}
		})
	}
}

// An agent under a limit on open files that its plan does not fit stops at
// the plan, before it allocates anything. A child process: the limit is
// the process's.
func TestPlanPastTheOpenFileLimit(t *testing.T) {
	if os.Getenv("AGENT_NOFILE_CHILD") == "" {
		out := childOutput(t, "TestPlanPastTheOpenFileLimit", "AGENT_NOFILE_CHILD")
		if !strings.Contains(out, "--- PASS") {
			t.Fatalf("child:\n%s", out)
		}
		return
	}
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	lim.Cur = min(lim.Max, 512)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	cfg := config.Default()
	cfg.SocketDir, cfg.StateDir = filepath.Join(dir, "sock"), filepath.Join(dir, "state")
	cfg.Metrics.Address, cfg.Health.Address = "", ""
	_, err := Boot(context.Background(), Options{Config: &cfg, Standalone: true, ChunksPerGPU: 300, ChunkBytes: 2 << 20, Logger: quietLog})
	if err == nil || !strings.Contains(err.Error(), "RLIMIT_NOFILE") {
		t.Fatalf("boot with %d chunks under a limit of %d open files: %v, want the plan refused", 300*cfg.Standalone.GPUs, lim.Cur, err)
	}
	if ents, _ := os.ReadDir("/proc/self/fd"); len(ents) > 64 {
		t.Fatalf("%d files open after the refused boot: the plan allocated", len(ents))
	}
}
