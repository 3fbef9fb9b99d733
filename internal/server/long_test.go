package server_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/internal/server"
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

// TestOpenPassesEveryChunk: one packet passes at most wire.MaxFDs
// descriptors (the kernel's bound on one sendmsg), so an open granting
// more chunks passes the first in its reply and the rest in the replies
// to more, each descriptor the memfd of the chunk named at its place. A
// session of more chunks than one packet can name (here long names make
// 600 of them past wire.MaxMessage) is named the same way: the reply
// names the chunks whose fds it passes and says how many there are
// (chunk_count), and each more names the next. A more past the chunks is
// refused; one from 0 hands them again; the next request of another kind
// ends the open's long reply.
func TestOpenPassesEveryChunk(t *testing.T) {
	for _, c := range []struct {
		name   string
		perGPU int // a session on GPU 0 binds that GPU's chunks
		suffix string
		named  bool // the reply names only the chunks whose fds it passes
	}{
		{"short names", 2*wire.MaxFDs + 4, "", false},
		{"names past a packet", 600, "-" + strings.Repeat("n", 200), true},
	} {
		t.Run(c.name, func(t *testing.T) {
			name := func(g, i int) string { return fmt.Sprintf("gpu%d-numaX-%d%s", g, i, c.suffix) }
			a := startServerNamed(t, c.perGPU, 4<<10, name, func(o *server.Options) { o.SweepInterval = time.Hour })
			openPassesEveryChunk(t, a, c.perGPU, c.named)
		})
	}
}

func openPassesEveryChunk(t *testing.T, a *agent, chunks int, named bool) {
	r := dial(t, a)
	r.hello()
	// call sends op and returns the reply's status, body and files.
	call := func(op wire.Op, m, rep proto.Message) (wire.Status, []*os.File) {
		t.Helper()
		r.seq++
		pkt, err := wire.AppendPacket(nil, wire.Header{Op: op, Seq: r.seq}, m)
		if err != nil {
			t.Fatal(err)
		}
		r.sendPacket(pkt, nil)
		h, body, files, ok := r.recv()
		if !ok {
			t.Fatalf("%s: connection closed", op)
		}
		for _, f := range files {
			t.Cleanup(func() { f.Close() })
		}
		if h.Status == wire.StatusOK {
			if err := wire.DecodeBody(body, rep); err != nil {
				t.Fatal(err)
			}
		}
		return h.Status, files
	}
	// sameFile: f is the memfd of chunk id.
	sameFile := func(f *os.File, id string) bool {
		var got, want unix.Stat_t
		hc := a.chunks[id]
		return hc != nil && unix.Fstat(int(f.Fd()), &got) == nil && unix.Fstat(int(hc.File.Fd()), &want) == nil &&
			got.Ino == want.Ino && got.Dev == want.Dev
	}
	var rep wire.OpenReply
	st, files := call(wire.OpOpen, openMsg("tok-a", 0, "instance-many"), &rep)
	wantNamed, wantCount := chunks, uint32(0)
	if named {
		wantNamed, wantCount = wire.MaxFDs, uint32(chunks)
	}
	if st != 0 || len(rep.Chunks) != wantNamed || rep.ChunkCount != wantCount || len(files) != wire.MaxFDs {
		t.Fatalf("open: status %s, %d chunks named, chunk count %d, %d fds; want %d named, count %d, %d fds",
			st, len(rep.Chunks), rep.ChunkCount, len(files), wantNamed, wantCount, wire.MaxFDs)
	}
	grants := rep.Chunks
	for off := len(files); off < chunks; {
		var mr wire.MoreReply
		st, more := call(wire.OpMore, &wire.More{Offset: uint32(off)}, &mr)
		want, wantGrants := min(wire.MaxFDs, chunks-off), 0
		if named {
			wantGrants = want
		}
		if st != 0 || len(more) != want || len(mr.Chunks) != wantGrants {
			t.Fatalf("more from %d: status %s, %d fds, %d chunks named; want %d fds, %d named", off, st, len(more), len(mr.Chunks), want, wantGrants)
		}
		grants = append(grants, mr.Chunks...)
		files = append(files, more...)
		off += len(more)
	}
	seen := map[string]bool{}
	for i, f := range files {
		if id := grants[i].Id; !sameFile(f, id) || seen[id] {
			t.Fatalf("fd %d is not the memfd of chunk %s, or the chunk was named twice", i, id)
		}
		seen[grants[i].Id] = true
	}
	var mr wire.MoreReply
	if st, more := call(wire.OpMore, &wire.More{Offset: uint32(chunks)}, &mr); st != wire.StatusBadRequest || len(more) != 0 {
		t.Fatalf("more past the chunks: status %s, %d fds", st, len(more))
	}
	if st, more := call(wire.OpMore, &wire.More{Offset: 0}, &mr); st != 0 || len(more) != wire.MaxFDs || !sameFile(more[0], grants[0].Id) {
		t.Fatalf("more from 0 again: status %s, %d fds", st, len(more))
	}
	if st, _ := call(wire.OpUsage, nil, &wire.UsageReply{}); st != 0 {
		t.Fatalf("usage: %s", st)
	}
	if st, more := call(wire.OpMore, &wire.More{Offset: wire.MaxFDs}, &mr); st != wire.StatusBadRequest || len(more) != 0 {
		t.Fatalf("more after another request: status %s, %d fds", st, len(more))
	}
}
