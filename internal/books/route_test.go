package books

import (
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/wire"
)

// replayInOrder is replay applying every record in order as it reads it:
// the reference a routed replay must equal.
func replayInOrder(mem []byte) (*State, uint64, uint64, error) {
	sideBySide = false
	defer func() { sideBySide = true }()
	return replay(mem)
}

// sameReplay fails unless the routed and the in-order replay of mem agree:
// the same error, or the same state (every chunk, allocation, session,
// stream and pending reload, the server's side of each session, the
// records skipped, the generation and the end).
func sameReplay(t *testing.T, mem []byte) {
	t.Helper()
	a, genA, endA, errA := replay(mem)
	b, genB, endB, errB := replayInOrder(mem)
	if fmt.Sprint(errA) != fmt.Sprint(errB) {
		t.Fatalf("routed replay: %v\nin order: %v", errA, errB)
	}
	if errA != nil {
		return
	}
	if genA != genB || endA != endB || a.Skipped != b.Skipped || a.lastSession != b.lastSession {
		t.Fatalf("routed: gen %d end %d skipped %d last %d; in order: %d %d %d %d",
			genA, endA, a.Skipped, a.lastSession, genB, endB, b.Skipped, b.lastSession)
	}
	if err := a.Check(b.Image()); err != nil {
		t.Fatal(err)
	}
	if sa, sb := serverSide(a), serverSide(b); sa != sb {
		t.Fatalf("the server's side differs:\nrouted   %s\nin order %s", sa, sb)
	}
}

// serverSide prints what the books keep of each session for the server.
func serverSide(st *State) string {
	ids := make([]uint64, 0, len(st.sessions))
	for id := range st.sessions {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	out := ""
	for _, id := range ids {
		s := st.sessions[id]
		out += fmt.Sprintf("%d %s %s %+v %d %+v ticket %d; ", id, s.Instance, s.UUID, s.Peer, s.Regions, s.Last, s.Image.Ticket)
	}
	return out
}

// TestRoutedReplayMatchesInOrder: books of several sessions whose changes
// interleave, with sessions closed, revoked and opened again in between,
// replay by session to the state an in-order replay makes, at every
// length the books had.
func TestRoutedReplayMatchesInOrder(t *testing.T) {
	for seed := range uint64(6) {
		r := newRig(t, 100+seed)
		for i := range 1500 {
			r.step(i)
			switch i {
			case 400:
				r.closeAndReopen()
			case 900:
				r.revokeB()
			}
			if i%100 == 99 {
				mem := snapshotMem(t, r.store.f)
				sameReplay(t, mem)
				st, _, _, err := replay(mem)
				must(t, err)
				must(t, st.Check(r.p.Export()))
			}
		}
		r.b.Close()
	}
}

// TestRoutedReplayFailsWhereInOrderFails: a record of a session's own
// that does not decode fails the replay with its offset, also when a
// later record fails too (the first failure in the books is the one
// told), and when its session is closed after it.
func TestRoutedReplayFailsWhereInOrderFails(t *testing.T) {
	r := newRig(t, 7)
	for i := range 200 {
		r.step(i)
	}
	id := r.ss[0].ID()
	bad := appendSessionOp(nil, &server.SessionOp{Session: id, Op: wire.OpOffload, Rid: "x", Pages: []int32{1}})
	bad = append(bad, 0xff) // a byte after the record
	must(t, r.b.appendPayload(bad))
	for i := range 50 {
		r.step(200 + i)
	}
	mem := snapshotMem(t, r.store.f)
	sameReplay(t, mem)
	if _, _, _, err := replay(mem); err == nil {
		t.Fatal("a record with a byte after it replayed")
	}
	// A later failure (a checksum) does not hide the earlier one.
	end := r.b.Stats().LogBytes
	must(t, r.b.Session(server.SessionOp{Session: id, Op: wire.OpRemoveRequest, Rid: "r1", Seq: 1 << 20}))
	mem = snapshotMem(t, r.store.f)
	mem[end+8] ^= 0xff // the last record's first payload byte
	sameReplay(t, mem)
	// The session closed after its bad record: still a failure.
	must(t, r.b.Session(server.SessionOp{Session: id, Op: wire.OpClose}))
	mem = snapshotMem(t, r.store.f)
	sameReplay(t, mem)
	r.b.Close()
}

// appendPayload appends a record of payload as it is, for tests that
// write records the Books methods would not.
func (b *Books) appendPayload(payload []byte) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf[:0], payload...)
	return b.appendLocked()
}

// snapshotParts writes st as a snapshot and returns its parts as replay
// gathers them (the bytes after type and flags) and the parts flagged as
// beginning a session.
func snapshotParts(t *testing.T, st *State) (parts [][]byte, sessionAt []int) {
	t.Helper()
	w := newSnapWriter(nil, func(p []byte) error {
		if p[1]&partSession != 0 {
			sessionAt = append(sessionAt, len(parts))
		}
		parts = append(parts, slices.Clone(p[2:]))
		return nil
	})
	must(t, writeSnapshot(w, st))
	return parts, sessionAt
}

// A snapshot begins each session in a part of its own, and its sessions
// decode apart, side by side, to what one decoder reading every part in
// order makes; parts flagged elsewhere, or not at all (a writer before
// the flag), read in order as before.
func TestSnapshotSessionsDecodeApart(t *testing.T) {
	old := snapPart
	snapPart = 64 // sessions of many parts
	defer func() { snapPart = old }()
	r := newRig(t, 11)
	for i := range 3000 {
		r.step(i)
	}
	st, err := r.b.stateLocked()
	must(t, err)
	parts, sessionAt := snapshotParts(t, st)
	if len(sessionAt) != st.Sessions() || len(sessionAt) < 3 || len(parts) < 2*len(sessionAt) {
		t.Fatalf("%d parts, %v begin sessions; the state has %d sessions", len(parts), sessionAt, st.Sessions())
	}
	apart := sessionsApart(parts, sessionAt, nil, 2, nil)
	if apart == nil {
		t.Fatal("the sessions did not decode apart")
	}
	inOrder, err := decodeSnapshot(parts, nil, nil, 2, nil)
	must(t, err)
	must(t, apart.Check(inOrder.Image()))
	must(t, apart.Check(r.p.Export()))
	if a, b := serverSide(apart), serverSide(inOrder); a != b {
		t.Fatalf("the server's side differs:\napart    %s\nin order %s", a, b)
	}
	for name, at := range map[string][]int{
		"one part late":   append(slices.Clone(sessionAt[:1]), sessionAt[1]+1, sessionAt[2]),
		"a session short": sessionAt[:len(sessionAt)-1],
		"the head's part": append([]int{0}, sessionAt[1:]...),
	} {
		if sessionsApart(parts, at, nil, 2, nil) != nil {
			t.Fatalf("%s: decoded apart", name)
		}
		got, err := decodeSnapshot(parts, at, nil, 2, nil)
		must(t, err)
		must(t, got.Check(inOrder.Image()))
	}
	r.b.Close()
}

// One session's queue is decoded ahead of being applied, a batch at a time
// on each of decodeLanes goroutines: the state is the in-order one, and a
// record that does not decode, batches into the queue, still ends the
// replay there, whichever lane decodes it and wherever in its batch.
func TestOneSessionDecodedAhead(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(max(2, runtime.GOMAXPROCS(0))))
	for _, streams := range []int{5 * decodeBatch, 4*decodeBatch + 17} {
		_, b, store := atLimits(t, 1, streams, int64(streams)*16, true)
		mem := snapshotMem(t, store.f)
		sameReplay(t, mem)
		st, _, _, err := replay(mem)
		must(t, err)
		if st.Streams() != streams {
			t.Fatalf("%d streams replayed, want %d", st.Streams(), streams)
		}
		var id uint64
		for id = range st.sessions {
		}
		bad := appendSessionOp(nil, &server.SessionOp{Session: id, Op: wire.OpOffload, Rid: "x", Pages: []int32{1}})
		must(t, b.appendPayload(append(bad, 0xff)))
		for i := range 3 * decodeBatch {
			must(t, b.Session(server.SessionOp{Session: id, Op: wire.OpRemoveRequest, Rid: fmt.Sprintf("gone-%d", i)}))
		}
		mem = snapshotMem(t, store.f)
		sameReplay(t, mem)
		if _, _, _, err := replay(mem); err == nil || !strings.Contains(err.Error(), "after the record") {
			t.Fatalf("a record with a byte after it: %v", err)
		}
		b.Close()
	}
}
