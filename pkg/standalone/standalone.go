// Package standalone holds what an agent without Kubernetes needs: the
// default socket path, random tokens, the split of chunks among fixed tokens
// (Allocations, shared with `agent --standalone`), and Start, a minimal
// in-process agent (memfd chunks, fixed tokens, the copy API server) that
// `agent bench` and the client tests embed.
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
	"strings"
	"syscall"

	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/hostmem"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/server"
)

// Config of a standalone agent. Zero fields take the defaults.
type Config struct {
	GPUs         int      // simulated GPUs (default 2), named cudart.SimulatedUUID(i) as the simulator names its devices
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

// DefaultStateDir is the standalone agent's state directory: next to the
// socket's directory, never inside it ($XDG_RUNTIME_DIR/kvpool-state, or
// /tmp/kvpool-<uid>-state), so that a pod mounting the socket directory
// cannot read the tokens.
func DefaultStateDir() string {
	d := filepath.Dir(DefaultSocket())
	return d + "-state"
}

// CheckSocketDir refuses a socket directory that someone else could
// tamper with: one that exists but is not a directory (a symbolic link
// included), is owned by another user than the agent's, or is writable by
// group or others (they could move the socket away and put their own in its
// place). A directory that does not exist yet is fine: Listen creates it.
func CheckSocketDir(dir string) error {
	fi, err := os.Lstat(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("socket directory %s: %w", dir, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("socket directory %s is not a directory (%s); remove it or choose another with --socket", dir, fi.Mode().Type())
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("socket directory %s: no owner information", dir)
	}
	if uid := os.Getuid(); int(st.Uid) != uid {
		return fmt.Errorf("socket directory %s is owned by uid %d, not by the agent's uid %d: another user could replace the socket; remove it or choose another with --socket", dir, st.Uid, uid)
	}
	if perm := fi.Mode().Perm(); perm&0o022 != 0 {
		return fmt.Errorf("socket directory %s has mode %04o: group or others may write it and replace the socket; chmod go-w %s, or choose another with --socket", dir, perm, dir)
	}
	return nil
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

// Allocations splits each GPU's chunk IDs among tokens: token i gets
// chunks i, i+n, i+2n, ... of every GPU (n tokens), as pool allocation
// "standalone-<i>". It returns each token's allocation and chunk IDs.
func Allocations(tokens []string, gpus [][]string) (alloc map[string]string, chunks map[string][]string, err error) {
	if len(tokens) == 0 {
		return nil, nil, errors.New("standalone: no tokens")
	}
	alloc = make(map[string]string, len(tokens))
	for i, t := range tokens {
		if _, dup := alloc[t]; t == "" || dup || strings.ContainsAny(t, " \t\n,") {
			return nil, nil, fmt.Errorf("standalone tokens must be non-empty, distinct and without spaces or commas, got %q", tokens)
		}
		alloc[t] = fmt.Sprintf("standalone-%d", i)
	}
	chunks = make(map[string][]string, len(tokens))
	for g, ids := range gpus {
		if len(ids) < len(tokens) {
			return nil, nil, fmt.Errorf("%d standalone tokens need at least as many chunks per GPU; GPU %d has %d", len(tokens), g, len(ids))
		}
		for i, id := range ids {
			t := tokens[i%len(tokens)]
			chunks[t] = append(chunks[t], id)
		}
	}
	return alloc, chunks, nil
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
	}
	gpus := make([][]string, c.GPUs)
	for g := range gpus {
		for i := range c.ChunksPerGPU {
			gpus[g] = append(gpus[g], fmt.Sprintf("gpu%d-numaX-%d", g, i))
		}
	}
	allocOf, tokenChunks, err := Allocations(c.Tokens, gpus)
	if err != nil {
		return nil, err
	}
	a := &Agent{Pool: pool.New(), Socket: c.Socket, Tokens: tokenChunks, chunks: map[string]*hostmem.Chunk{}}
	for g, ids := range gpus {
		for _, id := range ids {
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
		}
	}
	for tok, alloc := range allocOf {
		if err := a.Pool.Grant(alloc, tokenChunks[tok]); err != nil {
			a.Close()
			return nil, err
		}
	}
	uuids := make(map[string]int, c.GPUs)
	for g := range c.GPUs {
		uuids[cudart.SimulatedUUID(g)] = g
	}
	srv, err := server.New(server.Options{
		GPUs:      uuids,
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
	if err := CheckSocketDir(filepath.Dir(c.Socket)); err != nil {
		a.Close()
		return nil, fmt.Errorf("standalone: %w", err)
	}
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
