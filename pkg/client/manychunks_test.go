package client_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/standalone"
	"github.com/kvpool/kvpool/pkg/wire"
)

// TestOpenManyChunks: a session of more chunks than one packet passes
// descriptors for (wire.MaxFDs) opens, its client fetching the rest, and a
// stream whose host pages lie in the last chunks makes the round trip
// byte for byte; a reconnect that resumes the session does the same. So
// does a session of more chunks than one packet can name (5,402, one
// rank binding two GPUs' chunks), whose reply names the first and each
// more the next.
func TestOpenManyChunks(t *testing.T) {
	for _, c := range []struct {
		name          string
		gpus, perGPU  int
		ranks, chunks int
	}{
		{"past a packet's fds", 1, 2*wire.MaxFDs + 4, 0, 2*wire.MaxFDs + 4},
		{"past a packet's names", 2, 2701, 1, 5402},
	} {
		t.Run(c.name, func(t *testing.T) {
			a := serveAgent(t, standalone.Config{GPUs: c.gpus, ChunksPerGPU: c.perGPU, ChunkBytes: 64 << 10, Tokens: []string{"tok"}})
			openManyChunks(t, a, c.ranks, c.chunks)
		})
	}
}

func openManyChunks(t *testing.T, a *standalone.Agent, ranks, chunks int) {
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1, CopyDelay: time.Millisecond})
	dev, _ := sim.Open(0)
	c := newKV(t, dev, 64, 4096) // host pages of 8 KiB, 8 a chunk
	p, err := client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev,
		Regions: c.regions, InstanceID: []byte("instance-many-chunks"), Ranks: ranks, Logger: quiet, RetryFor: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	_, capacity, pageSize := p.Session()
	if pageSize != 8192 || capacity != chunks*8 {
		t.Fatalf("page size %d, capacity %d; want 8192, %d", pageSize, capacity, chunks*8)
	}
	all := make([]int32, 64)
	for i := range all {
		all[i] = int32(i)
	}
	// Fill the session but for its last 48 pages, in streams of 64.
	for i := range capacity / 64 {
		if ok, err := p.OffloadStream(fmt.Sprintf("fill-%d", i), "kv", all, 1, 1, 0); err != nil || !ok {
			t.Fatalf("offload %d: %v %v", i, ok, err)
		}
	}
	rng := rand.New(rand.NewPCG(5, 6))
	src := all[:capacity%64]
	roundTrip := func(rid string) {
		t.Helper()
		want := map[int32][]byte{}
		for _, pg := range src {
			want[pg] = c.fill(t, rng, pg)
		}
		if ok, err := p.OffloadStream(rid, "kv", src, 9, 9, 0); err != nil || !ok {
			t.Fatalf("offload %s: %v %v", rid, ok, err)
		}
		sync(t, p, dev)
		for _, pg := range src {
			c.poison(t, pg)
		}
		dst := all[64-len(src):]
		st, err := p.ReloadStream(rid, "kv", dst)
		if err != nil {
			t.Fatal(err)
		}
		if last := st.CPUPageIndices[len(st.CPUPageIndices)-1]; int(last) < (chunks-2)*8 {
			t.Fatalf("%s: host pages up to %d, none in the last two chunks", rid, last)
		}
		sync(t, p, dev)
		for i, pg := range dst {
			if got := c.read(t, pg); !bytes.Equal(got, want[src[i]]) {
				t.Fatalf("%s: device page %d (from %d) differs after the round trip", rid, pg, src[i])
			}
		}
		if err := p.Synchronize(); err != nil {
			t.Fatal(err)
		}
	}
	roundTrip("far")
	// The connection drops; the next call reconnects and resumes the
	// session, its chunks passed again.
	p.Disconnect()
	roundTrip("far-again")
}
