package books

import (
	"fmt"
	"hash/maphash"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/wire"
)

// reqModel is what requests must hold: the requests in first-offload
// order, each with its labels in order.
type reqModel struct {
	rids     []string
	labels   map[string][]string
	universe int // the request IDs are r0 ... r<universe-1>
}

func (m *reqModel) add(rid, label string) {
	if len(m.labels[rid]) == 0 {
		m.rids = append(m.rids, rid)
	}
	m.labels[rid] = append(m.labels[rid], label)
}

func (m *reqModel) remove(rid string) {
	if i := slices.Index(m.rids, rid); i >= 0 {
		m.rids = slices.Delete(m.rids, i, i+1)
	}
	delete(m.labels, rid)
}

func (m *reqModel) same(t *testing.T, r *requests, step string) {
	t.Helper()
	var got, want []string
	for rid, list := range r.all() {
		for _, x := range list {
			got = append(got, rid+"/"+x.Label)
		}
	}
	for _, rid := range m.rids {
		for _, l := range m.labels[rid] {
			want = append(want, rid+"/"+l)
		}
	}
	if !slices.Equal(got, want) || r.len() != len(m.rids) {
		t.Fatalf("%s: requests hold %d: %v\nwant %d: %v", step, r.len(), got, len(m.rids), want)
	}
	for _, rid := range m.rids {
		if n := len(r.get(rid)); n != len(m.labels[rid]) {
			t.Fatalf("%s: get(%s) has %d streams, want %d", step, rid, n, len(m.labels[rid]))
		}
	}
	// And a request not held is not found (nor another's streams for it).
	for i := range m.universe {
		if rid := fmt.Sprintf("r%d", i); len(m.labels[rid]) == 0 && r.get(rid) != nil {
			t.Fatalf("%s: get(%s) has %d streams, want none", step, rid, len(r.get(rid)))
		}
	}
}

// The request table keeps requests in the order they were first offloaded
// since they were last removed, through removals that leave holes, the
// compaction that closes them, growing and replacing a request's streams.
func TestRequestsKeepFirstOffloadOrder(t *testing.T) {
	for seed := range uint64(4) {
		rng := rand.New(rand.NewPCG(seed, 7))
		r := newRequests(int(seed))
		m := &reqModel{labels: map[string][]string{}, universe: 300}
		for i := range 3000 {
			rid := fmt.Sprintf("r%d", rng.IntN(300))
			step := fmt.Sprintf("seed %d step %d", seed, i)
			switch k := rng.IntN(10); {
			case k < 5:
				l := fmt.Sprint(i)
				list := r.open(rid)
				*list = append(*list, stream{Label: l})
				m.add(rid, l)
			case k < 7: // a reload or discard of the first stream
				if list := r.get(rid); len(list) > 0 {
					r.set(rid, slices.Delete(slices.Clone(list), 0, 1))
					if m.labels[rid] = m.labels[rid][1:]; len(m.labels[rid]) == 0 {
						m.remove(rid)
					}
				} else {
					r.set(rid, nil) // not held: nothing changes
				}
			case k < 9:
				r.remove(rid)
				m.remove(rid)
			default:
				r.reserve(rng.IntN(500))
			}
			m.same(t, &r, step)
			if r.holes > 64 && r.holes*2 > len(r.list) {
				t.Fatalf("%s: %d holes in a list of %d", step, r.holes, len(r.list))
			}
		}
	}
}

// A replay lists each session's requests in the order they were first
// offloaded, from the records and from a snapshot alike (a request
// removed and offloaded again goes last, one that lost a stream keeps its
// place), and makes the session's request table once for the snapshot's
// requests and the offloads after it.
func TestReplayKeepsRequestOrder(t *testing.T) {
	p, b, store := grantedBooks(t, "c", 64<<20)
	s, err := p.Open("a", pool.Spec{PageSize: 4096, DevicePages: 64})
	must(t, err)
	info := &server.OpenInfo{Allocation: "a", Instance: "i", Regions: 1,
		Image: pool.SessionImage{ID: s.ID(), Allocation: "a", Spec: s.Spec(), Chunks: []string{"c"}, PPC: s.PagesPerChunk(), Capacity: s.Capacity()}}
	must(t, b.Session(server.SessionOp{Session: s.ID(), Op: wire.OpOpen, Open: info}))
	seq := uint32(0)
	journal := func(op server.SessionOp) {
		seq++
		op.Session, op.Seq, op.Reply = s.ID(), seq, []byte{8, 1}
		must(t, b.Session(op))
	}
	var order []string
	offload := func(rid, label string) {
		pages, err := s.Offload(rid, label, []int32{1}, pool.Meta{}, nil)
		must(t, err)
		journal(server.SessionOp{Op: wire.OpOffload, Rid: rid, Label: label, Pages: pages})
		if !slices.Contains(order, rid) {
			order = append(order, rid)
		}
	}
	remove := func(rid string) {
		_, err := s.RemoveRequest(rid)
		must(t, err)
		journal(server.SessionOp{Op: wire.OpRemoveRequest, Rid: rid})
		order = slices.DeleteFunc(order, func(r string) bool { return r == rid })
	}
	check := func(step string, fromSnapshot bool) {
		t.Helper()
		st, _, err := Load(store.f)
		must(t, err)
		if inSnapshot := st.snapEnd > headerSize+1024; inSnapshot != fromSnapshot {
			t.Fatalf("%s: the snapshot ends at %d", step, st.snapEnd)
		}
		rs := st.sessions[s.ID()].reqs
		if rs.sized < rs.len() || rs.remade > 0 {
			t.Fatalf("%s: the request table was made for %d requests (made again %d times) and holds %d", step, rs.sized, rs.remade, rs.len())
		}
		var got []string
		for _, q := range st.Image().Sessions[0].Requests {
			if len(q.Streams) > 0 {
				got = append(got, q.Rid)
			}
		}
		if !slices.Equal(got, order) {
			t.Fatalf("%s: the image lists %d requests, %q...; want %d, %q...", step, len(got), got[:min(5, len(got))], len(order), order[:min(5, len(order))])
		}
		must(t, st.Check(p.Export()))
	}
	for i := range 3000 {
		offload(fmt.Sprintf("req-%d", i), "k")
		if i%3 == 0 {
			offload(fmt.Sprintf("req-%d", i), "v")
		}
	}
	remove("req-10")
	must(t, s.Discard("req-12", "k"))
	journal(server.SessionOp{Op: wire.OpDiscard, Rid: "req-12", Label: "k"})
	offload("req-10", "again")
	check("records", false)

	b.mu.Lock()
	st, err := b.stateLocked()
	must(t, err)
	must(t, b.compactLocked(st, 0))
	b.mu.Unlock()
	check("snapshot", true)

	// Fewer offloads after the snapshot than requests in it.
	for i := range 1000 {
		offload(fmt.Sprintf("late-%d", i), "k")
	}
	remove("req-20")
	offload("req-20", "back")
	check("snapshot and records", true)
	b.Close()
}

// TestRequestIndexWrapsAround: removing from the request index moves back
// the entries after the gap that probed past it, across the end of the
// table too. Request IDs are picked (for this process's hash seed) so that
// three want the last slot of an 8-slot index and one the first.
func TestRequestIndexWrapsAround(t *testing.T) {
	r := newRequests(3)
	if len(r.slots) != 8 {
		t.Fatalf("an index for 3 requests has %d slots, want 8", len(r.slots))
	}
	var last, first []string
	for i := 0; len(last) < 3 || len(first) < 1; i++ {
		rid := fmt.Sprintf("w%d", i)
		switch maphash.String(ridSeed, rid) & 7 {
		case 7:
			last = append(last, rid)
		case 0:
			first = append(first, rid)
		}
	}
	rids := append(last[:3:3], first[0]) // slots 7, 0, 1, and 2 (its own, 0, taken)
	for _, order := range [][]int{{0, 1, 2, 3}, {1, 0, 3, 2}, {2, 3, 1, 0}, {3, 2, 1, 0}} {
		r := newRequests(3)
		for _, rid := range rids {
			l := r.open(rid)
			*l = append(*l, stream{Label: "l"})
		}
		if len(r.slots) != 8 {
			t.Fatalf("the index grew to %d slots", len(r.slots))
		}
		held := slices.Clone(rids)
		for _, k := range order {
			r.remove(rids[k])
			held = slices.DeleteFunc(held, func(x string) bool { return x == rids[k] })
			for _, rid := range rids {
				if got, want := len(r.get(rid)), btoi(slices.Contains(held, rid)); got != want {
					t.Fatalf("removing %v in the order %v: after %s, get(%s) has %d streams, want %d", rids, order, rids[k], rid, got, want)
				}
			}
		}
		if slices.ContainsFunc(r.slots, func(e uint64) bool { return e != 0 }) {
			t.Fatalf("the index holds entries after every request was removed: %x", r.slots)
		}
	}
}

// largeRequestRig is a pool session with its books, and ops that go to
// both: offload, reload (fenced at once) and discard of (rid, label),
// remove_request of rid.
type largeRequestRig struct {
	t     testing.TB
	p     *pool.Pool
	b     *Books
	store *memStore
	s     *pool.Session
	seq   uint32
}

func newLargeRequestRig(t testing.TB) *largeRequestRig {
	p, b, store := grantedBooks(t, "c", 64<<20)
	s, err := p.Open("a", pool.Spec{PageSize: 64, DevicePages: 64})
	must(t, err)
	r := &largeRequestRig{t: t, p: p, b: b, store: store, s: s}
	info := &server.OpenInfo{Allocation: "a", Instance: "i", Regions: 1,
		Image: pool.SessionImage{ID: s.ID(), Allocation: "a", Spec: s.Spec(), Chunks: []string{"c"}, PPC: s.PagesPerChunk(), Capacity: s.Capacity()}}
	r.journal(server.SessionOp{Op: wire.OpOpen, Open: info})
	return r
}

func (r *largeRequestRig) journal(op server.SessionOp) {
	r.seq++
	op.Session, op.Seq, op.Reply = r.s.ID(), r.seq, []byte{8, 1}
	must(r.t, r.b.Session(op))
}

func (r *largeRequestRig) offload(rid, label string) {
	m := pool.Meta{StoredLen: int64(r.seq)}
	pages, err := r.s.Offload(rid, label, []int32{int32(r.seq % 64)}, m, nil)
	must(r.t, err)
	r.journal(server.SessionOp{Op: wire.OpOffload, Rid: rid, Label: label, Pages: pages, Meta: m})
}

func (r *largeRequestRig) drop(rid, label string, reload bool) {
	if !reload {
		must(r.t, r.s.Discard(rid, label))
		r.journal(server.SessionOp{Op: wire.OpDiscard, Rid: rid, Label: label})
		return
	}
	rl, err := r.s.Reload(rid, label, []int32{1}, nil)
	must(r.t, err)
	r.journal(server.SessionOp{Op: wire.OpReload, Rid: rid, Label: label, Pages: rl.Pages, Ticket: rl.Ticket})
	must(r.t, r.s.Fence(rl.Ticket))
	r.journal(server.SessionOp{Fence: rl.Ticket})
}

// TestReplayLargeRequests: requests of thousands of streams, streams
// dropped (reloaded or discarded) from anywhere in them, some offloaded
// again, others added, a request shrunk to a few streams and grown again,
// another removed, replay to what the pool holds, in the order offloaded,
// from the records and from a snapshot with records after it.
func TestReplayLargeRequests(t *testing.T) {
	r := newLargeRequestRig(t)
	rng := rand.New(rand.NewPCG(3, 5))
	held := map[string][]string{}
	for _, rid := range []string{"wide", "shrinks", "removed"} {
		for i := range 3000 {
			label := fmt.Sprintf("layer.%d", i)
			r.offload(rid, label)
			held[rid] = append(held[rid], label)
		}
	}
	drop := func(rid string, k int) {
		for range k {
			i := rng.IntN(len(held[rid]))
			r.drop(rid, held[rid][i], rng.IntN(2) == 0)
			held[rid] = slices.Delete(held[rid], i, i+1)
		}
	}
	check := func(step string) {
		t.Helper()
		r.b.settle()
		st, _, err := Load(r.store.f)
		must(t, err)
		// A restart reads the state for the pool's image and for the fresh
		// books' snapshot side by side (agent.restore): with -race, a
		// replay that left holes for them to close up fails here.
		var wg sync.WaitGroup
		wg.Go(func() { _ = st.Image() })
		wg.Go(func() {
			var buf enc
			lf, _, err := writeCompaction(st, 99, 0, 0, &buf, origin{})
			must(t, err)
			lf.close()
		})
		wg.Wait()
		must(t, st.Check(r.p.Export()))
		for _, q := range st.Image().Sessions[0].Requests {
			var labels []string
			for _, x := range q.Streams {
				labels = append(labels, x.Label)
			}
			if len(q.Streams) > 0 && !slices.Equal(labels, r.s.Labels(q.Rid)) {
				t.Fatalf("%s: %q replays with %d labels, the pool holds %d, or in another order", step, q.Rid, len(labels), len(r.s.Labels(q.Rid)))
			}
		}
	}
	drop("wide", 1800)
	for i := range 200 { // offloaded again, after the holes
		label := fmt.Sprintf("layer.%d", i)
		if !slices.Contains(held["wide"], label) {
			r.offload("wide", label)
			held["wide"] = append(held["wide"], label)
		}
	}
	drop("shrinks", 2995)
	check("records")

	r.b.mu.Lock()
	st, err := r.b.stateLocked()
	must(t, err)
	must(t, r.b.compactLocked(st, 0))
	r.b.mu.Unlock()
	check("snapshot")

	drop("wide", 500)
	for i := range 20 { // grown past indexFrom again
		label := fmt.Sprintf("again.%d", i)
		r.offload("shrinks", label)
		held["shrinks"] = append(held["shrinks"], label)
	}
	drop("shrinks", 7)
	_, err = r.s.RemoveRequest("removed")
	must(t, err)
	r.journal(server.SessionOp{Op: wire.OpRemoveRequest, Rid: "removed"})
	check("snapshot and records")
	r.b.Close()
}

// BenchmarkReplayLargeRequest replays books holding one request of 16,000
// streams, offloaded in turn and then half of them discarded, the first
// first: what a request of many streams costs a restart (and each
// compaction). The replay walked the request's streams for each record,
// and moved its tail down for each discard.
//
//	go test -run XXX -bench ReplayLargeRequest ./internal/books/
func BenchmarkReplayLargeRequest(b *testing.B) {
	r := newLargeRequestRig(b)
	const n = 16000
	for i := range n {
		r.offload("r", fmt.Sprintf("layer.%d", i))
	}
	for i := range n / 2 {
		r.drop("r", fmt.Sprintf("layer.%d", i), false)
	}
	r.b.settle()
	for b.Loop() {
		if _, _, err := Load(r.store.f); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*(n+n/2)), "ns/record")
	r.b.Close()
}
