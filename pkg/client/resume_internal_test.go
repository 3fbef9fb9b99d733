package client

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/logging"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/standalone"
	"github.com/kvpool/kvpool/pkg/wire"
)

// TestResumeKeepsTheMappings: a client that reconnects to the session whose
// chunks it maps names it, and the agent passes no fds: the client keeps
// its mappings (the very addresses) and its streams. A reply that says
// the chunks are mapped where they are not the client's is refused, and
// the client lets its mappings go, so that its next open asks for all.
func TestResumeKeepsTheMappings(t *testing.T) {
	a := serveStandalone(t, 300)
	dev, k := simDevice(t, 64*4096)
	var logs logging.SyncBuffer
	p, err := Open(context.Background(), Options{Socket: a.Socket, Token: "tok", Device: dev,
		Regions:    []cudart.Region{{Base: k, Stride: 4096, PageBytes: 4096, Pages: 64}},
		InstanceID: []byte("resume-test-1"), RetryFor: time.Second,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if ok, err := p.OffloadStream("r", "l", []int32{1, 2, 3}, 5, 6, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	bases := func() []uintptr {
		p.mu.Lock()
		defer p.mu.Unlock()
		var out []uintptr
		for _, c := range p.chunks {
			out = append(out, c.base)
		}
		return out
	}
	first := bases()
	if len(first) <= wire.MaxFDs {
		t.Fatalf("the session maps %d chunks, want more than a packet's %d", len(first), wire.MaxFDs)
	}
	p.Disconnect()
	if n, err := p.NumPages("r", "l"); err != nil || n != 3 {
		t.Fatalf("after a reconnect: %d pages, %v", n, err)
	}
	if got := bases(); fmt.Sprint(got) != fmt.Sprint(first) {
		t.Fatal("the resume mapped the chunks anew")
	}
	if !strings.Contains(string(logs.Bytes()), "chunksMapped=true") {
		t.Fatalf("the resume passed the chunks' fds again:\n%s", logs.Bytes())
	}

	// Replies no agent of this protocol sends: refused, the mappings let
	// go, and the next open gets every chunk again.
	fake, _ := os.Open(os.DevNull)
	defer fake.Close()
	for _, c := range []struct {
		name  string
		spoil func(rep *wireOpen)
	}{
		{"fds with it", func(r *wireOpen) { r.files = []*os.File{fake} }},
		{"another session", func(r *wireOpen) { r.rep.Session++ }},
		{"not resumed", func(r *wireOpen) { r.rep.Resumed = false }},
		{"other chunks", func(r *wireOpen) { r.rep.Chunks[7].Id = "gpu0-numaX-999" }},
		{"fewer chunks", func(r *wireOpen) { r.rep.Chunks, r.rep.Capacity = r.rep.Chunks[1:], r.rep.Capacity-r.rep.PagesPerChunk }},
	} {
		t.Run(c.name, func(t *testing.T) {
			p.mu.Lock()
			r := &wireOpen{rep: &wire.OpenReply{Session: p.session, Resumed: true, ChunksMapped: true,
				PageSize: p.pageSize, PagesPerChunk: uint32(p.ppc), Capacity: uint32(p.capacity)}}
			for _, ch := range p.chunks {
				r.rep.Chunks = append(r.rep.Chunks, &wire.ChunkGrant{Id: ch.id, Size: ch.size})
			}
			c.spoil(r)
			err := p.adopt(r.rep, r.files)
			mapped := len(p.chunks)
			p.mu.Unlock()
			if !errors.Is(err, ErrProtocol) || mapped != 0 {
				t.Fatalf("adopt: %v, %d chunks still mapped; want %v and none", err, mapped, ErrProtocol)
			}
			p.Disconnect()
			if n, err := p.NumPages("r", "l"); err != nil || n != 3 {
				t.Fatalf("the open after: %d pages, %v", n, err)
			}
			if len(bases()) != len(first) {
				t.Fatalf("the open after maps %d chunks, want %d", len(bases()), len(first))
			}
		})
	}
}

type wireOpen struct {
	rep   *wire.OpenReply
	files []*os.File
}

// serveStandalone serves a standalone agent of one simulated GPU with
// chunks of 64 KiB for the rest of the test.
func serveStandalone(t *testing.T, chunks int) *standalone.Agent {
	t.Helper()
	a, err := standalone.Start(standalone.Config{GPUs: 1, ChunksPerGPU: chunks, ChunkBytes: 64 << 10,
		Tokens: []string{"tok"}, Socket: filepath.Join(t.TempDir(), "kv.sock"), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
		a.Close()
	})
	return a
}

// simDevice opens a simulated GPU and allocates bytes of its memory.
func simDevice(t *testing.T, bytes uint64) (cudart.Device, cudart.DevicePtr) {
	t.Helper()
	dev, err := cudart.NewSim(cudart.SimOptions{Devices: 1}).Open(0)
	if err != nil {
		t.Fatal(err)
	}
	k, err := dev.MemAlloc(bytes)
	if err != nil {
		t.Fatal(err)
	}
	return dev, k
}
