package python

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/kvpool/kvpool/pkg/standalone"
)

// TestStandaloneAgentHelper serves a standalone agent (pkg/standalone: the
// real server over memfd chunks) from this test binary until SIGTERM, for
// hack/gpu/check.sh's Python part on a machine without Go, where carrying
// the full agent binary is too heavy. It runs only when
// KVPOOL_STANDALONE_AGENT names a directory; KVPOOL_STANDALONE_MIB sets the
// pool per GPU (default 512), KVPOOL_STANDALONE_GPU_UUIDS (comma-separated)
// the GPUs' UUIDs, so that clients on real devices find theirs in the plan.
// It prints "AGENT-READY <socket> <token>".
func TestStandaloneAgentHelper(t *testing.T) {
	dir := os.Getenv("KVPOOL_STANDALONE_AGENT")
	if dir == "" {
		t.Skip("run by hack/gpu/check.sh")
	}
	mib, _ := strconv.Atoi(os.Getenv("KVPOOL_STANDALONE_MIB"))
	if mib <= 0 {
		mib = 512
	}
	const token = "gpu-check"
	gpus, uuids := 1, []string(nil)
	if u := os.Getenv("KVPOOL_STANDALONE_GPU_UUIDS"); u != "" {
		uuids = strings.Split(u, ",")
		gpus = len(uuids)
	}
	a, err := standalone.Start(standalone.Config{GPUs: gpus, GPUUUIDs: uuids, ChunksPerGPU: 2, ChunkBytes: int64(mib) << 19, Tokens: []string{token},
		Socket: filepath.Join(dir, "kvpool.sock"), Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	fmt.Printf("AGENT-READY %s %s\n", a.Socket, token)
	os.Stdout.Sync()
	if err := a.Serve(ctx); err != nil && ctx.Err() == nil {
		t.Fatal(err)
	}
}
