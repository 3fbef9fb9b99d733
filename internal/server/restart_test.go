package server_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/internal/books"
	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/poolerr"
	"github.com/kvpool/kvpool/pkg/unixsock"
	"github.com/kvpool/kvpool/pkg/wire"
)

// fdStore keeps the latest books memfd, as the keeper does.
type fdStore struct{ f *os.File }

func (s *fdStore) PutBooks(_ uint64, f *os.File) error {
	fd, err := unix.Dup(int(f.Fd()))
	if err != nil {
		return err
	}
	if s.f != nil {
		s.f.Close()
	}
	s.f = os.NewFile(uintptr(fd), "books")
	return nil
}

// journaled starts a server over p with books, on a fresh socket.
func journaled(t testing.TB, p *pool.Pool, chunks map[string]*hostmem.Chunk, j server.Journal, restore []server.RestoredSession) (*agent, *server.Server) {
	t.Helper()
	a := &agent{pool: p, chunks: chunks}
	srv, err := server.New(server.Options{Pool: p, Logger: quiet, Journal: j, GPUs: testGPUs,
		Chunks: func(id string) (*hostmem.Chunk, bool) { c, ok := chunks[id]; return c, ok },
		Authorize: func(tok string, _ unixsock.Peer) (string, error) {
			switch tok {
			case "tok-a":
				return "A", nil
			case "tok-wait":
				return "", fmt.Errorf("%w: chunks still coming", poolerr.ErrNotReady)
			}
			return "", contract.ErrUnknownToken
		}})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Restore(restore); err != nil {
		t.Fatal(err)
	}
	a.serve(t, srv)
	return a, srv
}

// sendSeq sends op with an explicit sequence number and returns the raw
// reply packet.
func (r *raw) sendSeq(op wire.Op, seq uint32, m *wire.Offload) []byte {
	r.t.Helper()
	pkt, err := wire.AppendPacket(nil, wire.Header{Op: op, Seq: seq}, m)
	if err != nil {
		r.t.Fatal(err)
	}
	r.sendPacket(pkt, nil)
	r.c.SetReadDeadline(timeIn5s())
	got, _, err := r.c.Recv(r.buf)
	if err != nil {
		r.t.Fatal(err)
	}
	return bytes.Clone(got)
}

// booksPool is a pool of two 256 KiB chunks on GPU 0, granted to "A",
// journaled into books kept by store.
func booksPool(t testing.TB) (*pool.Pool, map[string]*hostmem.Chunk, *books.Books, *fdStore) {
	return booksPoolOf(t, 256<<10)
}

func booksPoolOf(t testing.TB, chunkBytes int64) (*pool.Pool, map[string]*hostmem.Chunk, *books.Books, *fdStore) {
	p := pool.New()
	store := &fdStore{}
	b, err := books.Start(books.NewState(), 0, store, func(err error) { t.Errorf("books: %v", err) })
	if err != nil {
		t.Fatal(err)
	}
	p.SetJournal(b)
	chunks := map[string]*hostmem.Chunk{}
	var ids []string
	for i := range 2 {
		id := fmt.Sprintf("c%d", i)
		hc, err := hostmem.Alloc(hostmem.Options{Size: chunkBytes})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { hc.Close() })
		chunks[id] = hc
		if err := p.AddChunk(pool.Chunk{ID: id, GPU: 0, Size: chunkBytes}); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if err := p.Grant("A", ids); err != nil {
		t.Fatal(err)
	}
	return p, chunks, b, store
}

func TestRestartResumesAndReplays(t *testing.T) {
	p, chunks, b, store := booksPool(t)
	a1, _ := journaled(t, p, chunks, b, nil)

	r := dial(t, a1)
	first := r.open(0, "instance-1")
	off := &wire.Offload{Rid: "r", Label: "l", GpuPages: []int32{3, 4, 5}, StoredLen: 7}
	rep1 := r.sendSeq(wire.OpOffload, 100, off)
	if h, _, _ := wire.ParseHeader(rep1); h.Status != wire.StatusOK {
		t.Fatalf("offload: %s", h.Status)
	}
	// The same request again (same seq): the same answer, not "duplicate".
	if again := r.sendSeq(wire.OpOffload, 100, off); !bytes.Equal(again, rep1) {
		t.Fatalf("resent offload answered %x, first %x", again, rep1)
	}
	// A new request for the same stream is a duplicate.
	if h, _, _ := wire.ParseHeader(r.sendSeq(wire.OpOffload, 101, off)); h.Status != wire.StatusDuplicateStream {
		t.Fatalf("new offload of the same stream: %s", h.Status)
	}
	before := p.Export()
	b.Close()

	// The agent restarts: the books rebuild the pool, and the server takes
	// the sessions back.
	st, _, err := books.Load(store.f)
	if err != nil {
		t.Fatal(err)
	}
	p2 := pool.New()
	ss, err := p2.Restore(st.Image())
	if err != nil {
		t.Fatal(err)
	}
	if got := p2.Export(); !reflect.DeepEqual(got, before) {
		t.Fatalf("restored pool:\n%+v\nwant\n%+v", got, before)
	}
	b2, err := books.Start(st, 0, store, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b2.Close()
	p2.SetJournal(b2)
	a2, srv2 := journaled(t, p2, chunks, b2, st.Restored(ss))

	// Not ready yet: hello says "unavailable, retry" (28), not "unauthorized".
	srv2.SetReady(false)
	r2 := dial(t, a2)
	if stt, msg := r2.do(wire.OpHello, 0, &wire.Hello{Version: 1}, &wire.HelloReply{}); stt != wire.StatusUnavailable {
		t.Fatalf("hello while restoring: %s %s", stt, msg)
	}
	srv2.SetReady(true)
	r2 = dial(t, a2)
	res := r2.open(0, "instance-1")
	if !res.Resumed || res.Session != first.Session || res.Capacity != first.Capacity {
		t.Fatalf("after the restart: %+v, first %+v", res, first)
	}
	// The client resends the request it never had answered.
	if again := r2.sendSeq(wire.OpOffload, 100, off); !bytes.Equal(again, rep1) {
		t.Fatalf("resent offload after the restart answered %x, first %x", again, rep1)
	}
	var rl wire.ReloadReply
	if stt, msg := r2.do(wire.OpReload, 0, &wire.Reload{Rid: "r", Label: "l", GpuPages: []int32{0, 1, 2}}, &rl); stt != 0 || rl.StoredLen != 7 || len(rl.HostPages) != 3 {
		t.Fatalf("reload after the restart: %s %s %+v", stt, msg, &rl)
	}
	// A token whose chunks are not ready: 28, distinct from 4.
	r3 := dial(t, a2)
	r3.hello()
	if stt, _ := r3.do(wire.OpOpen, 0, openMsg("tok-wait", 0, "instance-3"), &wire.OpenReply{}); stt != wire.StatusUnavailable {
		t.Fatalf("open with a token not ready: %s", stt)
	}
	if stt, _ := r3.do(wire.OpOpen, 0, openMsg("tok-gone", 0, "instance-3"), &wire.OpenReply{}); stt != wire.StatusUnauthorized {
		t.Fatalf("open with an unknown token: %s", stt)
	}
	if got := wire.StatusUnavailable.String(); got != "unavailable, retry" {
		t.Fatal(got)
	}
}

func timeIn5s() time.Time { return time.Now().Add(5 * time.Second) }

// restartFrom rebuilds the pool from the books of store (as an agent does
// at start) and serves it again.
func restartFrom(t *testing.T, store *fdStore, chunks map[string]*hostmem.Chunk) *agent {
	t.Helper()
	st, _, err := books.Load(store.f)
	if err != nil {
		t.Fatal(err)
	}
	p := pool.New()
	ss, err := p.Restore(st.Image())
	if err != nil {
		t.Fatal(err)
	}
	b, err := books.Start(st, 0, store, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	p.SetJournal(b)
	a, _ := journaled(t, p, chunks, b, st.Restored(ss))
	return a
}

// A long offload's answer survives a restart whole: resent with its
// sequence number (its device pages staged again), it gets the same first
// packet, and OpMore hands out the same rest.
func TestRestartReplaysLongReply(t *testing.T) {
	const n = wire.MaxPagesPerPacket + 5000
	p, chunks, b, store := booksPoolOf(t, 4<<20) // 2 x 16384 pages of 256 bytes
	a1, _ := journaled(t, p, chunks, b, nil)
	open := &wire.Open{Token: "tok-a", GpuUuid: gpuUUID(0), InstanceId: []byte("instance-long"),
		Regions: []*wire.Region{{BytesPerPage: 256, PageCount: n}}}
	dev := make([]int32, n)
	for i := range dev {
		dev[i] = int32(i)
	}
	head, tail := dev[:wire.MaxPagesPerPacket], dev[wire.MaxPagesPerPacket:]
	off := &wire.Offload{Rid: "long", Label: "kv", GpuPages: tail, StoredLen: n}
	offload := func(r *raw) ([]byte, []int32) {
		t.Helper()
		if st, msg := r.do(wire.OpPages, 0, &wire.Pages{GpuPages: head}, nil); st != 0 {
			t.Fatalf("pages: %s %s", st, msg)
		}
		first := r.sendSeq(wire.OpOffload, 900, off)
		h, body, err := wire.ParseHeader(first)
		var rep wire.OffloadReply
		if err == nil {
			err = wire.DecodeBody(body, &rep)
		}
		if err != nil || h.Status != 0 || !rep.Ok || rep.Total != n || len(rep.HostPages) != wire.MaxPagesPerPacket {
			t.Fatalf("offload: %v, status %s, ok %v, %d host pages of %d", err, h.Status, rep.Ok, len(rep.HostPages), rep.Total)
		}
		all := slices.Clone(rep.HostPages)
		for len(all) < n {
			var more wire.MoreReply
			if st, msg := r.do(wire.OpMore, 0, &wire.More{Offset: uint32(len(all))}, &more); st != 0 || len(more.HostPages) == 0 {
				t.Fatalf("more from %d: %s %s", len(all), st, msg)
			}
			all = append(all, more.HostPages...)
		}
		return first, all
	}

	r := dial(t, a1)
	r.hello()
	var o1 wire.OpenReply
	if st, msg := r.do(wire.OpOpen, 0, open, &o1); st != 0 {
		t.Fatalf("open: %s %s", st, msg)
	}
	rep1, all1 := offload(r)
	b.Close()

	a2 := restartFrom(t, store, chunks)
	r2 := dial(t, a2)
	r2.hello()
	var o2 wire.OpenReply
	if st, msg := r2.do(wire.OpOpen, 0, open, &o2); st != 0 || !o2.Resumed || o2.Session != o1.Session {
		t.Fatalf("resume after the restart: %s %s %+v", st, msg, &o2)
	}
	rep2, all2 := offload(r2)
	if !bytes.Equal(rep2, rep1) || !slices.Equal(all2, all1) {
		t.Fatalf("the resent long offload was answered differently after the restart (first packet equal: %v)", bytes.Equal(rep2, rep1))
	}
	var u wire.UsageReply
	if st, msg := r2.do(wire.OpUsage, 0, nil, &u); st != 0 || u.Used != n || u.Streams != 1 {
		t.Fatalf("usage after the resend: %s %s %+v (want %d pages in 1 stream: done once)", st, msg, &u, n)
	}
}

// An open by another instance that would replace the disconnected owner's
// session and is refused (no capacity) changes nothing: the owner resumes
// its session with its stream, and the books agree with the pool. One that
// succeeds replaces it, and the books record that: after a restart the old
// owner does not come back to a session whose chunks a later session
// wrote, and the later session keeps its streams (issue 23, defect 1).
func TestFailedReplacementIsJournaled(t *testing.T) {
	p, chunks, b, store := booksPool(t)
	a1, _ := journaled(t, p, chunks, b, nil)

	first := ownerGone(t, a1, "instance-old", "old")

	// Another process opens for more pages than the allocation holds: it
	// is refused, and the owner's session stays.
	other := dial(t, a1)
	other.hello()
	big := openMsg("tok-a", 0, "instance-new")
	big.MaxPages = 1 << 20
	if st, _ := other.do(wire.OpOpen, 0, big, &wire.OpenReply{}); st != wire.StatusNoCapacity {
		t.Fatalf("open for too many pages: %s", st)
	}
	if err := b.Check(p.Export()); err != nil {
		t.Fatalf("after the failed open: %v", err)
	}
	resumeWithStream(t, a1, "the owner after a refused replacement", "instance-old", first.Session, "old", 2)
	// It opens again, within the allocation, and offloads.
	var later wire.OpenReply
	if st, msg := other.do(wire.OpOpen, 0, openMsg("tok-a", 0, "instance-new"), &later); st != 0 || later.Resumed {
		t.Fatalf("open: %s %s %+v", st, msg, &later)
	}
	if st, msg := other.do(wire.OpOffload, 0, &wire.Offload{Rid: "new", Label: "l", GpuPages: []int32{3}}, &wire.OffloadReply{}); st != 0 {
		t.Fatalf("offload: %s %s", st, msg)
	}
	other.c.Close()
	waitDisconnected(t, a1.srv, later.Session)
	b.Close()

	a2 := restartFrom(t, store, chunks)
	// The later session is the one kept, with its stream.
	resumeWithStream(t, a2, "the later session after the restart", "instance-new", later.Session, "new", 1)
	// The old owner is a replaced instance: it gets a fresh session.
	o := dial(t, a2)
	if res := o.open(0, "instance-old"); res.Resumed || res.Session == first.Session {
		t.Fatalf("the replaced owner came back: %+v", res)
	}
}

// ownerGone opens a session of instance inst on GPU 0 of a, offloads two
// pages as stream (rid, "l"), and disconnects: a session for another
// instance to replace.
func ownerGone(t *testing.T, a *agent, inst, rid string) *wire.OpenReply {
	t.Helper()
	owner := dial(t, a)
	first := owner.open(0, inst)
	if st, msg := owner.do(wire.OpOffload, 0, &wire.Offload{Rid: rid, Label: "l", GpuPages: []int32{1, 2}}, &wire.OffloadReply{}); st != 0 {
		t.Fatalf("offload: %s %s", st, msg)
	}
	owner.c.Close()
	waitDisconnected(t, a.srv, first.Session)
	return first
}

// resumeWithStream resumes session id of instance inst on GPU 0 of a, as
// what says, checks that its stream (rid, "l") holds pages pages, and
// disconnects again.
func resumeWithStream(t *testing.T, a *agent, what, inst string, id uint64, rid string, pages int) {
	t.Helper()
	r := dial(t, a)
	if res := r.open(0, inst); !res.Resumed || res.Session != id {
		t.Fatalf("%s: %+v, want session %d resumed", what, res, id)
	}
	var n wire.NumPagesReply
	if st, msg := r.do(wire.OpNumPages, 0, &wire.Stream{Rid: rid, Label: "l"}, &n); st != 0 || int(n.Pages) != pages {
		t.Fatalf("%s: stream %s: %s %s %d pages, want %d", what, rid, st, msg, n.Pages, pages)
	}
	r.c.Close()
	waitDisconnected(t, a.srv, id)
}

// waitDisconnected waits until the server has seen session id's connection
// close.
func waitDisconnected(t *testing.T, srv *server.Server, id uint64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		busy := false
		for _, in := range srv.Sessions() {
			busy = busy || (in.ID == id && in.Connected)
		}
		if !busy {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("session %d still connected", id)
		}
		time.Sleep(time.Millisecond)
	}
}

// While Options.Durable says a change would not survive a restart (the
// keeper is lost), every changing request is answered "unavailable,
// retry" and changes nothing, while reads, resumes and resent requests
// whose answer is kept are served; once it is durable again the same
// requests succeed.
func TestChangesWaitForDurability(t *testing.T) {
	p, chunks, b, _ := booksPool(t)
	var lost atomic.Bool
	a := &agent{pool: p, chunks: chunks}
	srv, err := server.New(server.Options{Pool: p, Logger: quiet, Journal: b, GPUs: testGPUs,
		Chunks:    func(id string) (*hostmem.Chunk, bool) { c, ok := chunks[id]; return c, ok },
		Authorize: server.StaticTokens(map[string]string{"tok-a": "A"}),
		Durable: func() error {
			if lost.Load() {
				return errors.New("the keeper is lost")
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	a.serve(t, srv)

	r := dial(t, a)
	first := r.open(0, "instance-durable")
	off := &wire.Offload{Rid: "r", Label: "l", GpuPages: []int32{1, 2}}
	rep1 := r.sendSeq(wire.OpOffload, 50, off)
	before := p.Export()
	lost.Store(true)
	wantUnavailable := func(pkt []byte, what string) {
		t.Helper()
		h, body, err := wire.ParseHeader(pkt)
		var e wire.Error
		if err != nil || h.Status != wire.StatusUnavailable || wire.DecodeBody(body, &e) != nil || !strings.Contains(e.Message, "the keeper is lost") {
			t.Fatalf("%s while the keeper is lost: status %s %q %v", what, h.Status, e.Message, err)
		}
	}
	// A resend of the last change is answered as before.
	if again := r.sendSeq(wire.OpOffload, 50, off); !bytes.Equal(again, rep1) {
		t.Fatal("the resent offload was not answered from the kept answer")
	}
	wantUnavailable(r.sendSeq(wire.OpOffload, 51, &wire.Offload{Rid: "r2", Label: "l", GpuPages: []int32{3}}), "offload")
	for _, c := range []struct {
		op  wire.Op
		req proto.Message
	}{
		{wire.OpReload, &wire.Reload{Rid: "r", Label: "l", GpuPages: []int32{5, 6}}},
		{wire.OpDiscard, &wire.Stream{Rid: "r", Label: "l"}},
		{wire.OpRemoveRequest, &wire.Request{Rid: "r"}},
		{wire.OpClose, nil},
	} {
		st, msg := r.do(c.op, 0, c.req, nil)
		if st != wire.StatusUnavailable || !strings.Contains(msg, "retry") {
			t.Fatalf("%s while the keeper is lost: %s %q", c.op, st, msg)
		}
	}
	var n wire.NumPagesReply
	if st, msg := r.do(wire.OpNumPages, 0, &wire.Stream{Rid: "r", Label: "l"}, &n); st != 0 || n.Pages != 2 {
		t.Fatalf("a read while the keeper is lost: %s %s %d", st, msg, n.Pages)
	}
	// A resume is served; a new session is not.
	r.c.Close()
	waitDisconnected(t, srv, first.Session)
	r = dial(t, a)
	if res := r.open(0, "instance-durable"); !res.Resumed {
		t.Fatalf("resume while the keeper is lost: %+v", res)
	}
	other := dial(t, a)
	other.hello()
	if st, _ := other.do(wire.OpOpen, 0, openMsg("tok-a", 1, "instance-other"), &wire.OpenReply{}); st != wire.StatusUnavailable {
		t.Fatalf("a new session while the keeper is lost: %s", st)
	}
	if got := p.Export(); !reflect.DeepEqual(got, before) {
		t.Fatalf("the refused requests changed the pool:\n%+v\n%+v", got, before)
	}
	lost.Store(false)
	if st, msg := r.do(wire.OpReload, 0, &wire.Reload{Rid: "r", Label: "l", GpuPages: []int32{5, 6}}, &wire.ReloadReply{}); st != 0 {
		t.Fatalf("reload once durable again: %s %s", st, msg)
	}
	if err := b.Check(p.Export()); err != nil {
		t.Fatal(err)
	}
}

// An open by another instance that would replace the disconnected owner's
// session and is refused, by the pool or by a limit, changes nothing: no
// replacement is reported, and the owner resumes its session with its
// stream. One that succeeds is reported once.
func TestRefusedReplacementChangesNothing(t *testing.T) {
	var mu sync.Mutex
	replaced := 0
	a := startServerWith(t, func(o *server.Options) {
		o.Limits = server.Limits{MaxDevicePagesTotal: 1000}
		o.EvictAfter = time.Hour
		o.Hooks.Session = func(ev server.SessionEvent, _ server.SessionInfo) {
			if ev == server.SessionReplaced {
				mu.Lock()
				replaced++
				mu.Unlock()
			}
		}
	})
	first := ownerGone(t, a, "instance-owner", "kept")

	tooMany := openMsg("tok-a", 0, "instance-other")
	tooMany.MaxPages = 1 << 20
	tooWide := openMsg("tok-a", 0, "instance-other")
	tooWide.Regions = []*wire.Region{{BytesPerPage: 256, PageCount: 5000}}
	for _, c := range []struct {
		name string
		open *wire.Open
		want wire.Status
	}{
		{"no capacity", tooMany, wire.StatusNoCapacity},
		{"the device-page limit", tooWide, wire.StatusLimit},
	} {
		other := dial(t, a)
		other.hello()
		if st, msg := other.do(wire.OpOpen, 0, c.open, &wire.OpenReply{}); st != c.want {
			t.Fatalf("%s: open got %s %s, want %s", c.name, st, msg, c.want)
		}
		other.c.Close()
		resumeWithStream(t, a, "the owner after a replacement refused for "+c.name, "instance-owner", first.Session, "kept", 2)
	}
	mu.Lock()
	if replaced != 0 {
		t.Fatalf("refused opens reported %d replacements", replaced)
	}
	mu.Unlock()

	other := dial(t, a)
	if res := other.open(0, "instance-other"); res.Resumed || res.Session == first.Session {
		t.Fatalf("the replacement: %+v", res)
	}
	mu.Lock()
	defer mu.Unlock()
	if replaced != 1 {
		t.Fatalf("a replacement reported %d times", replaced)
	}
}
