package server_test

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/wire"
)

// refusals records Hooks.Refused.
type refusals struct {
	mu sync.Mutex
	n  map[string]int
}

func (r *refusals) hook(reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n == nil {
		r.n = map[string]int{}
	}
	r.n[reason]++
}

func (r *refusals) count(reason string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n[reason]
}

func limitedServer(t *testing.T, lim server.Limits) (*agent, *refusals) {
	t.Helper()
	ref := &refusals{}
	a := startServerWith(t, func(o *server.Options) {
		o.Limits = lim
		o.Hooks.Refused = ref.hook
		o.EvictAfter = time.Hour // the bounds alone: TestIdleConnectionsMakeRoom has eviction
	})
	return a, ref
}

// wantLimit wants status limit with a message mentioning what.
func wantLimit(t *testing.T, st wire.Status, msg, what string) {
	t.Helper()
	if st != wire.StatusLimit || !strings.Contains(msg, what) {
		t.Fatalf("got %s %q, want limit mentioning %q", st, msg, what)
	}
}

// Every bound of Limits refuses with status limit, a message naming it,
// and a counted reason; what is within the bound works, and the refusal
// changes nothing.
func TestLimits(t *testing.T) {
	a, ref := limitedServer(t, server.Limits{
		MaxClientName: 16, MaxDevicePages: 100, MaxSessionsPerAllocation: 1,
		MaxStreamsPerSession: 3, MaxNameBytesPerSession: 20,
	})
	t.Run("client name", func(t *testing.T) {
		r := dial(t, a)
		st, msg := r.do(wire.OpHello, 0, &wire.Hello{Version: wire.Version, Client: strings.Repeat("x", 17)}, &wire.HelloReply{})
		wantLimit(t, st, msg, "client name of 17 bytes, at most 16")
		// Refused, the connection may still say hello properly.
		if st, msg := r.do(wire.OpHello, 0, &wire.Hello{Version: wire.Version, Client: strings.Repeat("x", 16)}, &wire.HelloReply{}); st != 0 {
			t.Fatalf("hello with a 16-byte name: %s %s", st, msg)
		}
		if ref.count(server.RefusedClientName) != 1 {
			t.Fatal("not counted")
		}
	})
	t.Run("device pages", func(t *testing.T) {
		r := dial(t, a)
		r.hello()
		m := openMsg("tok-a", 0, "instance-dev")
		m.Regions[0].PageCount, m.Regions[1].PageCount = 101, 200
		st, msg := r.do(wire.OpOpen, 0, m, &wire.OpenReply{})
		wantLimit(t, st, msg, "101 device pages, at most 100")
		if len(a.srv.Sessions()) != 0 {
			t.Fatal("a refused open left a session")
		}
	})
	t.Run("sessions per allocation, streams, names", func(t *testing.T) {
		r := dial(t, a)
		r.open(0, "instance-one")
		r2 := dial(t, a)
		r2.hello()
		st, msg := r2.do(wire.OpOpen, 0, openMsg("tok-a", 1, "instance-two"), &wire.OpenReply{})
		wantLimit(t, st, msg, "maxSessionsPerAllocation")
		var off wire.OffloadReply
		for i := range 3 {
			if st, msg := r.do(wire.OpOffload, 0, &wire.Offload{Rid: "r", Label: string(rune('a' + i)), GpuPages: []int32{int32(i)}}, &off); st != 0 {
				t.Fatalf("offload %d: %s %s", i, st, msg)
			}
		}
		st, msg = r.do(wire.OpOffload, 0, &wire.Offload{Rid: "r", Label: "d"}, &off)
		wantLimit(t, st, msg, "maxStreamsPerSession")
		if u := r.usage(); u.Streams != 3 || u.Used != 3 {
			t.Fatalf("a refused offload changed the session: %+v", u)
		}
		if st, _ := r.do(wire.OpDiscard, 0, &wire.Stream{Rid: "r", Label: "c"}, nil); st != 0 {
			t.Fatal(st)
		}
		// 2 streams of 2 name bytes; 17 more bytes would make 21 > 20.
		st, msg = r.do(wire.OpOffload, 0, &wire.Offload{Rid: strings.Repeat("q", 16), Label: "z"}, &off)
		wantLimit(t, st, msg, "maxNameBytesPerSession")
		if st, msg := r.do(wire.OpOffload, 0, &wire.Offload{Rid: strings.Repeat("q", 15), Label: "z"}, &off); st != 0 {
			t.Fatalf("offload at the name bound: %s %s", st, msg)
		}
		for _, reason := range []string{server.RefusedAllocSessions, server.RefusedStreams, server.RefusedNameBytes} {
			if ref.count(reason) != 1 {
				t.Errorf("%s counted %d times, want 1", reason, ref.count(reason))
			}
		}
	})
}

// A connection that does not say hello, or does not open a session, in
// time is closed; one that opened a session is never timed out.
func TestConnDeadlines(t *testing.T) {
	a, ref := limitedServer(t, server.Limits{HelloTimeout: 100 * time.Millisecond, OpenTimeout: 300 * time.Millisecond})
	silent := dial(t, a)
	greeted := dial(t, a)
	greeted.hello()
	opened := dial(t, a)
	opened.open(0, "instance-deadline")
	for _, r := range []*raw{silent, greeted} {
		if _, _, _, ok := r.recv(); ok {
			t.Fatal("a packet instead of the close")
		}
	}
	if ref.count(server.RefusedHelloTimeout) != 1 || ref.count(server.RefusedOpenTimeout) != 1 {
		t.Fatalf("refusals %v", ref.n)
	}
	time.Sleep(400 * time.Millisecond)
	opened.usage()
}

// One process's connections are bounded; a refused connection learns why
// (status limit to its first request) and is closed.
func TestConnsPerPID(t *testing.T) {
	a, ref := limitedServer(t, server.Limits{MaxConnsPerPID: 2})
	r1, r2 := dial(t, a), dial(t, a)
	r1.hello()
	r2.hello()
	r3 := dial(t, a)
	st, msg := r3.do(wire.OpHello, 0, &wire.Hello{Version: wire.Version}, &wire.HelloReply{})
	wantLimit(t, st, msg, "connections, the limit")
	if _, _, _, ok := r3.recv(); ok {
		t.Fatal("refused connection left open")
	}
	if ref.count(server.RefusedConnsPerPID) != 1 {
		t.Fatalf("refusals %v", ref.n)
	}
	r1.c.Close()
	waitFor(t, func() bool {
		r := dial(t, a)
		r.seq++
		pkt, _ := wire.AppendPacket(nil, wire.Header{Op: wire.OpHello, Seq: r.seq}, &wire.Hello{Version: wire.Version})
		r.sendPacket(pkt, nil)
		h, _, _, ok := r.recv()
		r.c.Close()
		return ok && h.Status == wire.StatusOK
	})
}

// Sessions of a revoked allocation leave the table at the next sweep,
// reported as revoked, and their connections are closed.
func TestRevokedSessionsSwept(t *testing.T) {
	var mu sync.Mutex
	var revoked []server.SessionInfo
	a := startServerWith(t, func(o *server.Options) {
		o.SweepInterval = 10 * time.Millisecond
		o.Hooks.Session = func(ev server.SessionEvent, info server.SessionInfo) {
			if ev == server.SessionRevoked {
				mu.Lock()
				revoked = append(revoked, info)
				mu.Unlock()
			}
		}
	})
	r0, r1 := dial(t, a), dial(t, a)
	r0.open(0, "instance-sweep-0")
	r1.open(1, "instance-sweep-1")
	if _, err := a.pool.Revoke("A"); err != nil {
		t.Fatal(err)
	}
	for _, r := range []*raw{r0, r1} {
		if _, _, _, ok := r.recv(); ok {
			t.Fatal("a packet instead of the close")
		}
	}
	waitFor(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(revoked) == 2 })
	for _, info := range revoked {
		if info.Allocation != "A" || len(info.Instance) != 8 || strings.Contains(info.Instance, "instance") {
			t.Fatalf("revoked session info %+v: want allocation A and an 8-digit instance hash", info)
		}
	}
}

// A limit that refuses a long offload drops its staged device pages too:
// the next offload records its own pages alone (issue 23: a refused long
// offload used to leave its pages packets staged, and a 3-page offload
// then asked for 24,579 pages).
func TestRefusedLongOffloadDropsItsPages(t *testing.T) {
	a, ref := limitedServer(t, server.Limits{MaxNameBytesPerSession: 8})
	r := dial(t, a)
	r.hello()
	m := openMsg("tok-a", 0, "instance-long-limit")
	m.Regions = []*wire.Region{{BytesPerPage: 256, PageCount: 30000}}
	if st, msg := r.do(wire.OpOpen, 0, m, &wire.OpenReply{}); st != 0 {
		t.Fatalf("open: %s %s", st, msg)
	}
	head := make([]int32, wire.MaxPagesPerPacket)
	for i := range head {
		head[i] = int32(i)
	}
	if st, msg := r.do(wire.OpPages, 0, &wire.Pages{GpuPages: head}, nil); st != 0 {
		t.Fatalf("pages: %s %s", st, msg)
	}
	st, msg := r.do(wire.OpOffload, 0, &wire.Offload{Rid: "a-long-request-id", Label: "kv", GpuPages: []int32{29000, 29001}}, &wire.OffloadReply{})
	wantLimit(t, st, msg, "limits.maxNameBytesPerSession")
	if ref.count(server.RefusedNameBytes) != 1 {
		t.Fatal("not counted")
	}
	var rep wire.OffloadReply
	if st, msg := r.do(wire.OpOffload, 0, &wire.Offload{Rid: "r", Label: "kv", GpuPages: []int32{7, 8, 9}}, &rep); st != 0 || !rep.Ok || len(rep.HostPages) != 3 || rep.Total != 0 {
		t.Fatalf("a 3-page offload after the refused long one: %s %s ok %v, %d host pages, total %d", st, msg, rep.Ok, len(rep.HostPages), rep.Total)
	}
	if u := r.usage(); u.Used != 3 || u.Streams != 1 {
		t.Fatalf("usage %+v, want 3 pages in 1 stream", u)
	}
}

// A packet naming more device pages than the protocol allows one packet
// (wire.MaxPagesPerPacket) is refused, whatever its op, and changes
// nothing: longer lists travel as pages packets.
func TestPacketPageBound(t *testing.T) {
	a, _ := limitedServer(t, server.Limits{})
	r := dial(t, a)
	r.hello()
	m := openMsg("tok-a", 0, "instance-packet-bound")
	m.Regions = []*wire.Region{{BytesPerPage: 256, PageCount: 30000}}
	if st, msg := r.do(wire.OpOpen, 0, m, &wire.OpenReply{}); st != 0 {
		t.Fatalf("open: %s %s", st, msg)
	}
	over := make([]int32, wire.MaxPagesPerPacket+1)
	for i := range over {
		over[i] = int32(i)
	}
	for _, c := range []struct {
		op  wire.Op
		req proto.Message
	}{
		{wire.OpPages, &wire.Pages{GpuPages: over}},
		{wire.OpOffload, &wire.Offload{Rid: "r", GpuPages: over}},
		{wire.OpReload, &wire.Reload{Rid: "r", GpuPages: over}},
	} {
		st, msg := r.do(c.op, 0, c.req, nil)
		if st != wire.StatusBadRequest || !strings.Contains(msg, "24577 device pages in one packet, at most 24576") {
			t.Fatalf("%s of %d pages: %s %q", c.op, len(over), st, msg)
		}
	}
	if u := r.usage(); u.Used != 0 || u.Streams != 0 {
		t.Fatalf("usage %+v after refused packets", u)
	}
	// Nothing was staged: a short offload records its own pages alone.
	var rep wire.OffloadReply
	if st, msg := r.do(wire.OpOffload, 0, &wire.Offload{Rid: "r", GpuPages: []int32{1, 2}}, &rep); st != 0 || len(rep.HostPages) != 2 {
		t.Fatalf("offload: %s %s %+v", st, msg, &rep)
	}
}

// limits.maxStreams and limits.maxNameBytes bound every session's stream
// table together: sessions each within their own bounds cannot, together,
// grow the agent's heap, books and restart time past them (issue 23: about
// 80 sessions at the name-bytes bound made a snapshot the books could not
// read back, 7.9 GB of heap and a 40 s restore). A refusal changes nothing,
// and room freed in one session is room for another.
func TestLimitsAcrossSessions(t *testing.T) {
	a, ref := limitedServer(t, server.Limits{MaxStreamsPerSession: 4, MaxStreams: 5, MaxNameBytesPerSession: 4096, MaxNameBytes: 1500})
	r0, r1 := dial(t, a), dial(t, a)
	r0.open(0, "instance-gpu0")
	r1.open(1, "instance-gpu1")
	offload := func(r *raw, rid string, page int32) (wire.Status, string) {
		var rep wire.OffloadReply
		return r.do(wire.OpOffload, 0, &wire.Offload{Rid: rid, Label: "kv", GpuPages: []int32{page}}, &rep)
	}
	for i := range 4 {
		if st, msg := offload(r0, fmt.Sprint("r", i), int32(i)); st != 0 {
			t.Fatalf("offload %d: %s %s", i, st, msg)
		}
	}
	if st, msg := offload(r1, "other", 0); st != 0 {
		t.Fatalf("the fifth stream, in the other session: %s %s", st, msg)
	}
	st, msg := offload(r1, "sixth", 1)
	wantLimit(t, st, msg, "limits.maxStreams")
	if ref.count(server.RefusedStreamsTotal) != 1 || r1.usage().Streams != 1 {
		t.Fatal("not counted, or the refusal changed the session")
	}
	if st, msg := r0.do(wire.OpDiscard, 0, &wire.Stream{Rid: "r0", Label: "kv"}, nil); st != 0 {
		t.Fatalf("discard: %s %s", st, msg)
	}
	if st, msg := offload(r1, "sixth", 1); st != 0 {
		t.Fatalf("after a stream of the other session went: %s %s", st, msg)
	}
	// Names: the other session's long request ID would pass its own
	// bound but not the agent's.
	for _, rid := range []string{"r1", "r2"} {
		if st, msg := r0.do(wire.OpDiscard, 0, &wire.Stream{Rid: rid, Label: "kv"}, nil); st != 0 {
			t.Fatalf("discard: %s %s", st, msg)
		}
	}
	st, msg = offload(r0, strings.Repeat("n", 1000), 7)
	if st != 0 {
		t.Fatalf("a long name within both bounds: %s %s", st, msg)
	}
	st, msg = offload(r1, strings.Repeat("m", 1000), 9)
	wantLimit(t, st, msg, "limits.maxNameBytes")
	if ref.count(server.RefusedNameBytesTotal) != 1 {
		t.Fatal("not counted")
	}
	if ts, tn := a.pool.StreamTotals(); ts != 4 || tn != 4+7+7+1002 { // r3, other, sixth and the long one
		t.Fatalf("totals %d streams, %d name bytes", ts, tn)
	}
}

// Connections without a session cannot keep out a client that opens one:
// at a connection bound the oldest of them (at least EvictAfter old) is
// closed to make room, however many a process re-dials; connections with
// sessions are never closed for that, and once every place holds one the
// new connection is refused and Refusing says so (issue 23: processes
// re-dialing idle connections kept new clients of their uid out at its
// cap, and health stayed 200).
func TestIdleConnectionsMakeRoom(t *testing.T) {
	ref := &refusals{}
	a := startServerWith(t, func(o *server.Options) {
		o.Limits = server.Limits{MaxConns: 4, MaxConnsPerUID: 4, MaxConnsPerPID: 4}
		o.Hooks.Refused = ref.hook
		o.EvictAfter = 300 * time.Millisecond
	})
	// Two allocations of a chunk per GPU each: four sessions.
	chunks, err := a.pool.Revoke("A")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range chunks {
		if err := a.pool.Scrubbed(c.ID); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.pool.Grant("A", []string{"gpu0-numaX-0", "gpu1-numaX-0"}); err != nil {
		t.Fatal(err)
	}
	if err := a.pool.Grant("B", []string{"gpu0-numaX-1", "gpu1-numaX-1"}); err != nil {
		t.Fatal(err)
	}
	var idle []*raw
	for range 4 {
		r := dial(t, a)
		r.hello()
		idle = append(idle, r)
	}
	if _, ok := a.srv.Refusing(time.Minute); ok {
		t.Fatal("refusing before any refusal")
	}
	time.Sleep(400 * time.Millisecond)
	// Each new client opens its session: the oldest idle one makes room.
	for i := range 2 {
		r := dial(t, a)
		r.open(uint32(i), fmt.Sprint("instance-room-", i))
		if _, _, _, ok := idle[i].recv(); ok {
			t.Fatalf("idle connection %d still open", i)
		}
	}
	if n := ref.count(server.RefusedEvicted); n != 2 {
		t.Fatalf("%d evictions counted, want 2", n)
	}
	// A connection newer than EvictAfter is safe: a third client finds
	// the two left too young only until they age.
	young := dial(t, a)
	young.hello()
	r := dial(t, a) // within EvictAfter of young's dial, but idle[2] is old
	r.hello()
	if _, _, _, ok := idle[2].recv(); ok {
		t.Fatal("the old idle connection stayed while a new one waited")
	}
	// Now four places: two sessions, young and r, none evictable yet: a
	// refusal, but of churn (the agent is not refusing clients).
	full := dial(t, a)
	st, msg := full.do(wire.OpHello, 0, &wire.Hello{Version: wire.Version}, &wire.HelloReply{})
	wantLimit(t, st, msg, "none could make room")
	if why, ok := a.srv.Refusing(time.Minute); ok {
		t.Fatalf("Refusing with places held by connections without sessions: %q", why)
	}
	// Every place holds a session: now the agent refuses clients.
	for i, c := range []*raw{young, r} {
		if st, msg := c.do(wire.OpOpen, 0, openMsg("tok-b", uint32(i), fmt.Sprint("instance-b-", i)), &wire.OpenReply{}); st != 0 {
			t.Fatalf("open: %s %s", st, msg)
		}
	}
	full = dial(t, a)
	st, msg = full.do(wire.OpHello, 0, &wire.Hello{Version: wire.Version}, &wire.HelloReply{})
	wantLimit(t, st, msg, "none could make room")
	why, ok := a.srv.Refusing(time.Minute)
	if !ok || !strings.Contains(why, "at most 4 connections") {
		t.Fatalf("Refusing: %q %v", why, ok)
	}
	if _, ok := a.srv.Refusing(0); ok {
		t.Fatal("a refusal older than the window still reported")
	}
}

// TestOpenPastPageBound: an open whose host pages would take the open
// sessions' past the pool's bound (limits.maxPages) is refused with status
// limit, a message naming the bound and how many pages still fit, and a
// counted reason, and leaves no session; within the bound it opens, and a
// close makes room again.
func TestOpenPastPageBound(t *testing.T) {
	a, ref := limitedServer(t, server.Limits{})
	a.pool.SetMaxPages(100)
	// The layout's host pages are 4 KiB: 64 in each 256 KiB chunk, and
	// a session's fair share of the allocation is two chunks.
	r := dial(t, a)
	r.hello()
	st, msg := r.do(wire.OpOpen, 0, openMsg("tok-a", 0, "instance-big"), &wire.OpenReply{})
	wantLimit(t, st, msg, "128 pages of 4096 bytes would bring the open sessions' host pages to 128, over the agent's bound of 100")
	wantLimit(t, st, msg, "100 more fit")
	wantLimit(t, st, msg, "(limits.maxPages)")
	if len(a.srv.Sessions()) != 0 || ref.count(server.RefusedPages) != 1 {
		t.Fatalf("the refused open left %d sessions, counted %d times", len(a.srv.Sessions()), ref.count(server.RefusedPages))
	}
	m := openMsg("tok-a", 0, "instance-big")
	m.MaxPages = 100
	var rep wire.OpenReply
	if st, msg := r.do(wire.OpOpen, 0, m, &rep); st != 0 || rep.Capacity != 100 {
		t.Fatalf("an open of as many pages as the bound: %s %s, capacity %d", st, msg, rep.Capacity)
	}
	r2 := dial(t, a)
	r2.hello()
	m2 := openMsg("tok-a", 1, "instance-small")
	m2.MaxPages = 1
	st, msg = r2.do(wire.OpOpen, 0, m2, &wire.OpenReply{})
	wantLimit(t, st, msg, "0 more fit")
	if st, msg := r.do(wire.OpClose, 0, nil, nil); st != 0 {
		t.Fatalf("close: %s %s", st, msg)
	}
	if st, msg := r2.do(wire.OpOpen, 0, m2, &wire.OpenReply{}); st != 0 {
		t.Fatalf("an open after a close made room: %s %s", st, msg)
	}
	if ref.count(server.RefusedPages) != 2 {
		t.Fatalf("refusals counted %d times, want 2", ref.count(server.RefusedPages))
	}
}

// TestDevicePagesAcrossSessions: the device pages of every session's
// layout together (a bit each in the agent's heap) stay within
// limits.maxDevicePagesTotal: an open past it is refused with status limit,
// counted, and leaves no session; a close makes room.
func TestDevicePagesAcrossSessions(t *testing.T) {
	a, ref := limitedServer(t, server.Limits{MaxDevicePages: 50, MaxDevicePagesTotal: 60})
	r0 := dial(t, a)
	r0.open(0, "instance-gpu0") // 32 device pages (openMsg's smallest region)
	r1 := dial(t, a)
	r1.hello()
	st, msg := r1.do(wire.OpOpen, 0, openMsg("tok-a", 1, "instance-gpu1"), &wire.OpenReply{})
	wantLimit(t, st, msg, "a layout of 32 device pages would bring the sessions' to 64, more than the agent's 60 (limits.maxDevicePagesTotal); 28 more fit")
	if len(a.srv.Sessions()) != 1 || ref.count(server.RefusedDevicePagesTotal) != 1 {
		t.Fatalf("%d sessions, the refusal counted %d times; want 1 and 1", len(a.srv.Sessions()), ref.count(server.RefusedDevicePagesTotal))
	}
	if st, msg := r0.do(wire.OpClose, 0, nil, nil); st != 0 {
		t.Fatalf("close: %s %s", st, msg)
	}
	if st, msg := r1.do(wire.OpOpen, 0, openMsg("tok-a", 1, "instance-gpu1"), &wire.OpenReply{}); st != 0 {
		t.Fatalf("an open after a close made room: %s %s", st, msg)
	}
}
