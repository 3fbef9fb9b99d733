package agent

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	nvmlmock "github.com/NVIDIA/go-nvml/pkg/nvml/mock"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/gpu"
	"github.com/kvpool/kvpool/internal/node"
	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/internal/sizing"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/wire"
)

// A fatal error of the socket server (here: its listener closed under it)
// ends the agent with that error instead of leaving a process that serves
// nothing: wait returns it, everything stopped.
func TestFatalServerErrorEndsAgent(t *testing.T) {
	dir := t.TempDir()
	cfg := config.Default()
	cfg.SocketDir, cfg.StateDir = filepath.Join(dir, "sock"), filepath.Join(dir, "state")
	cfg.Metrics.Address, cfg.Health.Address = "", ""
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	a, err := Boot(ctx, Options{Config: &cfg, Standalone: true, RandomToken: true, ChunksPerGPU: 1, ChunkBytes: 2 << 20,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	a.a.ln.Close()
	done := make(chan error, 1)
	go func() { done <- a.Wait(ctx) }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "socket server stopped") {
			t.Fatalf("wait after a fatal server error: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the agent hung after its socket server stopped")
	}
}

// Cluster mode on a node without the NVIDIA library fails saying what to
// do; a driver error is passed on.
func TestClusterGPUDiscovery(t *testing.T) {
	info := &node.Info{NUMANodes: []node.NUMANode{{ID: 0}}}
	for _, c := range []struct {
		name string
		ret  nvml.Return
		sim  int
		want string
		n    int
	}{
		{"no library", nvml.ERROR_LIBRARY_NOT_FOUND, 0, "--simulate-gpus N", 0},
		{"simulated", nvml.ERROR_LIBRARY_NOT_FOUND, 3, "", 3},
		{"driver failure", nvml.ERROR_DRIVER_NOT_LOADED, 0, "", 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			lib := func() nvml.Interface {
				return &nvmlmock.Interface{InitFunc: func() nvml.Return { return c.ret }}
			}
			a := &agent{opts: Options{SimulateGPUs: c.sim, Root: "/", NVML: lib}, cfg: &config.Config{}}
			devs, _, err := a.gpus(info)
			switch {
			case c.n > 0:
				if err != nil || len(devs) != c.n || !devs[0].Simulated {
					t.Errorf("got %d devices, %v", len(devs), err)
				}
			case err == nil:
				t.Errorf("no error")
			case c.want != "" && !strings.Contains(err.Error(), c.want):
				t.Errorf("err %v, want it to mention %q", err, c.want)
			case c.want == "" && errors.Is(err, gpu.ErrNoNVML):
				t.Errorf("a driver failure reported as a missing library: %v", err)
			}
		})
	}
}

// More standalone tokens than chunks per GPU is refused before anything is
// allocated.
func TestStandaloneTokensNeedChunks(t *testing.T) {
	plan := &sizing.Plan{GPUs: []sizing.GPUPlan{{GPU: 0, NUMA: -1, Chunks: 2}}}
	for _, c := range []struct {
		tokens []string
		want   string
	}{
		{[]string{"a", "b", "c"}, "3 standalone tokens need at least as many chunks per GPU"},
		{[]string{"a", "a"}, "distinct"},
		{[]string{"a b"}, "without spaces"},
	} {
		cfg := config.Default()
		cfg.Standalone.Tokens = c.tokens
		a := &agent{cfg: &cfg, plan: plan, opts: Options{Standalone: true}, pool: pool.New()}
		if err := a.prepareTokens(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v, want %q", c.tokens, err, c.want)
		}
		if a.static != nil {
			t.Errorf("%q: tokens kept after an error", c.tokens)
		}
	}
}

func TestBootNeedsConfig(t *testing.T) {
	if a, err := Boot(context.Background(), Options{}); err == nil || a != nil || !strings.Contains(err.Error(), "no configuration") {
		t.Fatalf("Boot without a configuration: %v, %v", a, err)
	}
}

// Mode dra is cluster mode only: a standalone agent refuses it before it
// starts anything.
func TestBootRefusesStandaloneDRA(t *testing.T) {
	cfg := config.Default()
	cfg.Mode = config.ModeDRA
	a, err := Boot(context.Background(), Options{Config: &cfg, Standalone: true, DevicePlugin: true})
	if err == nil || a != nil || !strings.Contains(err.Error(), "mode dra is for cluster mode") {
		t.Fatalf("Boot standalone in mode dra: %v, %v", a, err)
	}
}

// The hooks an embedder passes are called after the agent's own, and a
// missing hook on either side is no call.
func TestChainHooks(t *testing.T) {
	var calls []string
	own := server.Hooks{Request: func(server.Request) { calls = append(calls, "own request") },
		Refused: func(r string) { calls = append(calls, "own refused "+r) }}
	extra := server.Hooks{Request: func(server.Request) { calls = append(calls, "extra request") }}
	h := chainHooks(own, extra)
	h.Request(server.Request{})
	h.Refused("limit")
	if got := strings.Join(calls, "; "); got != "own request; extra request; own refused limit" {
		t.Errorf("calls: %s", got)
	}
	calls = nil
	own.Session = func(ev server.SessionEvent, _ server.SessionInfo) { calls = append(calls, "own "+string(ev)) }
	extra.Session = func(ev server.SessionEvent, _ server.SessionInfo) { calls = append(calls, "extra "+string(ev)) }
	chainHooks(own, extra).Session(server.SessionOpened, server.SessionInfo{})
	if got := strings.Join(calls, "; "); got != "own opened; extra opened" {
		t.Errorf("session calls: %s", got)
	}
	extra.Session = nil
	calls = nil
	h = chainHooks(server.Hooks{}, extra)
	h.Request(server.Request{})
	if h.Refused != nil || strings.Join(calls, "; ") != "extra request" {
		t.Errorf("chain onto empty hooks: refused %v, calls %v", h.Refused != nil, calls)
	}
}

// The config's bound on pollAfterReply is the wire's, which the server
// enforces.
func TestPollAfterReplyBound(t *testing.T) {
	if config.MaxPollAfterReply != wire.SpinLimit {
		t.Fatalf("config.MaxPollAfterReply %v, wire.SpinLimit %v", config.MaxPollAfterReply, wire.SpinLimit)
	}
}
