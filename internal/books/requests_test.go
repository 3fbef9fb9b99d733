package books

import (
	"fmt"
	"hash/maphash"
	"math/rand/v2"
	"slices"
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
