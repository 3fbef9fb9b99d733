package python

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// pythonExe is the interpreter the suite runs on: $KVPOOL_PYTHON, else
// Debian's /usr/bin/python3 (where apt's python3-pytest and python3-numpy
// land; a pyenv python3 earlier on PATH lacks them), else python3 on PATH.
func pythonExe() string {
	if p := os.Getenv("KVPOOL_PYTHON"); p != "" {
		return p
	}
	if _, err := os.Stat("/usr/bin/python3"); err == nil {
		return "/usr/bin/python3"
	}
	p, _ := exec.LookPath("python3")
	return p
}

// goBuild builds pkg into out without the test's flags: a c-shared library
// cannot be built with -race, and the agent needs none.
func goBuild(t testing.TB, ctx context.Context, out string, args ...string) {
	t.Helper()
	gobin := filepath.Join(os.Getenv("GOROOT"), "bin", "go")
	if _, err := os.Stat(gobin); err != nil {
		if gobin, err = exec.LookPath("go"); err != nil {
			t.Skipf("no go command to build %s: %v", out, err)
		}
	}
	cmd := exec.CommandContext(ctx, gobin, append([]string{"build", "-o", out}, args...)...)
	cmd.Dir = ".."
	cmd.Env = append(os.Environ(), "GOFLAGS=")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", strings.Join(args, " "), err, b)
	}
}

// TestPytest builds libkvpool.so and the agent and runs the Python suite
// (python/tests) against a real standalone agent process. It skips, saying
// why, where python3, pytest or numpy is missing.
func TestPytest(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the Python suite builds the agent and the C library")
	}
	py := pythonExe()
	if py == "" {
		t.Skip("no python3: install python3-pytest and python3-numpy (Debian) to run the Python client's suite")
	}
	if b, err := exec.Command(py, "-c", "import pytest, numpy").CombinedOutput(); err != nil {
		t.Skipf("%s lacks pytest or numpy (apt-get install python3-pytest python3-numpy): %s", py, strings.TrimSpace(string(b)))
	}
	ctx := context.Background()
	if dl, ok := t.Deadline(); ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, dl.Add(-15*time.Second))
		defer cancel()
	}
	dir := t.TempDir()
	lib := filepath.Join(dir, "libkvpool.so")
	agent := filepath.Join(dir, "agent")
	goBuild(t, ctx, lib, "-buildmode=c-shared", "./cmd/libkvpool")
	goBuild(t, ctx, agent, "./cmd/agent")
	cmd := exec.CommandContext(ctx, py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests")
	cmd.Env = append(os.Environ(), "KVPOOL_LIBRARY="+lib, "KVPOOL_AGENT_BIN="+agent, "PYTHONDONTWRITEBYTECODE=1")
	out, err := cmd.CombinedOutput()
	t.Logf("%s -m pytest tests:\n%s", py, out)
	if err != nil {
		t.Fatalf("pytest: %v", err)
	}
	if !strings.Contains(string(out), " passed") {
		t.Fatal("pytest ran no test")
	}
}
