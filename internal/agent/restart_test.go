package agent

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/keeper"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/wire"
)

var quietLog = slog.New(slog.NewTextHandler(io.Discard, nil))

// startKeeper serves an in-process keeper on a socket of its own.
func startKeeper(t *testing.T) (string, *keeper.Keeper) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "keeper", "keeper.sock")
	l, err := keeper.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	k := keeper.New(quietLog)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- k.Serve(ctx, l) }()
	t.Cleanup(func() { cancel(); <-done; k.Close() })
	return path, k
}

// keptAgent boots a standalone agent with the keeper at keeperSock and a
// fixed layout; stop ends it (as a SIGTERM does).
func keptAgent(t *testing.T, dir, keeperSock string, tokens []string) (a *Agent, stop func()) {
	t.Helper()
	cfg := config.Default()
	cfg.SocketDir, cfg.StateDir = filepath.Join(dir, "sock"), filepath.Join(dir, "state")
	cfg.Metrics.Address, cfg.Health.Address = "", ""
	cfg.KeeperSocket = keeperSock
	cfg.Standalone.Tokens = tokens
	ctx, cancel := context.WithCancel(context.Background())
	a, err := Boot(ctx, Options{Config: &cfg, Standalone: true, ChunksPerGPU: 2, ChunkBytes: 2 << 20, Logger: quietLog})
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- a.Wait(ctx) }()
	return a, func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent stop: %v", err)
		}
	}
}

// wireClient is a minimal client speaking the protocol by hand.
type wireClient struct {
	t   *testing.T
	c   *wire.Conn
	seq uint32
	buf []byte
}

func dialAgent(t *testing.T, socket string) *wireClient {
	t.Helper()
	c, err := wire.Dial(socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	w := &wireClient{t: t, c: c, buf: make([]byte, wire.MaxMessage+1)}
	if st, msg := w.do(wire.OpHello, &wire.Hello{Version: wire.Version, Client: "test"}, &wire.HelloReply{}); st != 0 {
		t.Fatalf("hello: %s %s", st, msg)
	}
	return w
}

func (w *wireClient) do(op wire.Op, req, rep proto.Message) (wire.Status, string) {
	w.t.Helper()
	w.seq++
	pkt, err := wire.AppendPacket(nil, wire.Header{Op: op, Seq: w.seq}, req)
	if err != nil {
		w.t.Fatal(err)
	}
	if err := w.c.Send(pkt, nil); err != nil {
		w.t.Fatal(err)
	}
	w.c.UnixConn().SetReadDeadline(time.Now().Add(10 * time.Second))
	got, files, err := w.c.Recv(w.buf)
	for _, f := range files {
		f.Close()
	}
	if err != nil {
		w.t.Fatal(err)
	}
	h, body, err := wire.ParseHeader(got)
	if err != nil {
		w.t.Fatal(err)
	}
	if h.Status != 0 {
		var e wire.Error
		_ = wire.DecodeBody(body, &e)
		return h.Status, e.Message
	}
	if err := wire.DecodeBody(body, rep); err != nil {
		w.t.Fatal(err)
	}
	return 0, ""
}

func (w *wireClient) open(token, inst string) *wire.OpenReply {
	w.t.Helper()
	var rep wire.OpenReply
	if st, msg := w.do(wire.OpOpen, &wire.Open{Token: token, GpuUuid: cudart.SimulatedUUID(0), InstanceId: []byte(inst),
		Regions: []*wire.Region{{BytesPerPage: 4096, PageCount: 64}}}, &rep); st != 0 {
		w.t.Fatalf("open with %s: %s %s", token, st, msg)
	}
	return &rep
}

func chunkIDs(r *wire.OpenReply) []string {
	var ids []string
	for _, c := range r.Chunks {
		ids = append(ids, c.Id)
	}
	return ids
}

// A standalone allocation follows its token: an agent restarted with the
// tokens in another order gives each tenant its own chunks, session and
// streams back (issue 23: allocations named by position handed tenant A's
// chunks and streams to tenant B).
func TestReorderedTokensKeepTheirAllocations(t *testing.T) {
	dir := t.TempDir()
	ksock, _ := startKeeper(t)
	a, stop := keptAgent(t, dir, ksock, []string{"tenant-a", "tenant-b"})
	first := map[string]*wire.OpenReply{}
	for _, tok := range []string{"tenant-a", "tenant-b"} {
		w := dialAgent(t, a.Socket())
		first[tok] = w.open(tok, "instance-"+tok)
		if st, msg := w.do(wire.OpOffload, &wire.Offload{Rid: "req-of-" + tok, Label: "kv", GpuPages: []int32{1, 2, 3}}, &wire.OffloadReply{}); st != 0 {
			t.Fatalf("offload: %s %s", st, msg)
		}
		w.c.Close()
	}
	stop()

	a2, stop2 := keptAgent(t, dir, ksock, []string{"tenant-b", "tenant-a"})
	defer stop2()
	for _, tok := range []string{"tenant-a", "tenant-b"} {
		w := dialAgent(t, a2.Socket())
		got := w.open(tok, "instance-"+tok)
		if !got.Resumed || got.Session != first[tok].Session || !slices.Equal(chunkIDs(got), chunkIDs(first[tok])) {
			t.Fatalf("%s after the restart with reordered tokens: resumed %v, session %d chunks %v; before: session %d chunks %v",
				tok, got.Resumed, got.Session, chunkIDs(got), first[tok].Session, chunkIDs(first[tok]))
		}
		var n wire.NumPagesReply
		if st, msg := w.do(wire.OpNumPages, &wire.Stream{Rid: "req-of-" + tok, Label: "kv"}, &n); st != 0 || n.Pages != 3 {
			t.Fatalf("%s's stream after the restart: %s %s, %d pages", tok, st, msg, n.Pages)
		}
	}
}
