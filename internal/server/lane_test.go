package server_test

import (
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/pkg/wire"
)

// openFDs counts the process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// takeLane asks for a lane and moves r's packets to it.
func (r *raw) takeLane() {
	r.t.Helper()
	r.seq++
	pkt, err := wire.AppendPacket(nil, wire.Header{Op: wire.OpLane, Seq: r.seq}, nil)
	if err != nil {
		r.t.Fatal(err)
	}
	r.sendPacket(pkt, nil)
	h, body, files, ok := r.recv()
	if !ok || h.Status != wire.StatusOK || len(body) != 0 || len(files) != 2 {
		r.t.Fatalf("lane: closed %v, status %s, %d body bytes, %d files; want OK, none, 2", !ok, h.Status, len(body), len(files))
	}
	var fds [2]int
	for i, f := range files {
		fd, err := unix.Dup(int(f.Fd()))
		f.Close()
		if err != nil {
			r.t.Fatal(err)
		}
		fds[i] = fd
	}
	if err := r.c.UseLane(fds[0], fds[1]); err != nil {
		r.t.Fatal(err)
	}
}

// A session's packets move to a lane when it asks, once it is open; the
// agent refuses a lane before the open and a second one, and closes its
// ends of the pipes with the connection.
func TestLane(t *testing.T) {
	a := startServer(t)
	before := openFDs(t)

	r := dial(t, a)
	r.hello()
	if st, msg := r.do(wire.OpLane, 0, nil, nil); st != wire.StatusNoSession || !strings.Contains(msg, "before a session") {
		t.Fatalf("lane before open: %s %q, want %s", st, msg, wire.StatusNoSession)
	}
	var rep wire.OpenReply
	if st, msg := r.do(wire.OpOpen, 0, openMsg("tok-a", 0, "lane-instance"), &rep); st != 0 {
		t.Fatalf("open: %s %s", st, msg)
	}
	// A lane's header is a request's: a fence above every ticket is
	// refused, and no lane comes.
	if st, msg := r.do(wire.OpLane, 999, nil, nil); st != wire.StatusBadFence {
		t.Fatalf("lane with a fence past every ticket: %s %q, want %s", st, msg, wire.StatusBadFence)
	}
	// A body where none belongs is refused alike.
	if st, _ := r.do(wire.OpLane, 0, &wire.More{Offset: 1}, nil); st != wire.StatusBadRequest {
		t.Fatalf("lane with a body: %s, want %s", st, wire.StatusBadRequest)
	}
	r.takeLane()
	if u := r.usage(); u.Capacity == 0 || u.Capacity != rep.Capacity {
		t.Fatalf("usage over the lane: capacity %d, the open said %d", u.Capacity, rep.Capacity)
	}
	// Offload and reload over the lane.
	var off wire.OffloadReply
	if st, msg := r.do(wire.OpOffload, 0, &wire.Offload{Rid: "r", Label: "l", GpuPages: []int32{3, 4}, StoredLen: 2}, &off); st != 0 || !off.Ok || len(off.HostPages) != 2 {
		t.Fatalf("offload over the lane: %s %s %+v", st, msg, &off)
	}
	var rel wire.ReloadReply
	if st, msg := r.do(wire.OpReload, 0, &wire.Reload{Rid: "r", Label: "l", GpuPages: []int32{5, 6}}, &rel); st != 0 || len(rel.HostPages) != 2 {
		t.Fatalf("reload over the lane: %s %s %+v", st, msg, &rel)
	}
	u := r.usage()
	if st, msg := r.do(wire.OpLane, 0, nil, nil); st != wire.StatusBadRequest || !strings.Contains(msg, "already") {
		t.Fatalf("a second lane: %s %q, want %s", st, msg, wire.StatusBadRequest)
	}
	// The session goes on after the refusal, as it was.
	if u2 := r.usage(); u2.Used != u.Used || u2.Free != u.Free {
		t.Fatalf("usage after a refused lane: %+v, before it %+v", u2, u)
	}

	// Hanging up closes every end: the agent's, with the connection.
	r.c.Close()
	waitFor(t, func() bool { return openFDs(t) <= before })
}
