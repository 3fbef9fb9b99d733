package standalone

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvpool/kvpool/pkg/contract"
)

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// Start is the standalone agent of internal/agent: its chunks are in the
// pool, named as the contract names them, granted to the tokens, and the
// socket is there until Close.
func TestStartServeClose(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "sock", "kvpool.sock")
	a, err := Start(Config{GPUs: 2, ChunksPerGPU: 2, ChunkBytes: 2 << 20, Tokens: []string{"a", "b"}, Socket: sock, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	if a.Socket != sock {
		t.Errorf("socket %s, want %s", a.Socket, sock)
	}
	if _, err := os.Stat(sock); err != nil {
		t.Errorf("no socket after Start: %v", err)
	}
	if n := len(a.Pool.Chunks()); n != 4 {
		t.Errorf("%d chunks in the pool, want 4", n)
	}
	for _, c := range a.Pool.Chunks() {
		if g, _, _, err := contract.ParseChunkID(c.ID); err != nil || g != c.GPU {
			t.Errorf("chunk %s of GPU %d: %v", c.ID, c.GPU, err)
		}
	}
	if len(a.Tokens["a"]) != 2 || len(a.Tokens["b"]) != 2 || slices.ContainsFunc(a.Tokens["a"], func(id string) bool { return slices.Contains(a.Tokens["b"], id) }) {
		t.Errorf("tokens %v: want two disjoint pairs", a.Tokens)
	}
	for tok, ids := range a.Tokens {
		alloc := AllocationName(tok)
		got, err := a.Pool.Allocation(alloc)
		if err != nil || !slices.Equal(slices.Sorted(slices.Values(got)), slices.Sorted(slices.Values(ids))) {
			t.Errorf("allocation %s: %v, %v; want %v", alloc, got, err, ids)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Serve after its context ended: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Serve did not return after its context ended")
	}
	if err := a.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("socket left behind: %v", err)
	}
}

// Bad configurations fail before anything is made.
func TestStartRefuses(t *testing.T) {
	dir := t.TempDir()
	world := filepath.Join(dir, "world")
	os.Mkdir(world, 0o777)
	os.Chmod(world, 0o777)
	for _, c := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"world-writable directory", Config{GPUs: 1, ChunksPerGPU: 1, ChunkBytes: 2 << 20, Socket: filepath.Join(world, "kvpool.sock")}, "group or others may write it"},
		{"too many GPUs", Config{GPUs: 65, Socket: filepath.Join(dir, "a", "kvpool.sock")}, "want 1 to 64"},
		{"too many tokens", Config{GPUs: 1, ChunksPerGPU: 1, ChunkBytes: 2 << 20, Tokens: []string{"a", "b"}, Socket: filepath.Join(dir, "b", "kvpool.sock")}, "2 standalone tokens need at least as many chunks per GPU"},
		{"GPU UUIDs not one a GPU", Config{GPUs: 2, GPUUUIDs: []string{"GPU-a"}, ChunksPerGPU: 1, ChunkBytes: 2 << 20, Socket: filepath.Join(dir, "d", "kvpool.sock")}, "1 GPU UUIDs for 2 standalone GPUs"},
		{"token with a comma", Config{GPUs: 1, ChunksPerGPU: 1, ChunkBytes: 2 << 20, Tokens: []string{"a,b"}, Socket: filepath.Join(dir, "c", "kvpool.sock")}, "without spaces or commas"},
		// Refused by the plan, before any chunk is allocated.
		{"too many chunks in all", Config{GPUs: 5, ChunksPerGPU: 4096, ChunkBytes: 64 << 10, Socket: filepath.Join(dir, "e", "kvpool.sock")}, "1.2Gi in 20480 chunks of 64Ki, more than the 16384 an agent serves (kubelet's device list, the chunks' memfds and their mappings grow with them): set the fixed layout's chunk size to 2Mi or more"},
	} {
		t.Run(c.name, func(t *testing.T) {
			c.cfg.Logger = quiet()
			a, err := Start(c.cfg)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				if a != nil {
					a.Close()
				}
				t.Fatalf("Start: %v, want an error containing %q", err, c.want)
			}
			if _, err := os.Stat(c.cfg.Socket); !os.IsNotExist(err) {
				t.Errorf("socket created by a refused Start: %v", err)
			}
		})
	}
}
