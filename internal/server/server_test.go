package server_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/unixsock"
	"github.com/kvpool/kvpool/pkg/wire"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

type agent struct {
	pool   *pool.Pool
	srv    *server.Server
	socket string
	chunks map[string]*hostmem.Chunk
}

// serve serves srv on a fresh socket in the test's directory until the
// test ends; a Serve that ends in an error fails the test.
func (a *agent) serve(t testing.TB, srv *server.Server) {
	t.Helper()
	a.srv = srv
	a.socket = filepath.Join(t.TempDir(), "kv.sock")
	l, err := server.Listen(a.socket)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, l) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
}

// startServer serves a pool of 2 GPUs x 2 chunks of 256 KiB; allocation
// "A" (token "tok-a") holds all four, allocation "B" (token "tok-b") none
// yet.
func startServer(t testing.TB) *agent {
	t.Helper()
	// No sweep: these tests look at revoked sessions before it would drop
	// them.
	return startServerWith(t, func(o *server.Options) { o.SweepInterval = time.Hour })
}

// startServerWith is startServer with the options edited by edit.
func startServerWith(t testing.TB, edit func(*server.Options)) *agent {
	t.Helper()
	return startServerOf(t, 2, 256<<10, edit)
}

// startServerOf is startServerWith with perGPU chunks of size bytes on
// each GPU, named gpuG-numaX-I.
func startServerOf(t testing.TB, perGPU int, size int64, edit func(*server.Options)) *agent {
	t.Helper()
	return startServerNamed(t, perGPU, size, func(g, i int) string { return fmt.Sprintf("gpu%d-numaX-%d", g, i) }, edit)
}

// startServerNamed is startServerOf with the chunks named by name.
func startServerNamed(t testing.TB, perGPU int, size int64, name func(gpu, i int) string, edit func(*server.Options)) *agent {
	t.Helper()
	a := &agent{pool: pool.New(), chunks: map[string]*hostmem.Chunk{}}
	var ids []string
	for g := 0; g < 2; g++ {
		for i := 0; i < perGPU; i++ {
			id := name(g, i)
			hc, err := hostmem.Alloc(hostmem.Options{Size: size})
			if err != nil {
				t.Fatal(err)
			}
			a.chunks[id] = hc
			if err := a.pool.AddChunk(pool.Chunk{ID: id, GPU: g, NUMA: -1, Size: size}); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
	}
	if err := a.pool.Grant("A", ids); err != nil {
		t.Fatal(err)
	}
	o := server.Options{Pool: a.pool, Logger: quiet, GPUs: testGPUs,
		Chunks:    func(id string) (*hostmem.Chunk, bool) { c, ok := a.chunks[id]; return c, ok },
		Authorize: server.StaticTokens(map[string]string{"tok-a": "A", "tok-b": "B"})}
	edit(&o)
	srv, err := server.New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, c := range a.chunks {
			c.Close()
		}
	})
	a.serve(t, srv)
	return a
}

// raw is a client speaking the wire format by hand.
type raw struct {
	t   testing.TB
	c   *wire.Conn
	buf []byte
	seq uint32
}

func dial(t testing.TB, a *agent) *raw {
	t.Helper()
	c, err := wire.Dial(a.socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &raw{t: t, c: c, buf: make([]byte, wire.MaxMessage+1)}
}

func (r *raw) sendPacket(pkt []byte, fds []int) {
	r.t.Helper()
	if len(pkt) > wire.MaxMessage {
		// wire.Conn refuses to send this; a broken client would not.
		if err := writeRaw(r.c, pkt); err != nil {
			r.t.Fatal(err)
		}
		return
	}
	if err := r.c.Send(pkt, fds); err != nil {
		r.t.Fatal(err)
	}
}

// writeRaw writes pkt on c's socket as one packet, past Send's checks.
func writeRaw(c *wire.Conn, pkt []byte) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var werr error
	if err := rc.Write(func(fd uintptr) bool {
		_, werr = unix.Write(int(fd), pkt)
		return werr != unix.EAGAIN
	}); err != nil {
		return err
	}
	return werr
}

// recv returns the next reply, or ok false when the server closed the
// connection.
func (r *raw) recv() (h wire.Header, body []byte, files []*os.File, ok bool) {
	r.t.Helper()
	r.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	pkt, files, err := r.c.Recv(r.buf)
	if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
		return h, nil, nil, false // closed by the server, with or without our packet read
	}
	if err != nil {
		r.t.Fatal(err)
	}
	h, body, err = wire.ParseHeader(pkt)
	if err != nil {
		r.t.Fatal(err)
	}
	return h, body, files, true
}

// do sends op with body m and returns the reply's status, error message and
// body.
func (r *raw) do(op wire.Op, fence uint64, m proto.Message, rep proto.Message) (wire.Status, string) {
	r.t.Helper()
	r.seq++
	pkt, err := wire.AppendPacket(nil, wire.Header{Op: op, Seq: r.seq, Fence: fence}, m)
	if err != nil {
		r.t.Fatal(err)
	}
	r.sendPacket(pkt, nil)
	return r.reply(op, rep)
}

func (r *raw) reply(op wire.Op, rep proto.Message) (wire.Status, string) {
	r.t.Helper()
	h, body, files, ok := r.recv()
	if !ok {
		r.t.Fatalf("%s: connection closed", op)
	}
	for _, f := range files {
		f.Close()
	}
	if h.Seq != r.seq {
		r.t.Fatalf("%s: reply seq %d, want %d", op, h.Seq, r.seq)
	}
	if h.Status != wire.StatusOK {
		var e wire.Error
		if err := wire.DecodeBody(body, &e); err != nil {
			r.t.Fatal(err)
		}
		if e.Message == "" {
			r.t.Fatalf("%s: status %s without a message", op, h.Status)
		}
		return h.Status, e.Message
	}
	if err := wire.DecodeBody(body, rep); err != nil {
		r.t.Fatal(err)
	}
	return h.Status, ""
}

func (r *raw) hello() {
	r.t.Helper()
	if st, msg := r.do(wire.OpHello, 0, &wire.Hello{Version: wire.Version, Client: "test"}, &wire.HelloReply{}); st != 0 {
		r.t.Fatalf("hello: %s %s", st, msg)
	}
}

// testGPUs is the node's plan in these tests: GPUs 0 and 1 have chunks
// sized under their names, GPU 2 has none.
var testGPUs = map[string]int{gpuUUID(0): 0, gpuUUID(1): 1, gpuUUID(2): 2}

func gpuUUID(g uint32) string { return fmt.Sprintf("GPU-0000000%d-test", g) }

func openMsg(token string, gpu uint32, inst string) *wire.Open {
	return &wire.Open{Token: token, GpuUuid: gpuUUID(gpu), InstanceId: []byte(inst),
		Regions: []*wire.Region{{BytesPerPage: 3000, PageCount: 32}, {BytesPerPage: 1000, PageCount: 40}}}
}

func (r *raw) open(gpu uint32, inst string) *wire.OpenReply {
	r.t.Helper()
	r.hello()
	var rep wire.OpenReply
	if st, msg := r.do(wire.OpOpen, 0, openMsg("tok-a", gpu, inst), &rep); st != 0 {
		r.t.Fatalf("open: %s %s", st, msg)
	}
	return &rep
}

func (r *raw) usage() *wire.UsageReply {
	r.t.Helper()
	var u wire.UsageReply
	if st, msg := r.do(wire.OpUsage, 0, nil, &u); st != 0 {
		r.t.Fatalf("usage: %s %s", st, msg)
	}
	return &u
}

func TestOpenGrantsChunks(t *testing.T) {
	a := startServer(t)
	r := dial(t, a)
	r.hello()
	r.seq++
	pkt, _ := wire.AppendPacket(nil, wire.Header{Op: wire.OpOpen, Seq: r.seq}, openMsg("tok-a", 1, "instance-1"))
	r.sendPacket(pkt, nil)
	h, body, files, ok := r.recv()
	if !ok || h.Status != 0 {
		t.Fatalf("open: %v %v", h, ok)
	}
	var rep wire.OpenReply
	if err := wire.DecodeBody(body, &rep); err != nil {
		t.Fatal(err)
	}
	// 3000+1000 rounded up to 256 is 4096; 256 KiB chunks hold 64 pages.
	if rep.PageSize != 4096 || rep.PagesPerChunk != 64 || rep.Capacity != 128 || len(rep.Chunks) != 2 || len(files) != 2 {
		t.Fatalf("open reply %v with %d fds", &rep, len(files))
	}
	for i, c := range rep.Chunks {
		if !strings.HasPrefix(c.Id, "gpu1-") {
			t.Fatalf("GPU 1 session got chunk %s", c.Id)
		}
		// The fd is the chunk: a byte the agent wrote reads back through it.
		a.chunks[c.Id].Mem[100] = byte(42 + i)
		mem, err := hostmem.Map(files[i], int64(c.Size))
		if err != nil {
			t.Fatal(err)
		}
		if mem[100] != byte(42+i) {
			t.Fatalf("fd %d does not map chunk %s", i, c.Id)
		}
		files[i].Close()
	}
	ss := a.srv.Sessions()
	if len(ss) != 1 || ss[0].GPU != 1 || !ss[0].Connected || ss[0].Peer.PID != int32(os.Getpid()) {
		t.Fatalf("sessions %+v", ss)
	}
}

// TestBadInput sends every kind of bad request on a fresh connection and
// checks the reply status, or that the connection was closed, and then that
// the agent still serves another client whose state is intact.
func TestBadInput(t *testing.T) {
	a := startServer(t)
	good := dial(t, a)
	good.open(0, "good-client")
	var off wire.OffloadReply
	if st, msg := good.do(wire.OpOffload, 0, &wire.Offload{Rid: "r", Label: "l", GpuPages: []int32{1, 2, 3}}, &off); st != 0 || !off.Ok {
		t.Fatal(st, msg)
	}

	hdr := func(op wire.Op, status wire.Status) []byte {
		return wire.AppendHeader(nil, wire.Header{Op: op, Status: status, Seq: 1})
	}
	withBody := func(op wire.Op, m proto.Message) []byte {
		b, _ := wire.AppendPacket(nil, wire.Header{Op: op, Seq: 1}, m)
		return b
	}
	devnull, _ := os.Open(os.DevNull)
	defer devnull.Close()
	const closed = wire.Status(255)
	cases := []struct {
		name  string
		setup string // "", "hello", "open": what the connection did first
		pkt   []byte
		fds   []int
		want  wire.Status
	}{
		{"short packet", "", []byte{1, 0, 0}, nil, closed},
		{"reserved bytes set", "", []byte{1, 0, 7, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, nil, closed},
		{"oversized", "open", append(hdr(wire.OpUsage, 0), make([]byte, wire.MaxMessage)...), nil, closed},
		{"hello version 0", "", withBody(wire.OpHello, &wire.Hello{Version: 0}), nil, wire.StatusVersion},
		{"op before hello", "", withBody(wire.OpUsage, nil), nil, wire.StatusVersion},
		{"hello twice", "hello", withBody(wire.OpHello, &wire.Hello{Version: wire.Version}), nil, wire.StatusBadRequest},
		{"unknown op", "hello", hdr(99, 0), nil, wire.StatusUnknownOp},
		{"op zero", "hello", hdr(0, 0), nil, wire.StatusUnknownOp},
		{"status in request", "hello", hdr(wire.OpUsage, wire.StatusBusy), nil, wire.StatusBadRequest},
		{"garbage body", "hello", append(hdr(wire.OpOpen, 0), 0xff, 0xff, 0xff), nil, wire.StatusBadRequest},
		{"length past end", "hello", append(hdr(wire.OpOpen, 0), 0x0a, 0x50, 'x'), nil, wire.StatusBadRequest},
		{"fd on request", "hello", withBody(wire.OpUsage, nil), []int{int(devnull.Fd())}, wire.StatusUnexpectedFDs},
		{"bad token", "hello", withBody(wire.OpOpen, openMsg("nope", 0, "instance-x")), nil, wire.StatusUnauthorized},
		{"empty token", "hello", withBody(wire.OpOpen, openMsg("", 0, "instance-x")), nil, wire.StatusUnauthorized},
		{"token of allocation not granted", "hello", withBody(wire.OpOpen, openMsg("tok-b", 0, "instance-x")), nil, wire.StatusUnauthorized},
		{"short instance id", "hello", withBody(wire.OpOpen, openMsg("tok-a", 0, "x")), nil, wire.StatusBadRequest},
		{"no regions", "hello", withBody(wire.OpOpen, &wire.Open{Token: "tok-a", GpuUuid: gpuUUID(1), InstanceId: []byte("instance-x")}), nil, wire.StatusBadSize},
		{"hello of version 1", "", withBody(wire.OpHello, &wire.Hello{Version: 1, Client: "old"}), nil, wire.StatusVersion},
		{"no GPU UUID", "hello", withBody(wire.OpOpen, &wire.Open{Token: "tok-a", InstanceId: []byte("instance-x"),
			Regions: []*wire.Region{{BytesPerPage: 4096, PageCount: 4}}}), nil, wire.StatusBadRequest},
		{"GPU not in the plan", "hello", withBody(wire.OpOpen, openMsg("tok-a", 7, "instance-x")), nil, wire.StatusUnknownGPU},
		{"GPU UUID of another node", "hello", withBody(wire.OpOpen, &wire.Open{Token: "tok-a", GpuUuid: "GPU-19999", InstanceId: []byte("instance-x"),
			Regions: []*wire.Region{{BytesPerPage: 4096, PageCount: 4}}}), nil, wire.StatusUnknownGPU},
		{"too many ranks declared", "hello", withBody(wire.OpOpen, &wire.Open{Token: "tok-a", GpuUuid: gpuUUID(1), InstanceId: []byte("instance-x"),
			Regions: []*wire.Region{{BytesPerPage: 4096, PageCount: 4}}, Ranks: 1025}), nil, wire.StatusBadRequest},
		{"more with no long reply", "open", withBody(wire.OpMore, &wire.More{}), nil, wire.StatusBadRequest},
		{"more before open", "hello", withBody(wire.OpMore, &wire.More{}), nil, wire.StatusNoSession},
		{"pages beyond the device", "open", withBody(wire.OpPages, &wire.Pages{GpuPages: make([]int32, 33)}), nil, wire.StatusPageCount},
		{"pages with a bad body", "open", append(hdr(wire.OpPages, 0), 0x0a, 0x05, 0x01), nil, wire.StatusBadRequest},
		{"zero bytes per page", "hello", withBody(wire.OpOpen, &wire.Open{Token: "tok-a", GpuUuid: gpuUUID(1), InstanceId: []byte("instance-x"),
			Regions: []*wire.Region{{BytesPerPage: 0, PageCount: 4}}}), nil, wire.StatusBadSize},
		{"zero page count", "hello", withBody(wire.OpOpen, &wire.Open{Token: "tok-a", GpuUuid: gpuUUID(1), InstanceId: []byte("instance-x"),
			Regions: []*wire.Region{{BytesPerPage: 4096, PageCount: 0}}}), nil, wire.StatusBadSize},
		{"page larger than chunk", "hello", withBody(wire.OpOpen, &wire.Open{Token: "tok-a", GpuUuid: gpuUUID(1), InstanceId: []byte("instance-x"),
			Regions: []*wire.Region{{BytesPerPage: 1 << 20, PageCount: 4}}}), nil, wire.StatusBadSize},
		{"huge page size", "hello", withBody(wire.OpOpen, &wire.Open{Token: "tok-a", GpuUuid: gpuUUID(1), InstanceId: []byte("instance-x"),
			Regions: []*wire.Region{{BytesPerPage: 1 << 62, PageCount: 4}, {BytesPerPage: 1 << 62, PageCount: 4}}}), nil, wire.StatusBadSize},
		{"more pages than the allocation", "hello", withBody(wire.OpOpen, &wire.Open{Token: "tok-a", GpuUuid: gpuUUID(1), InstanceId: []byte("instance-x"),
			Regions: []*wire.Region{{BytesPerPage: 4096, PageCount: 4}}, MaxPages: 100000}), nil, wire.StatusNoCapacity},
		{"GPU held by a live session", "hello", withBody(wire.OpOpen, openMsg("tok-a", 0, "instance-x")), nil, wire.StatusBusy},
		{"pool op before open", "hello", withBody(wire.OpOffload, &wire.Offload{Rid: "r", Label: "l", GpuPages: []int32{1}}), nil, wire.StatusNoSession},
		{"open twice", "open", withBody(wire.OpOpen, openMsg("tok-a", 1, "instance-y")), nil, wire.StatusBadRequest},
		{"index out of range", "open", withBody(wire.OpOffload, &wire.Offload{Rid: "q", Label: "l", GpuPages: []int32{32}}), nil, wire.StatusOutOfRange},
		{"negative index", "open", withBody(wire.OpOffload, &wire.Offload{Rid: "q", Label: "l", GpuPages: []int32{-5}}), nil, wire.StatusOutOfRange},
		{"duplicate index", "open", withBody(wire.OpOffload, &wire.Offload{Rid: "q", Label: "l", GpuPages: []int32{4, 5, 4}}), nil, wire.StatusDuplicateIndex},
		{"too many indices", "open", withBody(wire.OpOffload, &wire.Offload{Rid: "q", Label: "l", GpuPages: make([]int32, 33)}), nil, wire.StatusPageCount},
		{"negative metadata", "open", withBody(wire.OpOffload, &wire.Offload{Rid: "q", Label: "l", GpuPages: []int32{1}, Position: -1}), nil, wire.StatusBadSize},
		{"empty rid", "open", withBody(wire.OpOffload, &wire.Offload{Label: "l", GpuPages: []int32{1}}), nil, wire.StatusBadName},
		{"long label", "open", withBody(wire.OpOffload, &wire.Offload{Rid: "q", Label: strings.Repeat("x", 2000), GpuPages: []int32{1}}), nil, wire.StatusBadName},
		{"reload unknown", "open", withBody(wire.OpReload, &wire.Reload{Rid: "q", Label: "l", GpuPages: []int32{1}}), nil, wire.StatusUnknownStream},
		{"fence never issued", "open", wire.AppendHeader(nil, wire.Header{Op: wire.OpFence, Seq: 1, Fence: 99}), nil, wire.StatusBadFence},
		{"body on usage", "open", append(hdr(wire.OpUsage, 0), 0x08, 0x01), nil, wire.StatusBadRequest},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := good.usage()
			r := dial(t, a)
			switch tc.setup {
			case "hello":
				r.hello()
			case "open":
				r.open(1, "case-instance-"+string(rune('a'+i)))
			}
			r.seq = 0
			want := tc.want
			if len(tc.fds) > 0 {
				// Where the kernel has SO_PASSRIGHTS (6.16), the agent's
				// socket refuses files: the send fails at the client and
				// nothing reaches the agent, which answers the same
				// request sent without them (the case's usage before an
				// open: no session). Elsewhere the agent answers
				// StatusUnexpectedFDs.
				err := r.c.Send(tc.pkt, tc.fds)
				if wire.CanRefuseFiles() && !errors.Is(err, syscall.EPERM) {
					t.Fatalf("send of a file to the agent: %v, want EPERM (its socket refusing files)", err)
				}
				switch {
				case errors.Is(err, syscall.EPERM):
					t.Log("the agent's socket refused the files (SO_PASSRIGHTS)")
					r.sendPacket(tc.pkt, nil)
					want = wire.StatusNoSession
				case err != nil:
					t.Fatal(err)
				}
			} else {
				r.sendPacket(tc.pkt, tc.fds)
			}
			r.seq = 1
			h, body, files, ok := r.recv()
			for _, f := range files {
				f.Close()
			}
			switch {
			case want == closed && ok:
				t.Fatalf("got reply %+v, want the connection closed", h)
			case want != closed && !ok:
				t.Fatalf("connection closed, want status %s", want)
			case ok && h.Status != want:
				var e wire.Error
				wire.DecodeBody(body, &e)
				t.Fatalf("status %s (%s), want %s", h.Status, e.Message, want)
			}
			if ok && h.Status != wire.StatusVersion {
				// The connection goes on serving after an error reply.
				switch tc.setup {
				case "open":
					r.usage()
				case "hello":
					var u wire.UsageReply
					if st, _ := r.do(wire.OpUsage, 0, nil, &u); st != wire.StatusNoSession && st != 0 {
						t.Fatalf("after the error: %s", st)
					}
				}
			}
			after := good.usage()
			if !proto.Equal(before, after) {
				t.Fatalf("the other client's session changed: %v -> %v", before, after)
			}
			r.c.Close()
			if tc.setup == "open" {
				// Leave GPU 1 free for the next case.
				waitFor(t, func() bool { return len(a.srv.Sessions()) == 1 || !a.srv.Sessions()[1].Connected })
				var rep wire.OpenReply
				rr := dial(t, a)
				rr.hello()
				if st, msg := rr.do(wire.OpOpen, 0, openMsg("tok-a", 1, "case-instance-"+string(rune('a'+i))), &rep); st != 0 {
					t.Fatal(st, msg)
				}
				rr.do(wire.OpClose, 0, nil, nil)
			}
		})
	}
	var n wire.NumPagesReply
	if st, msg := good.do(wire.OpNumPages, 0, &wire.Stream{Rid: "r", Label: "l"}, &n); st != 0 || n.Pages != 3 {
		t.Fatalf("the good client's stream after all that: %s %s %v", st, msg, &n)
	}
}

func waitFor(t testing.TB, cond func() bool) {
	t.Helper()
	for range 400 {
		if cond() {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatal("condition not reached")
}

func TestRevokeAndReplace(t *testing.T) {
	a := startServer(t)
	r0 := dial(t, a)
	r0.open(0, "process-1")
	r1 := dial(t, a)
	r1.open(1, "process-1")
	var off wire.OffloadReply
	for _, r := range []*raw{r0, r1} {
		if st, _ := r.do(wire.OpOffload, 0, &wire.Offload{Rid: "r", Label: "l", GpuPages: []int32{1, 2}}, &off); st != 0 {
			t.Fatal(st)
		}
	}
	// A connection drop does not end the session: the same instance
	// resumes it with its streams.
	r0.c.Close()
	waitFor(t, func() bool { return !a.srv.Sessions()[0].Connected })
	r0 = dial(t, a)
	rep := r0.open(0, "process-1")
	if !rep.Resumed || r0.usage().Used != 2 {
		t.Fatalf("resume: %v", rep)
	}
	// A new instance replaces a dead one on GPU 0 only.
	r0.c.Close()
	waitFor(t, func() bool { return !a.srv.Sessions()[0].Connected })
	r2 := dial(t, a)
	if rep := r2.open(0, "process-2"); rep.Resumed || r2.usage().Used != 0 {
		t.Fatalf("replacement: %v", rep)
	}
	if r1.usage().Used != 2 {
		t.Fatal("GPU 1 session disturbed")
	}
	// Chunks go back only on revoke; then every session reports closed.
	if ch := a.pool.Chunks(); ch[0].State != pool.ChunkGranted {
		t.Fatalf("chunk state %v before revoke", ch[0].State)
	}
	if _, err := a.pool.Revoke("A"); err != nil {
		t.Fatal(err)
	}
	var u wire.UsageReply
	if st, _ := r1.do(wire.OpUsage, 0, nil, &u); st != wire.StatusClosed {
		t.Fatalf("usage after revoke: %s", st)
	}
	if len(a.srv.Sessions()) != 0 {
		t.Fatalf("sessions after revoke: %+v", a.srv.Sessions())
	}
}

func TestMaxConns(t *testing.T) {
	a := &agent{pool: pool.New(), chunks: map[string]*hostmem.Chunk{}}
	srv, err := server.New(server.Options{Pool: a.pool, Logger: quiet, Limits: server.Limits{MaxConns: 2}, EvictAfter: -1,
		Chunks:    func(string) (*hostmem.Chunk, bool) { return nil, false },
		Authorize: server.StaticTokens(nil)})
	if err != nil {
		t.Fatal(err)
	}
	a.serve(t, srv)
	r1, r2 := dial(t, a), dial(t, a)
	r1.hello()
	r2.hello()
	r3 := dial(t, a)
	hello, _ := wire.AppendPacket(nil, wire.Header{Op: wire.OpHello, Seq: 1}, &wire.Hello{Version: wire.Version})
	if err := r3.c.Send(hello, nil); err != nil {
		t.Fatal(err)
	}
	// The refusal answers the hello with StatusLimit and a message, then
	// closes the connection.
	h, body, _, ok := r3.recv()
	var e wire.Error
	if !ok || h.Status != wire.StatusLimit || h.Seq != 1 || wire.DecodeBody(body, &e) != nil || !strings.Contains(e.Message, "at most 2 connections") {
		t.Fatalf("a third connection over a limit of two: ok %v status %s seq %d message %q", ok, h.Status, h.Seq, e.Message)
	}
	if _, _, _, ok := r3.recv(); ok {
		t.Fatal("the refused connection stayed open")
	}
	r1.usageNoSession(t)
	r1.c.Close()
	// Room again once one leaves.
	waitFor(t, func() bool {
		r := &raw{t: t, buf: make([]byte, wire.MaxMessage+1)}
		c, err := wire.Dial(a.socket)
		if err != nil {
			return false
		}
		defer c.Close()
		r.c = c
		if err := c.Send(hello, nil); err != nil {
			return false
		}
		_, _, _, ok := r.recv()
		return ok
	})
}

func (r *raw) usageNoSession(t *testing.T) {
	var u wire.UsageReply
	if st, _ := r.do(wire.OpUsage, 0, nil, &u); st != wire.StatusNoSession {
		t.Fatalf("usage without a session: %s", st)
	}
}

// TestPollAfterReply: a server whose connections poll for the next request
// serves as one that does not, and New refuses a window outside
// [0, wire.SpinLimit].
func TestPollAfterReply(t *testing.T) {
	for _, bad := range []time.Duration{-time.Nanosecond, wire.SpinLimit + 1} {
		_, err := server.New(server.Options{Pool: pool.New(), Chunks: func(string) (*hostmem.Chunk, bool) { return nil, false },
			Authorize: server.StaticTokens(nil), PollAfterReply: bad})
		if err == nil || !strings.Contains(err.Error(), "PollAfterReply") {
			t.Fatalf("New with PollAfterReply %v: %v", bad, err)
		}
	}
	a := startServerWith(t, func(o *server.Options) { o.PollAfterReply = wire.SpinLimit })
	r := dial(t, a)
	r.open(0, "instance-1")
	for i := range 3 {
		// The second request comes after the window, the others at once.
		if i == 1 {
			time.Sleep(5 * wire.SpinLimit)
		}
		var u wire.UsageReply
		if st, msg := r.do(wire.OpUsage, 0, nil, &u); st != 0 || u.Capacity == 0 {
			t.Fatalf("usage %d: %v %q %+v", i, st, msg, &u)
		}
	}
}

// countingPool is a server.Pool over a *pool.Pool that counts the calls
// the server makes.
type countingPool struct {
	*pool.Pool
	mu            sync.Mutex
	opens, closes int
}

func (p *countingPool) ReplaceNear(old *pool.Session, alloc string, spec pool.Spec, near pool.Near) (*pool.Session, error) {
	p.mu.Lock()
	p.opens++
	p.mu.Unlock()
	return p.Pool.ReplaceNear(old, alloc, spec, near)
}

func (p *countingPool) Close(s *pool.Session) {
	p.mu.Lock()
	p.closes++
	p.mu.Unlock()
	p.Pool.Close(s)
}

// The server reaches the pool through its Pool seam alone (ReplaceNear, Close),
// and gives the one Authorizer the token with the peer's credentials.
func TestPoolAndAuthorizeSeams(t *testing.T) {
	var cp *countingPool
	var mu sync.Mutex
	var peers []unixsock.Peer
	a := startServerWith(t, func(o *server.Options) {
		cp = &countingPool{Pool: o.Pool.(*pool.Pool)}
		o.Pool = cp
		next := o.Authorize
		o.Authorize = func(token string, peer unixsock.Peer) (string, error) {
			mu.Lock()
			peers = append(peers, peer)
			mu.Unlock()
			return next(token, peer)
		}
	})
	r := dial(t, a)
	r.open(0, "instance-seam")
	if st, msg := r.do(wire.OpClose, 0, nil, nil); st != wire.StatusOK {
		t.Fatalf("close: %s %s", st, msg)
	}
	cp.mu.Lock()
	if cp.opens != 1 || cp.closes != 1 {
		t.Errorf("pool saw %d opens and %d closes, want 1 and 1", cp.opens, cp.closes)
	}
	cp.mu.Unlock()
	mu.Lock()
	defer mu.Unlock()
	if len(peers) != 1 || peers[0].PID != int32(os.Getpid()) || peers[0].UID != uint32(os.Getuid()) {
		t.Errorf("Authorize saw peers %+v, want this process once", peers)
	}
}
