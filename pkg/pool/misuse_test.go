package pool

import (
	"bytes"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvpool/kvpool/pkg/poolerr"
)

// sessionState is everything observable about a session, so that a test can
// assert a rejected call changed nothing.
type sessionState struct {
	Usage   Usage
	Streams []string // "rid/label pages meta" in table order
	Free    []int32  // the free list, in hand-out order
	Pending []string
	Ticket  uint64
}

func stateOf(s *Session) sessionState {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := sessionState{
		Usage:  Usage{Capacity: s.capacity, Used: s.used, Pending: s.npending, Streams: s.nstreams, Requests: s.reqs.n},
		Ticket: s.ticket,
	}
	rids := make([]string, 0, s.reqs.n)
	for rid := range s.reqs.all() {
		rids = append(rids, rid)
	}
	slices.Sort(rids)
	chain := func(head int32) []int32 {
		var out []int32
		for p := head; p != nilPage; p = s.next[p] {
			out = append(out, p)
		}
		return out
	}
	for _, rid := range rids {
		for slot := s.first(rid); slot != nilPage; slot = s.at(slot).next {
			x := s.at(slot)
			st.Streams = append(st.Streams, fmt.Sprintf("%s/%s %v %+v", rid, s.labelOf(slot), chain(x.head), x.meta))
		}
	}
	st.Free = chain(s.freeHead)
	for p := s.fresh; int(p) < s.capacity; p++ {
		st.Free = append(st.Free, p) // never handed out: after the listed ones
	}
	for _, r := range s.pending[s.phead:] {
		st.Pending = append(st.Pending, fmt.Sprintf("%d:%v", r.ticket, chain(r.head)[:r.n]))
	}
	return st
}

// misuseSession returns a session of 8 pages over 16 device pages holding
// r1/a (3 pages), r1/b (2 pages) and a reload of r2/x (2 pages) awaiting its
// fence: 1 page free, 2 pending.
func misuseSession(t *testing.T) *Session {
	t.Helper()
	p := testPool(t)
	must(t, p.Grant("A", []string{"gpu0-c0"}))
	s, err := p.Open("A", Spec{GPU: 0, PageSize: 4 << 10, DevicePages: 16, MaxPages: 8})
	must(t, err)
	for _, o := range []struct {
		rid, label string
		pages      []int32
	}{{"r1", "a", []int32{0, 1, 2}}, {"r1", "b", []int32{3, 4}}, {"r2", "x", []int32{5, 6}}} {
		if _, err := s.Offload(o.rid, o.label, o.pages, Meta{StoredLen: 10, Position: 9}, nil); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Reload("r2", "x", []int32{7, 8}, nil); err != nil {
		t.Fatal(err)
	}
	if u := s.Usage(); u.Used != 5 || u.Pending != 2 || s.NumFreePages() != 3 {
		t.Fatalf("fixture usage %+v, free %d", u, s.NumFreePages())
	}
	return s
}

func TestSessionMisuse(t *testing.T) {
	long := strings.Repeat("x", MaxNameLen+1)
	cases := []struct {
		name string
		call func(s *Session) error
		want error
	}{
		{"offload empty rid", func(s *Session) error { _, err := s.Offload("", "a", []int32{9}, Meta{}, nil); return err }, poolerr.ErrBadName},
		{"offload long rid", func(s *Session) error { _, err := s.Offload(long, "a", []int32{9}, Meta{}, nil); return err }, poolerr.ErrBadName},
		{"offload long label", func(s *Session) error { _, err := s.Offload("r3", long, []int32{9}, Meta{}, nil); return err }, poolerr.ErrBadName},
		{"offload negative stored_len", func(s *Session) error {
			_, err := s.Offload("r3", "a", []int32{9}, Meta{StoredLen: -1}, nil)
			return err
		}, poolerr.ErrBadSize},
		{"offload negative position", func(s *Session) error {
			_, err := s.Offload("r3", "a", []int32{9}, Meta{Position: -1}, nil)
			return err
		}, poolerr.ErrBadSize},
		{"offload negative released", func(s *Session) error {
			_, err := s.Offload("r3", "a", []int32{9}, Meta{Released: -5}, nil)
			return err
		}, poolerr.ErrBadSize},
		{"offload duplicate stream", func(s *Session) error { _, err := s.Offload("r1", "a", []int32{9}, Meta{}, nil); return err }, poolerr.ErrDuplicateStream},
		{"offload device page negative", func(s *Session) error { _, err := s.Offload("r3", "a", []int32{-1}, Meta{}, nil); return err }, poolerr.ErrOutOfRange},
		{"offload device page past end", func(s *Session) error { _, err := s.Offload("r3", "a", []int32{16}, Meta{}, nil); return err }, poolerr.ErrOutOfRange},
		{"offload duplicate device page", func(s *Session) error { _, err := s.Offload("r3", "a", []int32{9, 9}, Meta{}, nil); return err }, poolerr.ErrDuplicateIndex},
		{"offload more pages than the device has", func(s *Session) error {
			_, err := s.Offload("r3", "a", make([]int32, 17), Meta{}, nil)
			return err
		}, poolerr.ErrPageCount},
		{"offload beyond free and pending", func(s *Session) error {
			_, err := s.Offload("r3", "a", []int32{9, 10, 11, 12}, Meta{}, nil)
			return err
		}, poolerr.ErrFull},
		{"offload needing pending pages", func(s *Session) error {
			_, err := s.Offload("r3", "a", []int32{9, 10}, Meta{}, nil)
			var pe *PendingError
			if !errors.As(err, &pe) || pe.Ticket != 1 || pe.Need != 2 || pe.Free != 1 {
				return fmt.Errorf("want PendingError{Ticket 1, Need 2, Free 1}, got %v", err)
			}
			return err
		}, poolerr.ErrPending},
		{"offload of a new request with the session's request IDs at their bound", func(s *Session) error {
			defer boundNames(3)() // "r1" held, "r2" dead (packed away): "r3" does not fit
			_, err := s.Offload("r3", "a", []int32{9}, Meta{}, nil)
			return err
		}, poolerr.ErrFull},
		{"reload unknown stream", func(s *Session) error { _, err := s.Reload("r1", "zz", []int32{9}, nil); return err }, poolerr.ErrUnknownStream},
		{"reload already reloaded stream", func(s *Session) error { _, err := s.Reload("r2", "x", []int32{9, 10}, nil); return err }, poolerr.ErrUnknownStream},
		{"reload too few device pages", func(s *Session) error { _, err := s.Reload("r1", "a", []int32{9, 10}, nil); return err }, poolerr.ErrPageCount},
		{"reload too many device pages", func(s *Session) error {
			_, err := s.Reload("r1", "a", []int32{9, 10, 11, 12}, nil)
			return err
		}, poolerr.ErrPageCount},
		{"reload device page past end", func(s *Session) error { _, err := s.Reload("r1", "b", []int32{9, 99}, nil); return err }, poolerr.ErrOutOfRange},
		{"reload duplicate device page", func(s *Session) error { _, err := s.Reload("r1", "b", []int32{9, 9}, nil); return err }, poolerr.ErrDuplicateIndex},
		{"reload empty rid", func(s *Session) error { _, err := s.Reload("", "b", []int32{9, 10}, nil); return err }, poolerr.ErrBadName},
		{"offload of zero pages", func(s *Session) error { _, err := s.Offload("r3", "a", nil, Meta{}, nil); return err }, poolerr.ErrNoPages},
		{"offload of zero pages to a new label of a stored request", func(s *Session) error {
			_, err := s.Offload("r1", "c", []int32{}, Meta{StoredLen: 1}, nil)
			return err
		}, poolerr.ErrNoPages},
		{"offload of zero pages to an existing stream", func(s *Session) error { _, err := s.Offload("r1", "a", nil, Meta{}, nil); return err }, poolerr.ErrDuplicateStream},
		{"discard empty rid", func(s *Session) error { return s.Discard("", "a") }, poolerr.ErrBadName},
		{"fence unissued ticket", func(s *Session) error { return s.Fence(2) }, poolerr.ErrBadFence},
		{"remove_request empty rid", func(s *Session) error { _, err := s.RemoveRequest(""); return err }, poolerr.ErrBadName},
		{"remove_request long rid", func(s *Session) error { _, err := s.RemoveRequest(long); return err }, poolerr.ErrBadName},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := misuseSession(t)
			before := stateOf(s)
			err := c.call(s)
			if !errors.Is(err, c.want) {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			if err.Error() == c.want.Error() {
				t.Errorf("error %q carries no context", err)
			}
			if after := stateOf(s); !reflect.DeepEqual(before, after) {
				t.Fatalf("state changed:\nbefore %+v\nafter  %+v", before, after)
			}
			must(t, s.Check())
			must(t, s.pool.Check())
		})
	}
}

// TestSeedSemantics checks the calls the seed's engine makes where its doc
// is silent: discard of a stream that does not exist is a no-op, num_pages
// of one is 0. Neither is an error and neither changes anything.
func TestSeedSemantics(t *testing.T) {
	cases := []struct {
		name string
		call func(s *Session) error
	}{
		{"discard unknown label of a stored request", func(s *Session) error { return s.Discard("r1", "zz") }},
		{"discard unknown request", func(s *Session) error { return s.Discard("r9", "a") }},
		{"discard a stream already reloaded", func(s *Session) error { return s.Discard("r2", "x") }},
		{"num_pages unknown label", func(s *Session) error {
			if n, err := s.NumPages("r1", "c"); n != 0 || err != nil {
				return fmt.Errorf("num_pages = %d, %v; want 0, nil", n, err)
			}
			return nil
		}},
		{"num_pages unknown request", func(s *Session) error {
			if n, err := s.NumPages("r9", ""); n != 0 || err != nil {
				return fmt.Errorf("num_pages = %d, %v; want 0, nil", n, err)
			}
			return nil
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := misuseSession(t)
			before := stateOf(s)
			if err := c.call(s); err != nil {
				t.Fatal(err)
			}
			if after := stateOf(s); !reflect.DeepEqual(before, after) {
				t.Fatalf("state changed:\nbefore %+v\nafter  %+v", before, after)
			}
			must(t, s.Check())
		})
	}
}

// TestSessionClosed: every operation on a closed session fails with
// poolerr.ErrClosed, and the queries report nothing.
func TestSessionClosed(t *testing.T) {
	s := misuseSession(t)
	s.pool.Close(s)
	calls := map[string]func() error{
		"offload": func() error { _, err := s.Offload("r3", "a", []int32{9}, Meta{}, nil); return err },
		"reload":  func() error { _, err := s.Reload("r1", "a", []int32{9, 10, 11}, nil); return err },
		"discard": func() error { return s.Discard("r1", "a") },
		"fence":   func() error { return s.Fence(1) },
		"remove":  func() error { _, err := s.RemoveRequest("r1"); return err },
		"pages":   func() error { _, err := s.NumPages("r1", "a"); return err },
	}
	for name, call := range calls {
		if err := call(); !errors.Is(err, poolerr.ErrClosed) {
			t.Errorf("%s on a closed session: %v, want poolerr.ErrClosed", name, err)
		}
	}
	if s.IsOffloaded("r1") || s.Labels("r1") != nil || !s.Closed() {
		t.Error("a closed session still reports streams")
	}
}

// poolState is the pool-wide view a rejected call must leave alone.
type poolState struct {
	Chunks []ChunkInfo
	Allocs map[string][]string
}

func poolStateOf(p *Pool) poolState {
	st := poolState{Chunks: p.Chunks(), Allocs: map[string][]string{}}
	p.mu.Lock()
	ids := make([]string, 0, len(p.allocs))
	for id := range p.allocs {
		ids = append(ids, id)
	}
	p.mu.Unlock()
	for _, id := range ids {
		cs, _ := p.Allocation(id)
		st.Allocs[id] = cs
	}
	return st
}

func TestPoolMisuse(t *testing.T) {
	// Fixture: A holds gpu0-c0, gpu0-c1 with one session bound to both
	// chunks; B holds gpu1-c0 and was revoked, leaving it dirty.
	fixture := func(t *testing.T) *Pool {
		p := testPool(t)
		must(t, p.Grant("A", []string{"gpu0-c0", "gpu0-c1"}))
		if _, err := p.Open("A", Spec{GPU: 0, PageSize: 4 << 10, DevicePages: 8}); err != nil {
			t.Fatal(err)
		}
		must(t, p.Grant("B", []string{"gpu1-c0"}))
		if _, err := p.Revoke("B"); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cases := []struct {
		name string
		call func(p *Pool) error
		want error
	}{
		{"add chunk without ID", func(p *Pool) error { return p.AddChunk(Chunk{Size: 1}) }, poolerr.ErrBadSize},
		{"add chunk of zero bytes", func(p *Pool) error { return p.AddChunk(Chunk{ID: "new"}) }, poolerr.ErrBadSize},
		{"add chunk twice", func(p *Pool) error { return p.AddChunk(Chunk{ID: "gpu0-c3", Size: 1}) }, poolerr.ErrDuplicateChunk},
		{"remove unknown chunk", func(p *Pool) error { return p.RemoveChunk("nope") }, poolerr.ErrUnknownChunk},
		{"remove granted chunk", func(p *Pool) error { return p.RemoveChunk("gpu0-c0") }, poolerr.ErrChunkBusy},
		{"scrub unknown chunk", func(p *Pool) error { return p.Scrubbed("nope") }, poolerr.ErrUnknownChunk},
		{"scrub granted chunk", func(p *Pool) error { return p.Scrubbed("gpu0-c1") }, poolerr.ErrChunkBusy},
		{"grant without allocation ID", func(p *Pool) error { return p.Grant("", []string{"gpu0-c2"}) }, poolerr.ErrBadSize},
		{"grant no chunks", func(p *Pool) error { return p.Grant("C", nil) }, poolerr.ErrBadSize},
		{"grant unknown chunk", func(p *Pool) error { return p.Grant("C", []string{"gpu0-c2", "nope"}) }, poolerr.ErrUnknownChunk},
		{"grant chunk twice", func(p *Pool) error { return p.Grant("C", []string{"gpu0-c2", "gpu0-c2"}) }, poolerr.ErrDuplicateIndex},
		{"grant another allocation's chunk", func(p *Pool) error { return p.Grant("C", []string{"gpu0-c2", "gpu0-c0"}) }, poolerr.ErrChunkBusy},
		{"grant dirty chunk", func(p *Pool) error { return p.Grant("C", []string{"gpu1-c0"}) }, poolerr.ErrChunkDirty},
		{"grant a different set to an allocation", func(p *Pool) error { return p.Grant("A", []string{"gpu0-c0"}) }, poolerr.ErrAllocationExists},
		{"revoke unknown allocation", func(p *Pool) error { _, err := p.Revoke("C"); return err }, poolerr.ErrUnknownAllocation},
		{"open unknown allocation", func(p *Pool) error { _, err := p.Open("C", Spec{PageSize: 1, DevicePages: 1}); return err }, poolerr.ErrUnknownAllocation},
		{"open with zero page size", func(p *Pool) error { _, err := p.Open("A", Spec{DevicePages: 1}); return err }, poolerr.ErrBadSize},
		{"open with no device pages", func(p *Pool) error { _, err := p.Open("A", Spec{PageSize: 1}); return err }, poolerr.ErrBadSize},
		{"open with negative max pages", func(p *Pool) error {
			_, err := p.Open("A", Spec{PageSize: 1, DevicePages: 1, MaxPages: -1})
			return err
		}, poolerr.ErrBadSize},
		{"open when every chunk is bound", func(p *Pool) error { _, err := p.Open("A", Spec{PageSize: 1, DevicePages: 1}); return err }, poolerr.ErrNoCapacity},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := fixture(t)
			before := poolStateOf(p)
			err := c.call(p)
			if !errors.Is(err, c.want) {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			if after := poolStateOf(p); !reflect.DeepEqual(before, after) {
				t.Fatalf("state changed:\nbefore %+v\nafter  %+v", before, after)
			}
			must(t, p.Check())
		})
	}
	// Geometry errors need an allocation with unbound chunks.
	p := testPool(t)
	must(t, p.Grant("C", []string{"gpu0-c2", "gpu0-c3"}))
	before := poolStateOf(p)
	for _, sp := range []Spec{
		{PageSize: 128 << 10, DevicePages: 4},             // page larger than a 64 KiB chunk
		{PageSize: 32 << 10, DevicePages: 4, MaxPages: 5}, // 5 pages need 3 chunks, 2 held
	} {
		if _, err := p.Open("C", sp); err == nil || !(errors.Is(err, poolerr.ErrBadSize) || errors.Is(err, poolerr.ErrNoCapacity)) {
			t.Errorf("open %+v: %v, want a size or capacity error", sp, err)
		}
	}
	if after := poolStateOf(p); !reflect.DeepEqual(before, after) {
		t.Fatalf("state changed: %+v -> %+v", before, after)
	}
}

// TestPoolLifecycle walks a chunk through grant, use, revoke, scrub and a
// second grant, and checks that a repeated Grant is idempotent.
func TestPoolLifecycle(t *testing.T) {
	t.Run("each rank binds its own GPU's chunks first", testOwnGPU)
	p := testPool(t)
	ids := []string{"gpu0-c0", "gpu0-c1"}
	must(t, p.Grant("A", ids))
	must(t, p.Grant("A", []string{"gpu0-c1", "gpu0-c0"})) // kubelet retried Allocate
	s, err := p.Open("A", Spec{GPU: 0, PageSize: 16 << 10, DevicePages: 8, MaxPages: 6})
	must(t, err)
	if s.Capacity() != 6 || s.PagesPerChunk() != 4 || len(s.Chunks()) != 2 {
		t.Fatalf("capacity %d, pages per chunk %d, chunks %d", s.Capacity(), s.PagesPerChunk(), len(s.Chunks()))
	}
	if _, err := s.Offload("r", "l", []int32{0, 1, 2}, Meta{StoredLen: 3}, nil); err != nil {
		t.Fatal(err)
	}
	// Another session on A cannot bind: both chunks are taken, whatever
	// its GPU.
	for gpu := range 2 {
		if _, err := p.Open("A", Spec{GPU: gpu, PageSize: 16 << 10, DevicePages: 8}); !errors.Is(err, poolerr.ErrNoCapacity) {
			t.Fatalf("second open for GPU %d: %v", gpu, err)
		}
	}
	chunks, err := p.Revoke("A")
	must(t, err)
	if len(chunks) != 2 || !s.Closed() || s.IsOffloaded("r") {
		t.Fatalf("after revoke: %d chunks, closed %v, offloaded %v", len(chunks), s.Closed(), s.IsOffloaded("r"))
	}
	if err := p.Grant("B", ids); !errors.Is(err, poolerr.ErrChunkDirty) {
		t.Fatalf("grant of dirty chunks: %v", err)
	}
	for _, c := range chunks {
		must(t, p.Scrubbed(c.ID))
	}
	must(t, p.Grant("B", ids))
	s2, err := p.Open("B", Spec{GPU: 0, PageSize: 16 << 10, DevicePages: 8})
	must(t, err)
	if s2.NumFreePages() != 8 {
		t.Fatalf("fresh session has %d free pages", s2.NumFreePages())
	}
	// Closing a session unbinds its chunks but keeps the allocation.
	p.Close(s2)
	if _, err := p.Open("B", Spec{GPU: 0, PageSize: 16 << 10, DevicePages: 8}); err != nil {
		t.Fatalf("reopen after close: %v", err)
	}
	must(t, p.Check())
}

// testOwnGPU: an allocation holding chunks of host GPUs 4 and 5 (of 6,
// both on NUMA node 1), one session per GPU with MaxPages 0: the
// allocation is shared by one rank per GPU it names, and each binds
// exactly its GPU's chunks. A session for GPU 0 (node 0) then finds every
// chunk bound; alone, it binds them all, on the other node.
func testOwnGPU(t *testing.T) {
	p := New()
	var ids []string
	for gpu := range 6 {
		for i := range 2 {
			id := fmt.Sprintf("gpu%d-c%d", gpu, i)
			must(t, p.AddChunk(Chunk{ID: id, GPU: gpu, NUMA: gpu / 3, Size: 64 << 10}))
			if gpu >= 4 {
				ids = append(ids, id)
			}
		}
	}
	must(t, p.Grant("pod", ids))
	for _, gpu := range []int{5, 4} {
		s, err := p.Open("pod", Spec{GPU: gpu, PageSize: 4 << 10, DevicePages: 8})
		must(t, err)
		for _, c := range s.Chunks() {
			if c.GPU != gpu {
				t.Fatalf("session of GPU %d bound chunk %s of GPU %d", gpu, c.ID, c.GPU)
			}
		}
		if len(s.Chunks()) != 2 || s.Capacity() != 32 {
			t.Fatalf("session of GPU %d: %d chunks, capacity %d", gpu, len(s.Chunks()), s.Capacity())
		}
		if l := s.Locality(); l != (Locality{GPUNUMA: 1, Ranks: 2, Local: 2}) {
			t.Fatalf("session of GPU %d: locality %+v", gpu, l)
		}
	}
	if _, err := p.Open("pod", Spec{GPU: 0, PageSize: 4 << 10, DevicePages: 8}); !errors.Is(err, poolerr.ErrNoCapacity) {
		t.Fatalf("open for GPU 0 with every chunk bound: %v", err)
	}
	// A pod of GPU 0 given GPU 3's chunks (the other node): bound, remote.
	must(t, p.Grant("other", []string{"gpu3-c0", "gpu3-c1"}))
	s, err := p.Open("other", Spec{GPU: 0, PageSize: 4 << 10, DevicePages: 8})
	must(t, err)
	if l := s.Locality(); l != (Locality{GPUNUMA: 0, Ranks: 1, Remote: 2}) || !l.CrossNUMA() || s.Capacity() != 32 {
		t.Fatalf("GPU 0 on GPU 3's chunks: locality %+v, capacity %d", l, s.Capacity())
	}
	must(t, p.Check())
}

// boundNames sets the bound on a session's request ID bytes (maxNames)
// and returns what restores it.
func boundNames(n int) func() {
	old := maxNames
	maxNames = n
	return func() { maxNames = old }
}

// TestNamesPackedToFit: an offload of a new request whose ID fits only once
// the removed requests' bytes are packed away is taken, and so is a new
// label of a request held while the bound leaves no room for a new ID.
func TestNamesPackedToFit(t *testing.T) {
	s := misuseSession(t) // "r1" held, "r2" removed by its reload: 4 bytes of names, 2 dead
	defer boundNames(4)()
	must(t, s.Fence(1)) // three pages free
	if _, err := s.Offload("r1", "c", []int32{9}, Meta{}, nil); err != nil {
		t.Fatalf("a new label of a request held: %v", err)
	}
	if _, err := s.Offload("r3", "a", []int32{10}, Meta{}, nil); err != nil {
		t.Fatalf("a new request that fits once the names are packed: %v", err)
	}
	if got := string(bytes.Join(s.reqs.names.b, nil)); got != "r1r3" {
		t.Fatalf("names %q, want r1r3", got)
	}
	if _, err := s.Offload("r4", "a", []int32{11}, Meta{}, nil); !errors.Is(err, poolerr.ErrFull) {
		t.Fatalf("a new request past the bound: %v, want ErrFull", err)
	}
	must(t, s.Check())
}

// TestRegrantAndListings: a grant repeated in its order, or in another
// order of the same chunks, changes nothing and is no error (a restart's
// standalone tokens grant their restored allocations again); the pool
// lists its allocations sorted and its dirty chunks in its order.
func TestRegrantAndListings(t *testing.T) {
	p := testPool(t)
	must(t, p.Grant("B", []string{"gpu0-c2", "gpu1-c1"}))
	must(t, p.Grant("A", []string{"gpu0-c0", "gpu0-c1"}))
	must(t, p.Grant("C", []string{"gpu1-c0", "gpu1-c2"}))
	if _, err := p.Revoke("C"); err != nil {
		t.Fatal(err)
	}
	before := p.Chunks()
	for _, ids := range [][]string{{"gpu0-c0", "gpu0-c1"}, {"gpu0-c1", "gpu0-c0"}} {
		if err := p.Grant("A", ids); err != nil {
			t.Fatalf("grant A %v again: %v", ids, err)
		}
	}
	for _, ids := range [][]string{{"gpu0-c0"}, {"gpu0-c0", "gpu0-c3"}, {"gpu0-c0", "gpu0-c1", "gpu0-c3"}} {
		if err := p.Grant("A", ids); !errors.Is(err, poolerr.ErrAllocationExists) {
			t.Fatalf("grant A %v: %v, want %v", ids, err, poolerr.ErrAllocationExists)
		}
	}
	if !reflect.DeepEqual(p.Chunks(), before) {
		t.Fatalf("grants again changed the chunks:\n%+v\nwant\n%+v", p.Chunks(), before)
	}
	if got, want := p.Allocations(), []string{"A", "B"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("allocations %v, want %v", got, want)
	}
	if got, want := p.Dirty(), []string{"gpu1-c0", "gpu1-c2"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("dirty %v, want %v", got, want)
	}
	must(t, p.Scrubbed("gpu1-c0"))
	if got, want := p.Dirty(), []string{"gpu1-c2"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("dirty after a scrub %v, want %v", got, want)
	}
	if got := New().Allocations(); len(got) != 0 {
		t.Fatalf("an empty pool lists allocations %v", got)
	}
}
