package agent

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"strings"
	"testing"

	"github.com/kvpool/kvpool/internal/config"
)

// stepsDoc reads the per-mode step lists of docs/architecture.md: the
// lines "<mode>: <step> <step> ..." of the text block under the marker
// line.
func stepsDoc(t *testing.T) map[string]string {
	t.Helper()
	f, err := os.Open("../../docs/architecture.md")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const marker = "<!-- start-up steps per mode: internal/agent TestStepsPerMode -->"
	out := map[string]string{}
	sc := bufio.NewScanner(f)
	found, in := false, false
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == marker:
			found = true
		case found && !in && line == "```text":
			in = true
		case in && line == "```":
			return out
		case in:
			m, steps, ok := strings.Cut(line, ":")
			if !ok {
				t.Fatalf("architecture.md: step list line %q has no \"mode:\"", line)
			}
			out[strings.TrimSpace(m)] = strings.Join(strings.Fields(steps), " ")
		}
	}
	t.Fatalf("architecture.md: no step list block under %q", marker)
	return nil
}

// The start-up steps of every mode, in order, are the ones
// docs/architecture.md lists; the doc lists every mode the brief of the
// start-up names (cluster; standalone, with and without the device plugin;
// the fixed layout; each with or without a keeper).
func TestStepsPerMode(t *testing.T) {
	doc := stepsDoc(t)
	cfg := config.Default()
	a := &agent{cfg: &cfg}
	var modes []mode
	for _, keeper := range []bool{false, true} {
		modes = append(modes, mode{plugin: true, keeper: keeper}, mode{plugin: true, dra: true, keeper: keeper})
		for _, plugin := range []bool{false, true} {
			for _, fixed := range []bool{false, true} {
				modes = append(modes, mode{standalone: true, plugin: plugin, fixed: fixed, keeper: keeper})
			}
		}
	}
	seen := map[string]bool{}
	for _, m := range modes {
		got := stepNames(a.steps(m))
		t.Logf("%s: %s", m, got)
		want, ok := doc[m.String()]
		if !ok {
			t.Errorf("architecture.md lists no steps for mode %s (they are: %s)", m, got)
			continue
		}
		seen[m.String()] = true
		if got != want {
			t.Errorf("mode %s:\n steps %s\n   doc %s", m, got, want)
		}
	}
	for m := range doc {
		if !seen[m] {
			t.Errorf("architecture.md lists steps for %q, which is no mode", m)
		}
	}
}

// Options decide the mode once: the device plugin always runs in a
// cluster, standalone only with --device-plugin; a fixed layout needs both
// of its sizes.
func TestModeOf(t *testing.T) {
	cfg := config.Default()
	kept := config.Default()
	kept.KeeperSocket = "/run/keeper.sock"
	draCfg := config.Default()
	draCfg.Mode = config.ModeDRA
	draKept := kept
	draKept.Mode = config.ModeDRA
	for _, c := range []struct {
		o    Options
		want string
	}{
		{Options{Config: &cfg}, "cluster"},
		{Options{Config: &cfg, DevicePlugin: true, ChunksPerGPU: 2, ChunkBytes: 1 << 20}, "cluster"},
		{Options{Config: &kept}, "cluster+keeper"},
		{Options{Config: &cfg, Standalone: true}, "standalone"},
		{Options{Config: &cfg, Standalone: true, ChunksPerGPU: 2}, "standalone"},
		{Options{Config: &cfg, Standalone: true, ChunksPerGPU: 2, ChunkBytes: 1 << 20}, "standalone+fixed"},
		{Options{Config: &kept, Standalone: true, DevicePlugin: true}, "standalone+device-plugin+keeper"},
		{Options{Config: &draCfg}, "cluster+dra"},
		{Options{Config: &draKept}, "cluster+dra+keeper"},
		// Standalone has no DRA driver; Boot refuses mode dra there.
		{Options{Config: &draCfg, Standalone: true, DevicePlugin: true}, "standalone+device-plugin"},
	} {
		if got := modeOf(c.o).String(); got != c.want {
			t.Errorf("%+v: mode %s, want %s", c.o, got, c.want)
		}
	}
}

// A failed start stops what started, the failed step included, in
// reverse, and a later stop has nothing left to undo; a stop's error is
// joined, naming the step, and does not keep the other stops from running.
func TestLifecycle(t *testing.T) {
	var calls []string
	mk := func(name string, startErr, stopErr error) step {
		return step{name: name,
			start: func(context.Context) error { calls = append(calls, "start "+name); return startErr },
			stop:  func() error { calls = append(calls, "stop "+name); return stopErr }}
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	boom, stuck := errors.New("boom"), errors.New("stuck")

	l := lifecycle{log: quiet}
	err := l.start(context.Background(), []step{mk("a", nil, nil), {name: "b", start: func(context.Context) error {
		calls = append(calls, "start b")
		return nil
	}}, mk("c", nil, stuck), mk("d", boom, nil), mk("e", nil, nil)})
	if !errors.Is(err, boom) {
		t.Fatalf("start: %v, want boom", err)
	}
	err = l.stop()
	if !errors.Is(err, stuck) || !strings.Contains(err.Error(), "stop c: stuck") {
		t.Errorf("stop: %v, want stop c: stuck", err)
	}
	want := "start a, start b, start c, start d, stop d, stop c, stop a"
	if got := strings.Join(calls, ", "); got != want {
		t.Errorf("calls:\n %s\nwant\n %s", got, want)
	}
	calls = nil
	if err := l.stop(); err != nil || len(calls) != 0 {
		t.Errorf("second stop: %v, calls %v", err, calls)
	}

	l = lifecycle{log: quiet}
	if err := l.start(context.Background(), []step{mk("a", nil, nil), mk("b", nil, nil)}); err != nil {
		t.Fatal(err)
	}
	calls = nil
	if err := l.stop(); err != nil || strings.Join(calls, ", ") != "stop b, stop a" {
		t.Errorf("shutdown: %v, calls %v", err, calls)
	}
}

// A step that fails at start undoes the steps before it: a standalone
// agent whose socket directory is not the agent user's fails, its chunks
// freed and no socket left.
func TestBootFailureStopsStartedSteps(t *testing.T) {
	dir := t.TempDir()
	sockDir := dir + "/sock"
	if err := os.Mkdir(sockDir, 0o777); err != nil {
		t.Fatal(err)
	}
	os.Chmod(sockDir, 0o777) // past the umask
	cfg := config.Default()
	cfg.SocketDir, cfg.StateDir = sockDir, dir+"/state"
	cfg.Metrics.Address, cfg.Health.Address = "", ""
	var logs strings.Builder
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	x, err := Boot(context.Background(), Options{Config: &cfg, Standalone: true, RandomToken: true,
		ChunksPerGPU: 1, ChunkBytes: 2 << 20, Logger: log})
	if err == nil || x != nil || !strings.Contains(err.Error(), "group or others may write it") {
		t.Fatalf("Boot: %v, %v; want the socket directory refused", x, err)
	}
	for _, want := range []string{"step=allocate", "step=server", `msg="start-up step failed; undoing the steps started" step=socket-dir`,
		`msg="shutdown step" step=fixed-plan`} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("log lacks %q:\n%s", want, logs.String())
		}
	}
	if left, _ := os.ReadDir(sockDir); len(left) != 0 {
		t.Errorf("socket directory holds %v", left)
	}
}
