// Package standalone embeds a kvpool agent in a process: the same assembly
// as `agent --standalone` (internal/agent), configured with a fixed layout
// of simulated GPUs and memfd chunks, fixed tokens, and no metrics or health
// endpoints. The client tests, latbench, kvbench and the Python tests use
// it.
package standalone

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"

	"github.com/kvpool/kvpool/internal/agent"
	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/pool"
)

// Config of a standalone agent. Zero fields take the defaults.
type Config struct {
	GPUs int // simulated GPUs (default standalone.gpus's, 2), named cudart.SimulatedUUID(i) as the simulator names its devices
	// GPUUUIDs, when set, names the GPUs instead (one each, in order):
	// for clients that open their sessions on real devices, whose UUIDs
	// the agent's plan must hold.
	GPUUUIDs     []string
	ChunksPerGPU int      // default 4
	ChunkBytes   int64    // default 64 MiB
	Tokens       []string // allocation tokens (default one random token, contract.NewToken)
	Socket       string   // default DefaultSocket()
	Logger       *slog.Logger
	Hooks        server.Hooks
	// Limits bound what tenants may hold; zero fields take
	// server.DefaultLimits.
	Limits server.Limits
}

// DefaultSocket is $XDG_RUNTIME_DIR/kvpool/kvpool.sock, or
// /tmp/kvpool-<uid>/kvpool.sock when XDG_RUNTIME_DIR is unset.
func DefaultSocket() string { return agent.DefaultSocket() }

// AllocationName is the pool allocation of a standalone token (a digest
// of the token, so that the allocation follows the token whatever the
// order of Config.Tokens).
func AllocationName(token string) string { return agent.AllocationName(token) }

// Agent is a running standalone agent.
type Agent struct {
	Pool   *pool.Pool
	Server *server.Server
	Socket string
	// Tokens maps each token to its allocation's chunk IDs.
	Tokens map[string][]string

	a      *agent.Agent
	ctx    context.Context // the agent's: cancel ends it
	cancel context.CancelFunc
	once   sync.Once
	err    error
}

// Start allocates the chunks, grants them and listens on the socket: the
// agent serves from then on. Serve waits until a context ends; Close stops
// it and frees everything.
func Start(c Config) (*Agent, error) {
	cfg := config.Default()
	if c.GPUs == 0 {
		c.GPUs = cfg.Standalone.GPUs
	}
	if c.ChunksPerGPU == 0 {
		c.ChunksPerGPU = 4
	}
	if c.ChunkBytes == 0 {
		c.ChunkBytes = 64 << 20
	}
	random := len(c.Tokens) == 0
	if random {
		c.Tokens = []string{contract.NewToken()}
	}
	if c.Socket == "" {
		c.Socket = DefaultSocket()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	switch {
	case c.GPUs < 0 || c.GPUs > 64:
		return nil, fmt.Errorf("standalone: %d GPUs, want 1 to 64", c.GPUs)
	case c.ChunksPerGPU < 0 || c.ChunksPerGPU > 4096:
		return nil, fmt.Errorf("standalone: %d chunks per GPU, want 1 to 4096", c.ChunksPerGPU)
	case c.ChunkBytes < 0:
		return nil, fmt.Errorf("standalone: chunk size %d, want > 0", c.ChunkBytes)
	}
	cfg.SocketDir = filepath.Dir(c.Socket)
	cfg.StateDir = cfg.SocketDir + "-state" // unused: no device plugin
	cfg.TokenBinding = config.TokenBindingNone
	cfg.Metrics.Address, cfg.Health.Address = "", ""
	cfg.Standalone.GPUs = c.GPUs
	cfg.Standalone.Tokens = c.Tokens
	cfg.Limits = config.LimitsFrom(c.Limits)
	ctx, cancel := context.WithCancel(context.Background())
	a, err := agent.Boot(ctx, agent.Options{
		Config: &cfg, Standalone: true, Socket: c.Socket,
		ChunksPerGPU: c.ChunksPerGPU, ChunkBytes: c.ChunkBytes, GPUUUIDs: c.GPUUUIDs,
		Logger: c.Logger, Hooks: c.Hooks,
	})
	if err != nil {
		cancel()
		return nil, fmt.Errorf("standalone: %w", err)
	}
	return &Agent{Pool: a.Pool(), Server: a.Server(), Socket: a.Socket(), Tokens: a.Tokens(), a: a, ctx: ctx, cancel: cancel}, nil
}

// Serve serves until ctx ends (or Close is called), then stops the agent.
func (a *Agent) Serve(ctx context.Context) error {
	if a.a == nil {
		return errors.New("standalone: agent is closed")
	}
	stop := context.AfterFunc(ctx, a.cancel)
	defer stop()
	return a.stop()
}

// Close stops the agent, if still serving, and frees the chunks.
func (a *Agent) Close() error {
	a.cancel()
	return a.stop()
}

// stop waits for the agent to end (its context cancelled) once.
func (a *Agent) stop() error {
	a.once.Do(func() {
		a.err = a.a.Wait(a.ctx)
	})
	return a.err
}
