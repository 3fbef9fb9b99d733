package pool

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/kvpool/kvpool/pkg/poolerr"
)

type eventLog []Event

func (l *eventLog) Record(ev Event) { *l = append(*l, ev) }

// busyPool builds a pool with two allocations, three sessions and a random
// history of offloads, reloads, fences, discards and removals.
func busyPool(t *testing.T, seed uint64) *Pool {
	t.Helper()
	p := New()
	for i := range 6 {
		if err := p.AddChunk(Chunk{ID: fmt.Sprintf("c%d", i), GPU: i % 2, NUMA: 0, Size: 1 << 16}); err != nil {
			t.Fatal(err)
		}
	}
	must(t, p.Grant("a", []string{"c0", "c1", "c2", "c3"}))
	must(t, p.Grant("b", []string{"c4"}))
	var ss []*Session
	for _, o := range []struct {
		alloc string
		gpu   int
		max   int
	}{{"a", 0, 100}, {"a", 1, 0}, {"b", 0, 0}} {
		s, err := p.Open(o.alloc, Spec{GPU: o.gpu, PageSize: 1024, DevicePages: 64, MaxPages: o.max})
		must(t, err)
		ss = append(ss, s)
	}
	r := rand.New(rand.NewPCG(seed, 7))
	for i := range 3000 {
		s := ss[r.IntN(len(ss))]
		rid, label := fmt.Sprintf("r%d", r.IntN(40)), fmt.Sprintf("l%d", r.IntN(3))
		switch r.IntN(6) {
		case 0, 1:
			n := r.IntN(8)
			dev := r.Perm(64)[:n]
			d32 := make([]int32, n)
			for j, d := range dev {
				d32[j] = int32(d)
			}
			s.Offload(rid, label, d32, Meta{StoredLen: int64(i), Position: int64(n)}, nil)
		case 2:
			n, err := s.NumPages(rid, label)
			if err == nil && n > 0 { // 0: no such stream (the seed's num_pages)
				d32 := make([]int32, n)
				for j := range d32 {
					d32[j] = int32(j)
				}
				_, err = s.Reload(rid, label, d32, nil)
				must(t, err)
			}
		case 3:
			if s.ticket > 0 {
				must(t, s.Fence(uint64(r.IntN(int(s.ticket)))+1))
			}
		case 4:
			s.Discard(rid, label)
		case 5:
			s.RemoveRequest(rid)
		}
	}
	return p
}

func TestExportRestoreRoundTrip(t *testing.T) {
	for seed := range uint64(5) {
		p := busyPool(t, seed)
		img := p.Export()
		if len(img.Sessions) != 3 {
			t.Fatalf("sessions %d", len(img.Sessions))
		}
		q := New()
		ss, err := q.Restore(img)
		must(t, err)
		for _, s := range ss {
			must(t, s.Check())
		}
		if got := q.Export(); !reflect.DeepEqual(got, img) {
			t.Fatalf("seed %d: restored pool exports differently:\n%+v\nwant\n%+v", seed, got, img)
		}
		// The restored sessions go on working, and new sessions get new IDs.
		s := ss[0]
		before := s.Usage()
		if before.Pending > 0 {
			must(t, s.Fence(s.ticket))
		}
		u := s.Usage()
		if u.Pending != 0 || u.Free() != u.Capacity-u.Used {
			t.Fatalf("usage after fence %+v", u)
		}
		q.Close(ss[2])
		s2, err := q.Open("b", Spec{GPU: 0, PageSize: 1024, DevicePages: 64})
		must(t, err)
		if s2.ID() != img.LastSession+1 {
			t.Fatalf("new session ID %d after restore of last %d", s2.ID(), img.LastSession)
		}
	}
}

func TestRestoreRefusesBrokenImages(t *testing.T) {
	good := busyPool(t, 9).Export()
	var withStreams int
	for i, s := range good.Sessions {
		if len(s.Requests) > 0 {
			withStreams = i
		}
	}
	clone := func() Image {
		q := New()
		if _, err := q.Restore(good); err != nil {
			t.Fatal(err)
		}
		return q.Export()
	}
	cases := []struct {
		name  string
		spoil func(*Image)
	}{
		{"duplicate chunk", func(m *Image) { m.Chunks = append(m.Chunks, m.Chunks[0]) }},
		{"granted chunk in no allocation", func(m *Image) { m.Allocations = m.Allocations[1:]; m.Sessions = nil }},
		{"unknown chunk in allocation", func(m *Image) { m.Allocations[0].Chunks[0] = "nope" }},
		{"session on unknown allocation", func(m *Image) { m.Sessions[0].Allocation = "zz" }},
		{"session ID above last", func(m *Image) { m.LastSession = 1 }},
		{"chunk bound twice", func(m *Image) { m.Sessions[1].Chunks = m.Sessions[0].Chunks }},
		{"chunk listed twice by its session", func(m *Image) {
			m.Sessions[0].Chunks = append(m.Sessions[0].Chunks, m.Sessions[0].Chunks[0])
		}},
		{"capacity over chunks", func(m *Image) { m.Sessions[0].Capacity = 1 << 20 }},
		{"page out of range", func(m *Image) {
			s := &m.Sessions[withStreams]
			s.Requests[0].Streams[0].Pages = append(s.Requests[0].Streams[0].Pages, int32(s.Capacity))
		}},
		{"page held twice", func(m *Image) {
			s := &m.Sessions[withStreams]
			s.Requests = append(s.Requests, RequestImage{Rid: "dup", Streams: []StreamImage{{Label: "x", Pages: s.Requests[0].Streams[0].Pages}}})
		}},
		{"duplicate stream", func(m *Image) {
			s := &m.Sessions[withStreams]
			q := &s.Requests[0]
			q.Streams = append(q.Streams, StreamImage{Label: q.Streams[0].Label})
		}},
		{"pending ticket never issued", func(m *Image) {
			s := &m.Sessions[0]
			s.Pending = append(s.Pending, PendingImage{Ticket: s.Ticket + 1, Pages: []int32{0}})
		}},
		{"request listed twice", func(m *Image) {
			s := &m.Sessions[withStreams]
			s.Requests = append(s.Requests, RequestImage{Rid: s.Requests[0].Rid, Streams: []StreamImage{{Label: "other"}}})
		}},
		{"bad name", func(m *Image) { m.Sessions[withStreams].Requests[0].Rid = "" }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			img := clone()
			c.spoil(&img)
			q := New()
			if _, err := q.Restore(img); err == nil {
				t.Fatal("restore accepted a broken image")
			}
			if len(q.Chunks()) != 0 {
				t.Fatal("a failed restore left chunks behind")
			}
			if _, err := q.Restore(good); err != nil {
				t.Fatalf("restore after a failed one: %v", err)
			}
		})
	}
	q := New()
	must(t, q.AddChunk(Chunk{ID: "x", Size: 1}))
	if _, err := q.Restore(good); err == nil {
		t.Fatal("restore into a non-empty pool")
	}
}

func TestJournalSeesTableChanges(t *testing.T) {
	p := New()
	var l eventLog
	p.SetJournal(&l)
	must(t, p.AddChunk(Chunk{ID: "c0", Size: 4096}))
	must(t, p.AddChunk(Chunk{ID: "c1", Size: 4096}))
	must(t, p.Grant("a", []string{"c0"}))
	must(t, p.Grant("a", []string{"c0"})) // repeated: no event
	if err := p.Grant("b", []string{"c0"}); !errors.Is(err, poolerr.ErrChunkBusy) {
		t.Fatal(err)
	}
	_, err := p.Revoke("a")
	must(t, err)
	must(t, p.Scrubbed("c0"))
	must(t, p.RemoveChunk("c1"))
	var kinds []EventKind
	for _, ev := range l {
		kinds = append(kinds, ev.Kind)
	}
	want := []EventKind{EventAddChunk, EventAddChunk, EventGrant, EventRevoke, EventScrubbed, EventRemoveChunk}
	if !reflect.DeepEqual(kinds, want) {
		t.Fatalf("events %v, want %v", kinds, want)
	}
}

// A fresh pool never hands out a session ID an earlier pool did: its IDs
// start above the clock (in microseconds) of its making, and a pool
// restored from an image that never opened a session keeps that epoch
// (issue 23: a client that lost its session could get its old ID back).
func TestFreshPoolsDoNotReuseSessionIDs(t *testing.T) {
	open := func(p *Pool) uint64 {
		t.Helper()
		must(t, p.AddChunk(Chunk{ID: "c0", Size: 1 << 16}))
		must(t, p.Grant("a", []string{"c0"}))
		s, err := p.Open("a", Spec{PageSize: 1024, DevicePages: 8})
		must(t, err)
		return s.ID()
	}
	first := open(New())
	time.Sleep(time.Millisecond)
	second := open(New())
	if second <= first {
		t.Fatalf("a later fresh pool's first session is %d, an earlier one's %d", second, first)
	}
	time.Sleep(time.Millisecond)
	p := New()
	if _, err := p.Restore(Image{}); err != nil {
		t.Fatal(err)
	}
	if third := open(p); third <= second {
		t.Fatalf("a pool restored from an empty image opened session %d, after %d", third, second)
	}
	// An image's own IDs go on from its last one.
	img := busyPool(t, 1).Export()
	q := New()
	if _, err := q.Restore(img); err != nil {
		t.Fatal(err)
	}
	if got := q.Export().LastSession; got != img.LastSession {
		t.Fatalf("restored last session %d, the image's %d", got, img.LastSession)
	}
}

// StreamTotals is the sum of the sessions' stream tables, through every
// operation, a close, a revoke and a restore.
func TestStreamTotals(t *testing.T) {
	sums := func(p *Pool) (int, int64) {
		var streams int
		var names int64
		for _, a := range p.Export().Allocations {
			for _, s := range p.Sessions(a.ID) {
				u := s.Usage()
				streams, names = streams+u.Streams, names+u.NameBytes
			}
		}
		return streams, names
	}
	check := func(p *Pool, when string) {
		t.Helper()
		ts, tn := p.StreamTotals()
		if s, n := sums(p); ts != s || tn != n {
			t.Fatalf("%s: totals %d streams, %d name bytes; the sessions hold %d and %d", when, ts, tn, s, n)
		}
	}
	for seed := range uint64(4) {
		p := busyPool(t, seed)
		if s, _ := p.StreamTotals(); s == 0 {
			t.Fatal("no streams to count")
		}
		check(p, "after the history")
		q := New()
		if _, err := q.Restore(p.Export()); err != nil {
			t.Fatal(err)
		}
		check(q, "restored")
		ss := p.Sessions("a")
		p.Close(ss[0])
		check(p, "after a close")
		if _, err := p.Revoke("a"); err != nil {
			t.Fatal(err)
		}
		check(p, "after a revoke")
		if _, err := q.Restore(Image{}); err == nil {
			t.Fatal("restore into a pool that is not empty")
		}
		check(q, "after a refused restore")
	}
}

// largePool is one session of about 7,000 streams: most requests have one
// stream, some a dozen (past indexFrom), and every stream a page or two.
func largePool(t *testing.T) *Pool {
	t.Helper()
	p := New()
	must(t, p.AddChunk(Chunk{ID: "big", Size: 1 << 20}))
	must(t, p.Grant("a", []string{"big"}))
	s, err := p.Open("a", Spec{PageSize: 64, DevicePages: 64})
	must(t, err)
	r := rand.New(rand.NewPCG(3, 4))
	for i := range 6000 {
		rid := fmt.Sprintf("req-%05d", i)
		labels := 1
		if i%500 == 0 {
			labels = 12
		}
		for l := range labels {
			d := int32(r.IntN(64))
			_, err := s.Offload(rid, fmt.Sprintf("l%d", l), []int32{d, (d + 1) % 64}[:1+r.IntN(2)], Meta{StoredLen: int64(i)}, nil)
			must(t, err)
		}
		if i%7 == 0 {
			s.RemoveRequest(fmt.Sprintf("req-%05d", i/2))
		}
	}
	return p
}

// TestRestoreLargeSession: a session large enough for its index to be
// built beside its slots restores to the pool it was, as it does with one
// CPU, and its broken images are refused either way.
func TestRestoreLargeSession(t *testing.T) {
	img := largePool(t).Export()
	if n := img.Sessions[0].streams(); n < splitFrom {
		t.Fatalf("%d streams, below the split at %d", n, splitFrom)
	}
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, procs := range []int{1, 2} {
		runtime.GOMAXPROCS(procs)
		q := New()
		ss, err := q.Restore(img)
		must(t, err)
		must(t, ss[0].Check())
		if got := q.Export(); !reflect.DeepEqual(got, img) {
			t.Fatalf("%d CPUs: the restored pool exports differently", procs)
		}
		// The index is the one the session goes on with.
		reqs := img.Sessions[0].Requests
		for _, q := range []RequestImage{reqs[0], reqs[len(reqs)/2], reqs[len(reqs)-1]} {
			for _, st := range q.Streams {
				if n, err := ss[0].NumPages(q.Rid, st.Label); err != nil || n != len(st.Pages) {
					t.Fatalf("%d CPUs: %s/%s has %d pages (%v) after the restore, want %d", procs, q.Rid, st.Label, n, err, len(st.Pages))
				}
			}
		}
		_, err = ss[0].Offload("req-new", "l0", []int32{1}, Meta{}, nil)
		must(t, err)
		must(t, ss[0].Check())
	}
	last := len(img.Sessions[0].Requests) - 1
	cases := []struct {
		name  string
		spoil func(*SessionImage)
		want  error
	}{
		{"request listed twice", func(s *SessionImage) { s.Requests[last].Rid = s.Requests[0].Rid }, errListedTwice},
		{"duplicate stream in a request", func(s *SessionImage) {
			q := &s.Requests[last/2]
			q.Streams = append(q.Streams, StreamImage{Label: q.Streams[0].Label})
		}, poolerr.ErrDuplicateStream},
		{"page held twice", func(s *SessionImage) { s.Requests[last].Streams[0].Pages = s.Requests[0].Streams[0].Pages }, poolerr.ErrDuplicateIndex},
		{"bad name", func(s *SessionImage) { s.Requests[last/2].Rid = "" }, nil},
	}
	for _, c := range cases {
		for _, procs := range []int{1, 2} {
			t.Run(fmt.Sprintf("%s/%dcpu", c.name, procs), func(t *testing.T) {
				runtime.GOMAXPROCS(procs)
				bad := New()
				_, _ = bad.Restore(img) // a deep copy of the image to spoil
				spoilt := bad.Export()
				c.spoil(&spoilt.Sessions[0])
				q := New()
				_, err := q.Restore(spoilt)
				if err == nil || c.want != nil && !errors.Is(err, c.want) {
					t.Fatalf("restore: %v, want %v", err, c.want)
				}
				if len(q.Chunks()) != 0 {
					t.Fatal("a failed restore left chunks behind")
				}
			})
		}
	}
}

// streams counts the session image's streams.
func (si *SessionImage) streams() int {
	n := 0
	for _, q := range si.Requests {
		n += len(q.Streams)
	}
	return n
}

// TestRestoreSkipsEmptyRequests: a request without streams (a hole of the
// books' list, which they hand as it is) restores to nothing wherever it
// stands, in a small session and in one whose index is built beside its
// slots.
func TestRestoreSkipsEmptyRequests(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for name, p := range map[string]*Pool{"small": busyPool(t, 9), "large": largePool(t)} {
		want := p.Export()
		for _, procs := range []int{1, 2} {
			runtime.GOMAXPROCS(procs)
			src := New()
			_, err := src.Restore(want) // a deep copy to add holes to
			must(t, err)
			img := src.Export()
			for i := range img.Sessions {
				s := &img.Sessions[i]
				mid := len(s.Requests) / 2
				s.Requests = slices.Insert(s.Requests, mid, RequestImage{Rid: "gone"}, RequestImage{})
				s.Requests = append([]RequestImage{{}}, append(s.Requests, RequestImage{Rid: "gone-too", Streams: []StreamImage{}})...)
			}
			q := New()
			_, err = q.Restore(img)
			must(t, err)
			if got := q.Export(); !reflect.DeepEqual(got, want) {
				t.Fatalf("%s, %d CPUs: the pool restored from an image with holes exports differently", name, procs)
			}
		}
	}
}

// TestRestoreManyLabels: requests of more streams than indexFrom, some
// with labels past the intern table (their own), restore with their label
// index: the restored session exports as the pool did, every stream is
// found by its label, and removing streams and requests afterwards keeps
// the index whole (Check).
func TestRestoreManyLabels(t *testing.T) {
	p := New()
	must(t, p.AddChunk(Chunk{ID: "c", Size: 1 << 20}))
	must(t, p.Grant("A", []string{"c"}))
	s, err := p.Open("A", Spec{PageSize: 64, DevicePages: 64})
	must(t, err)
	sizes := map[string]int{"one": 1, "eight": indexFrom, "nine": indexFrom + 1, "thirty": 30, "many": maxInterned + 50}
	for rid, n := range sizes {
		for i := range n {
			_, err := s.Offload(rid, fmt.Sprintf("%s-label-%d", rid, i), []int32{int32(i % 64)}, Meta{StoredLen: int64(i)}, nil)
			must(t, err)
		}
	}
	must(t, s.Discard("thirty", "thirty-label-3"))
	must(t, s.Discard("many", "many-label-299"))
	q, img, r := restoreFirst(t, p)
	if got := q.Export(); !reflect.DeepEqual(got, img) {
		t.Fatal("the restored pool exports differently")
	}
	for rid, n := range sizes {
		for i := range n {
			label := fmt.Sprintf("%s-label-%d", rid, i)
			want := 1
			if label == "thirty-label-3" || label == "many-label-299" {
				want = 0
			}
			if got, err := r.NumPages(rid, label); err != nil || got != want {
				t.Fatalf("num_pages(%s, %s) = %d, %v after the restore; want %d", rid, label, got, err, want)
			}
		}
	}
	for i := range 20 {
		must(t, r.Discard("many", fmt.Sprintf("many-label-%d", 7*i)))
	}
	must(t, r.Discard("nine", "nine-label-0")) // down to indexFrom: walked again
	must(t, r.Check())
	if n, err := r.RemoveRequest("thirty"); err != nil || n != 29 {
		t.Fatalf("remove_request = %d, %v; want 29", n, err)
	}
	must(t, r.Check())
}

// restoreFirst restores p's export into a fresh pool and returns that
// pool, the export and its first session, checked.
func restoreFirst(t *testing.T, p *Pool) (*Pool, Image, *Session) {
	t.Helper()
	img := p.Export()
	q := New()
	ss, err := q.Restore(img)
	must(t, err)
	must(t, ss[0].Check())
	return q, img, ss[0]
}
