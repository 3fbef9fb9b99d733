// Package standalone assembles an agent without Kubernetes: memfd chunks for
// a number of simulated GPUs, a pool granting them to fixed allocation
// tokens, and the copy API server on a local socket. cmd/agent --standalone,
// agent bench and the tests run it.
package standalone

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"

	"github.com/kvpool/kvpool/pkg/hostmem"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/server"
)

// Config of a standalone agent. Zero fields take the defaults.
type Config struct {
	GPUs         int      // simulated GPUs (default 2)
	ChunksPerGPU int      // default 4
	ChunkBytes   int64    // default 64 MiB
	Tokens       []string // allocation tokens (default one random token)
	Socket       string   // default DefaultSocket()
	Logger       *slog.Logger
	Hooks        server.Hooks
}

// DefaultSocket is $XDG_RUNTIME_DIR/kvpool/kvpool.sock, or
// /tmp/kvpool-<uid>/kvpool.sock when XDG_RUNTIME_DIR is unset.
func DefaultSocket() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "kvpool", "kvpool.sock")
	}
	return filepath.Join(os.TempDir(), fmt.Sprintf("kvpool-%d", os.Getuid()), "kvpool.sock")
}

// Agent is a running standalone agent.
type Agent struct {
	Pool   *pool.Pool
	Server *server.Server
	Socket string
	// Tokens maps each token to its allocation's chunk IDs.
	Tokens map[string][]string

	chunks   map[string]*hostmem.Chunk
	listener *net.UnixListener
}

// NewToken returns a random allocation token.
func NewToken() string {
	b := make([]byte, 12)
	rand.Read(b)
	return "kvp-" + hex.EncodeToString(b)
}

// Start allocates the chunks, grants them and listens on the socket. Serve
// runs the server; Close frees everything.
func Start(c Config) (*Agent, error) {
	if c.GPUs == 0 {
		c.GPUs = 2
	}
	if c.ChunksPerGPU == 0 {
		c.ChunksPerGPU = 4
	}
	if c.ChunkBytes == 0 {
		c.ChunkBytes = 64 << 20
	}
	if len(c.Tokens) == 0 {
		c.Tokens = []string{NewToken()}
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
	case c.ChunksPerGPU < len(c.Tokens):
		return nil, fmt.Errorf("standalone: %d tokens need at least as many chunks per GPU, have %d", len(c.Tokens), c.ChunksPerGPU)
	}
	seen := map[string]bool{}
	for _, t := range c.Tokens {
		if t == "" || seen[t] {
			return nil, fmt.Errorf("standalone: tokens must be non-empty and distinct, got %q", c.Tokens)
		}
		seen[t] = true
	}
	a := &Agent{Pool: pool.New(), Socket: c.Socket, Tokens: map[string][]string{}, chunks: map[string]*hostmem.Chunk{}}
	allocOf := map[string]string{}
	for g := 0; g < c.GPUs; g++ {
		for i := 0; i < c.ChunksPerGPU; i++ {
			id := fmt.Sprintf("gpu%d-numaX-%d", g, i)
			hc, err := hostmem.Alloc(hostmem.Options{Size: c.ChunkBytes, Name: "kvpool-" + id})
			if err != nil {
				a.Close()
				return nil, fmt.Errorf("standalone: %w", err)
			}
			a.chunks[id] = hc
			if err := a.Pool.AddChunk(pool.Chunk{ID: id, GPU: g, NUMA: -1, Size: c.ChunkBytes}); err != nil {
				a.Close()
				return nil, err
			}
			tok := c.Tokens[i%len(c.Tokens)]
			a.Tokens[tok] = append(a.Tokens[tok], id)
		}
	}
	for i, tok := range c.Tokens {
		alloc := fmt.Sprintf("standalone-%d", i)
		if err := a.Pool.Grant(alloc, a.Tokens[tok]); err != nil {
			a.Close()
			return nil, err
		}
		allocOf[tok] = alloc
	}
	srv, err := server.New(server.Options{
		Pool:      a.Pool,
		Chunks:    func(id string) (*hostmem.Chunk, bool) { hc, ok := a.chunks[id]; return hc, ok },
		Authorize: server.StaticTokens(allocOf),
		Logger:    c.Logger,
		Hooks:     c.Hooks,
		Name:      "kvpool-agent (standalone)",
	})
	if err != nil {
		a.Close()
		return nil, err
	}
	a.Server = srv
	l, err := server.Listen(c.Socket)
	if err != nil {
		a.Close()
		return nil, err
	}
	a.listener = l
	return a, nil
}

// Serve serves until ctx ends.
func (a *Agent) Serve(ctx context.Context) error {
	if a.listener == nil {
		return errors.New("standalone: agent is closed")
	}
	err := a.Server.Serve(ctx, a.listener)
	os.Remove(a.Socket)
	return err
}

// Close stops listening and frees the chunks. Call it after Serve returned.
func (a *Agent) Close() error {
	if a.listener != nil {
		a.listener.Close()
		a.listener = nil
		os.Remove(a.Socket)
	}
	var err error
	for id, hc := range a.chunks {
		err = errors.Join(err, hc.Close())
		delete(a.chunks, id)
	}
	return err
}
