package server_test

import (
	"context"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/standalone"
	"github.com/kvpool/kvpool/pkg/wire"
)

// TestLongReplyResumes drives the long-list protocol by hand: an offload of
// 30,000 device pages sent as a pages packet and an offload, a reply of the
// first 24,576 host pages with the total, the connection dropped before the
// rest was fetched, and a reconnect of the same instance that resumes the
// session and fetches the rest with more. Then a reload of the stream gets
// the same pages back across packets, and the next request ends the long
// reply.
func TestLongReplyResumes(t *testing.T) {
	sa, err := standalone.Start(standalone.Config{GPUs: 1, ChunksPerGPU: 1, ChunkBytes: 8 << 20, Tokens: []string{"tok"},
		Socket: filepath.Join(t.TempDir(), "kv.sock"), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sa.Serve(ctx) }()
	defer func() { cancel(); <-done; sa.Close() }()
	a := &agent{socket: sa.Socket}
	const n = 30000
	m := wire.MaxPagesPerPacket
	open := func() *raw {
		r := dial(t, a)
		r.hello()
		var rep wire.OpenReply
		if st, msg := r.do(wire.OpOpen, 0, &wire.Open{Token: "tok", GpuUuid: cudart.SimulatedUUID(0), InstanceId: []byte("instance-long"),
			Regions: []*wire.Region{{BytesPerPage: 256, PageCount: n}}}, &rep); st != 0 {
			t.Fatalf("open: %s %s", st, msg)
		}
		return r
	}
	r := open()
	gpu := make([]int32, n)
	for i := range gpu {
		gpu[i] = int32(n - 1 - i)
	}
	if st, msg := r.do(wire.OpPages, 0, &wire.Pages{GpuPages: gpu[:m]}, nil); st != 0 {
		t.Fatalf("pages: %s %s", st, msg)
	}
	var off wire.OffloadReply
	if st, msg := r.do(wire.OpOffload, 0, &wire.Offload{Rid: "r", Label: "l", GpuPages: gpu[m:], StoredLen: 5}, &off); st != 0 || !off.Ok {
		t.Fatalf("offload: %s %s", st, msg)
	}
	if len(off.HostPages) != m || off.Total != n {
		t.Fatalf("first part: %d pages, total %d", len(off.HostPages), off.Total)
	}
	host := slices.Clone(off.HostPages)
	r.c.Close() // dropped mid-reply

	r = open()
	var more wire.MoreReply
	if st, msg := r.do(wire.OpMore, 0, &wire.More{Offset: uint32(len(host))}, &more); st != 0 {
		t.Fatalf("more after resuming: %s %s", st, msg)
	}
	host = append(host, more.HostPages...)
	if len(host) != n {
		t.Fatalf("%d host pages after more, want %d", len(host), n)
	}
	// Asking past the end is refused; asking again is not (the reply stays
	// until the next request).
	if st, _ := r.do(wire.OpMore, 0, &wire.More{Offset: n + 1}, &more); st != wire.StatusBadRequest {
		t.Fatalf("more past the end: %s", st)
	}
	if st, _ := r.do(wire.OpMore, 0, &wire.More{Offset: 0}, &more); st != 0 || !slices.Equal(more.HostPages, host[:m]) {
		t.Fatalf("more from 0: %s, %d pages", st, len(more.HostPages))
	}
	var np wire.NumPagesReply
	if st, _ := r.do(wire.OpNumPages, 0, &wire.Stream{Rid: "r", Label: "l"}, &np); st != 0 || np.Pages != n {
		t.Fatalf("num_pages: %s %d", st, np.Pages)
	}
	if st, _ := r.do(wire.OpMore, 0, &wire.More{Offset: uint32(m)}, &more); st != wire.StatusBadRequest {
		t.Fatalf("more after another request: %s", st)
	}

	// The reload: pages staged, then dropped by an unrelated request, so
	// the reload alone names too few pages.
	if st, _ := r.do(wire.OpPages, 0, &wire.Pages{GpuPages: gpu[:m]}, nil); st != 0 {
		t.Fatal(st)
	}
	if st, _ := r.do(wire.OpUsage, 0, nil, &wire.UsageReply{}); st != 0 {
		t.Fatal(st)
	}
	var rel wire.ReloadReply
	if st, _ := r.do(wire.OpReload, 0, &wire.Reload{Rid: "r", Label: "l", GpuPages: gpu[m:]}, &rel); st != wire.StatusPageCount {
		t.Fatalf("reload after staged pages were dropped: %s", st)
	}
	if st, _ := r.do(wire.OpPages, 0, &wire.Pages{GpuPages: gpu[:m]}, nil); st != 0 {
		t.Fatal(st)
	}
	if st, msg := r.do(wire.OpReload, 0, &wire.Reload{Rid: "r", Label: "l", GpuPages: gpu[m:]}, &rel); st != 0 {
		t.Fatalf("reload: %s %s", st, msg)
	}
	back := slices.Clone(rel.HostPages)
	if rel.Total != n || rel.StoredLen != 5 || rel.Ticket == 0 {
		t.Fatalf("reload reply: total %d, %+v", rel.Total, rel.StoredLen)
	}
	if st, _ := r.do(wire.OpMore, 0, &wire.More{Offset: uint32(len(back))}, &more); st != 0 {
		t.Fatal(st)
	}
	back = append(back, more.HostPages...)
	if !slices.Equal(back, host) {
		t.Fatal("reload returned other host pages than the offload")
	}
}
