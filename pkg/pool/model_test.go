package pool

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/kvpool/kvpool/pkg/poolerr"
)

// model is the reference the session is checked against: plain maps and
// slices, no allocator. It knows which pages each stream holds (as the
// session reported them) and how many are pending behind each ticket.
type model struct {
	capacity int
	streams  map[string][]modelStream // rid -> streams in offload order
	held     map[int32]string         // page -> holder, for disjointness
	pending  []modelRelease
	issued   uint64
}

type modelStream struct {
	label string
	pages []int32
	meta  Meta
}

type modelRelease struct {
	ticket uint64
	pages  []int32
}

func newModel(capacity int) *model {
	return &model{capacity: capacity, streams: map[string][]modelStream{}, held: map[int32]string{}}
}

func (m *model) used() int {
	n := 0
	for _, ss := range m.streams {
		for _, s := range ss {
			n += len(s.pages)
		}
	}
	return n
}

func (m *model) pendingPages() int {
	n := 0
	for _, r := range m.pending {
		n += len(r.pages)
	}
	return n
}

func (m *model) find(rid, label string) int {
	for i, s := range m.streams[rid] {
		if s.label == label {
			return i
		}
	}
	return -1
}

func (m *model) drop(rid string, i int) {
	ss := m.streams[rid]
	ss = slices.Delete(ss, i, i+1)
	if len(ss) == 0 {
		delete(m.streams, rid)
	} else {
		m.streams[rid] = ss
	}
}

// driver runs random operations on one session and checks each against the model.
type driver struct {
	t    *testing.T
	rng  *rand.Rand
	s    *Session
	m    *model
	name string
	dev  int
	long bool     // offloads of up to every device page, not just a dozen
	many []string // labels to use instead of the default four
}

// labelSet is the labels the driver draws from: with more than indexFrom,
// requests switch to their label index and back.
func (d *driver) labelSet() []string {
	if d.many != nil {
		return d.many
	}
	return labels
}

var (
	// Request IDs of three lengths, two each: shorter than the index
	// reuses the bytes of (minFreed), and two lengths whose removed IDs'
	// bytes the other of the pair takes.
	rids   = []string{"r0", "r1", "req-2", "req-3", "request-4", "request-5"}
	labels = []string{"", "k", "v", "mla"}
)

func (d *driver) devicePages(n int) []int32 {
	perm := d.rng.Perm(d.dev)[:n]
	out := make([]int32, n)
	for i, p := range perm {
		out[i] = int32(p)
	}
	// Now and then, a bad index: out of range or repeated.
	if n > 0 && d.rng.IntN(12) == 0 {
		switch d.rng.IntN(3) {
		case 0:
			out[d.rng.IntN(n)] = int32(d.dev + d.rng.IntN(3))
		case 1:
			out[d.rng.IntN(n)] = -1
		case 2:
			if n > 1 {
				out[1] = out[0]
			}
		}
	}
	return out
}

func badDevice(pages []int32, dev int) error {
	seen := map[int32]bool{}
	for _, p := range pages {
		if p < 0 || int(p) >= dev {
			return poolerr.ErrOutOfRange
		}
		if seen[p] {
			return poolerr.ErrDuplicateIndex
		}
		seen[p] = true
	}
	return nil
}

func (d *driver) fail(format string, args ...any) {
	d.t.Helper()
	d.t.Fatalf("%s: "+format, append([]any{d.name}, args...)...)
}

func (d *driver) wantErr(op string, got, want error) {
	d.t.Helper()
	if want == nil && got != nil {
		d.fail("%s: unexpected error %v", op, got)
	}
	if want != nil && !errors.Is(got, want) {
		d.fail("%s: error %v, want %v", op, got, want)
	}
}

func (d *driver) step() {
	rid := rids[d.rng.IntN(len(rids))]
	if d.many != nil && !d.long {
		rid = rids[d.rng.IntN(2)] // many streams in few requests
	}
	label := d.labelSet()[d.rng.IntN(len(d.labelSet()))]
	op := d.rng.IntN(10)
	if d.many != nil && !d.long && op >= 3 && op <= 6 && d.rng.IntN(2) == 0 {
		op = 0 // let requests grow past indexFrom streams
	}
	switch op {
	case 0, 1, 2: // offload
		n := d.rng.IntN(min(d.dev, 12) + 1)
		if d.long && d.rng.IntN(2) == 0 {
			n = d.rng.IntN(d.dev + 1)
		}
		if d.many != nil && !d.long && d.rng.IntN(4) != 0 {
			n = 1
		}
		gpu := d.devicePages(n)
		meta := Meta{StoredLen: d.rng.Int64N(1000), Position: d.rng.Int64N(1000), Released: d.rng.Int64N(4)}
		if d.rng.IntN(40) == 0 {
			meta.Position = -1
		}
		got, err := d.s.Offload(rid, label, gpu, meta, nil)
		var want error
		free := d.m.capacity - d.m.used() - d.m.pendingPages()
		switch {
		case meta.Position < 0:
			want = poolerr.ErrBadSize
		case badDevice(gpu, d.dev) != nil:
			want = badDevice(gpu, d.dev)
		case d.m.find(rid, label) >= 0:
			want = poolerr.ErrDuplicateStream
		case n == 0:
			want = poolerr.ErrNoPages // the seed's False: nothing recorded
		case n > free+d.m.pendingPages():
			want = poolerr.ErrFull
		case n > free:
			want = poolerr.ErrPending
			var pe *PendingError
			if !errors.As(err, &pe) {
				d.fail("offload: %v, want *PendingError", err)
			}
			// The named ticket must be the oldest that makes room.
			have := free
			for _, r := range d.m.pending {
				have += len(r.pages)
				if have >= n {
					if pe.Ticket != r.ticket {
						d.fail("offload: pending ticket %d, want %d", pe.Ticket, r.ticket)
					}
					break
				}
			}
		}
		d.wantErr("offload", err, want)
		if want != nil {
			if len(got) != 0 {
				d.fail("failed offload returned pages %v", got)
			}
			return
		}
		if len(got) != n {
			d.fail("offload returned %d pages, want %d", len(got), n)
		}
		for _, p := range got {
			if p < 0 || int(p) >= d.m.capacity {
				d.fail("offload returned page %d outside [0, %d)", p, d.m.capacity)
			}
			if h, ok := d.m.held[p]; ok {
				d.fail("offload returned page %d, still held by %s", p, h)
			}
			d.m.held[p] = rid + "/" + label
		}
		d.m.streams[rid] = append(d.m.streams[rid], modelStream{label: label, pages: got, meta: meta})
	case 3, 4: // reload
		i := d.m.find(rid, label)
		n := d.rng.IntN(6)
		if d.long && d.rng.IntN(2) == 0 {
			n = d.rng.IntN(d.dev + 1)
		}
		if i >= 0 && d.rng.IntN(8) != 0 {
			n = len(d.m.streams[rid][i].pages)
		}
		gpu := d.devicePages(min(n, d.dev))
		got, err := d.s.Reload(rid, label, gpu, nil)
		var want error
		switch {
		case badDevice(gpu, d.dev) != nil:
			want = badDevice(gpu, d.dev)
		case i < 0:
			want = poolerr.ErrUnknownStream
		case len(gpu) != len(d.m.streams[rid][i].pages):
			want = poolerr.ErrPageCount
		}
		d.wantErr("reload", err, want)
		if want != nil {
			return
		}
		ms := d.m.streams[rid][i]
		if !slices.Equal(got.Pages, ms.pages) || got.Meta != ms.meta {
			d.fail("reload %s/%s = %v %+v, want %v %+v", rid, label, got.Pages, got.Meta, ms.pages, ms.meta)
		}
		if len(ms.pages) == 0 {
			if got.Ticket != 0 {
				d.fail("reload of an empty stream issued ticket %d", got.Ticket)
			}
		} else {
			d.m.issued++
			if got.Ticket != d.m.issued {
				d.fail("reload ticket %d, want %d", got.Ticket, d.m.issued)
			}
			d.m.pending = append(d.m.pending, modelRelease{ticket: got.Ticket, pages: ms.pages})
		}
		d.m.drop(rid, i)
	case 5: // discard
		i := d.m.find(rid, label)
		err := d.s.Discard(rid, label)
		if i < 0 {
			d.wantErr("discard of a missing stream (a no-op)", err, nil)
			return
		}
		d.wantErr("discard", err, nil)
		for _, p := range d.m.streams[rid][i].pages {
			delete(d.m.held, p)
		}
		d.m.drop(rid, i)
	case 6: // remove_request
		n, err := d.s.RemoveRequest(rid)
		d.wantErr("remove_request", err, nil)
		if n != len(d.m.streams[rid]) {
			d.fail("remove_request %s removed %d, want %d", rid, n, len(d.m.streams[rid]))
		}
		for _, s := range d.m.streams[rid] {
			for _, p := range s.pages {
				delete(d.m.held, p)
			}
		}
		delete(d.m.streams, rid)
	case 7, 8: // fence
		t := uint64(0)
		if d.m.issued > 0 {
			t = uint64(d.rng.IntN(int(d.m.issued))) + 1
		}
		if d.rng.IntN(15) == 0 {
			t = d.m.issued + 1 + uint64(d.rng.IntN(3))
			d.wantErr("fence", d.s.Fence(t), poolerr.ErrBadFence)
			return
		}
		d.wantErr("fence", d.s.Fence(t), nil)
		for len(d.m.pending) > 0 && d.m.pending[0].ticket <= t {
			for _, p := range d.m.pending[0].pages {
				delete(d.m.held, p)
			}
			d.m.pending = d.m.pending[1:]
		}
	case 9: // a misuse with a bad name
		_, err := d.s.Offload("", label, nil, Meta{}, nil)
		d.wantErr("offload with empty rid", err, poolerr.ErrBadName)
	}
}

// verify compares every query with the model and checks the invariants.
func (d *driver) verify() {
	d.t.Helper()
	for _, rid := range rids {
		var want []string
		for _, s := range d.m.streams[rid] {
			want = append(want, s.label)
		}
		if got := d.s.Labels(rid); !slices.Equal(got, want) {
			d.fail("labels(%s) = %q, want %q", rid, got, want)
		}
		if got := d.s.IsOffloaded(rid); got != (len(want) > 0) {
			d.fail("is_offloaded(%s) = %v", rid, got)
		}
		for _, label := range d.labelSet() {
			n, err := d.s.NumPages(rid, label)
			if i := d.m.find(rid, label); i >= 0 {
				if err != nil || n != len(d.m.streams[rid][i].pages) {
					d.fail("num_pages(%s, %s) = %d, %v; want %d", rid, label, n, err, len(d.m.streams[rid][i].pages))
				}
			} else if n != 0 || err != nil {
				d.fail("num_pages(%s, %s) of a missing stream = %d, %v; want 0, nil", rid, label, n, err)
			}
		}
	}
	if got, want := d.s.NumFreePages(), d.m.capacity-d.m.used(); got != want {
		d.fail("num_free_pages = %d, want %d", got, want)
	}
	u := d.s.Usage()
	if u.Pending != d.m.pendingPages() || u.Used != d.m.used() {
		d.fail("usage %+v, model used %d pending %d", u, d.m.used(), d.m.pendingPages())
	}
	if err := d.s.Check(); err != nil {
		d.fail("invariants: %v", err)
	}
}

func testPool(t testing.TB) *Pool {
	t.Helper()
	p := New()
	// Two GPUs on two NUMA nodes, chunks of 64 KiB.
	for gpu := range 2 {
		for i := range 4 {
			c := Chunk{ID: fmt.Sprintf("gpu%d-c%d", gpu, i), GPU: gpu, NUMA: gpu, Size: 64 << 10}
			if err := p.AddChunk(c); err != nil {
				t.Fatal(err)
			}
		}
	}
	return p
}

// TestModel runs long random sequences of every operation on several
// sessions at once, each checked step by step against the reference model.
// Run it with -race: the sessions share the pool.
func TestModel(t *testing.T) {
	steps := 4000
	if testing.Short() {
		steps = 500
	}
	for seed := range uint64(4) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			p := testPool(t)
			// Allocation A is a pod with two tensor-parallel ranks; B is another pod.
			must(t, p.Grant("A", []string{"gpu0-c0", "gpu0-c1", "gpu1-c0", "gpu1-c1"}))
			must(t, p.Grant("B", []string{"gpu0-c2", "gpu1-c2"}))
			specs := []struct {
				alloc string
				spec  Spec
			}{
				{"A", Spec{GPU: 0, PageSize: 4 << 10, DevicePages: 40, MaxPages: 20}},
				{"A", Spec{GPU: 1, PageSize: 8 << 10, DevicePages: 24, MaxPages: 0}},
				{"B", Spec{GPU: 1, PageSize: 16 << 10, DevicePages: 8, MaxPages: 3}},
			}
			var wg sync.WaitGroup
			for i, sp := range specs {
				s, err := p.Open(sp.alloc, sp.spec)
				if err != nil {
					t.Fatal(err)
				}
				d := &driver{t: t, rng: rand.New(rand.NewPCG(seed, uint64(i))), s: s,
					m: newModel(s.Capacity()), name: fmt.Sprintf("session %d", i), dev: sp.spec.DevicePages}
				if i == 0 && seed%2 == 1 {
					// Requests of up to 20 one-page streams: past indexFrom.
					for l := range 20 {
						d.many = append(d.many, fmt.Sprint("m", l))
					}
				}
				wg.Go(func() {
					for range steps {
						d.step()
						d.verify()
					}
				})
			}
			// Readers of the pool-wide state run alongside.
			stop := make(chan struct{})
			var reader sync.WaitGroup
			reader.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					p.Chunks()
					if err := p.Check(); err != nil {
						t.Error(err)
						return
					}
				}
			})
			wg.Wait()
			close(stop)
			reader.Wait()
			must(t, p.Check())
		})
	}
}

// TestModelRanks is TestModel for one container of four tensor-parallel
// ranks (GPUs 0-3 on two NUMA nodes) sharing one allocation whose eight
// chunks were all sized under GPU 0's name, beside a single-rank pod: each
// rank binds its part (two chunks, on its node where the allocation has
// them), is driven against its own model concurrently with the others, and
// now and then closes and reopens (a rank restarting), getting a fresh
// part of the same size while the other ranks keep theirs. Run it with
// -race.
func TestModelRanks(t *testing.T) {
	steps := 3000
	if testing.Short() {
		steps = 400
	}
	for seed := range uint64(3) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			n := newNode(t, 4, 2, 8)
			ids := append(n.free(0)[:6], n.free(1)[:2]...) // 6 on node 0, 2 on node 1
			must(t, n.p.Grant("tp", ids))
			must(t, n.p.Grant("solo", n.free(1)[:1]))
			gpus := []int{0, 1, 2, 3}
			var mu sync.Mutex // guards opening, so parts are taken one rank at a time
			open := func(r int) *Session {
				mu.Lock()
				defer mu.Unlock()
				s, err := n.p.OpenNear("tp", spec(gpus[r]), n.near(gpus, r))
				if err != nil {
					t.Error(err)
					return nil
				}
				if len(s.Chunks()) != 2 {
					t.Errorf("rank %d holds %d chunks, want 2", r, len(s.Chunks()))
				}
				return s
			}
			var wg sync.WaitGroup
			for r := range gpus {
				s := open(r)
				if s == nil {
					return
				}
				d := &driver{t: t, rng: rand.New(rand.NewPCG(seed, uint64(r))), s: s,
					m: newModel(s.Capacity()), name: fmt.Sprintf("rank %d", r), dev: 64}
				wg.Go(func() {
					for i := range steps {
						if i > 0 && d.rng.IntN(500) == 0 {
							n.p.Close(d.s)
							if d.s = open(r); d.s == nil {
								return
							}
							d.m = newModel(d.s.Capacity())
						}
						d.step()
						d.verify()
					}
				})
			}
			solo, err := n.p.OpenNear("solo", spec(3), Near{NUMA: 1, Ranks: 1})
			must(t, err)
			sd := &driver{t: t, rng: rand.New(rand.NewPCG(seed, 9)), s: solo, m: newModel(solo.Capacity()), name: "solo", dev: 64}
			wg.Go(func() {
				for range steps {
					sd.step()
					sd.verify()
				}
			})
			wg.Wait()
			must(t, n.p.Check())
			local := 0
			for _, s := range n.p.Sessions("tp") {
				local += s.Locality().Local
			}
			// The two node-1 ranks hold the two node-1 chunks; the node-0
			// ranks hold four of the six node-0 chunks: 6 local of 8.
			if local != 6 {
				t.Errorf("%d of the container's 8 chunks on their rank's node, want 6", local)
			}
		})
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestModelLong is TestModel with streams of up to every device page in a
// session of 2^18 host pages: long page chains, offloads that fill the pool,
// pending releases of tens of thousands of pages.
func TestModelLong(t *testing.T) {
	steps := 300
	if testing.Short() {
		steps = 60
	}
	for seed := range uint64(2) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			p := New()
			var ids []string
			for i := range 4 {
				id := fmt.Sprintf("big-c%d", i)
				must(t, p.AddChunk(Chunk{ID: id, GPU: 0, NUMA: 0, Size: 16 << 20}))
				ids = append(ids, id)
			}
			must(t, p.Grant("A", ids))
			spec := Spec{GPU: 0, PageSize: 256, DevicePages: 1<<17 + 3}
			s, err := p.Open("A", spec)
			must(t, err)
			if s.Capacity() != 1<<18 {
				t.Fatalf("capacity %d, want %d", s.Capacity(), 1<<18)
			}
			d := &driver{t: t, rng: rand.New(rand.NewPCG(seed, 99)), s: s, m: newModel(s.Capacity()),
				name: "long", dev: spec.DevicePages, long: true}
			if seed == 1 {
				for i := range 3 * indexFrom {
					d.many = append(d.many, fmt.Sprint("L", i))
				}
			}
			for range steps {
				d.step()
				d.verify()
			}
		})
	}
}

// TestLongStream offloads one stream of 1,000,000 pages into a session of
// 2^21 pages and reloads it: the pages come back in order, and every page
// index needs the widest varints (past 2^14 and 2^21 host pages).
func TestLongStream(t *testing.T) {
	p := New()
	var ids []string
	for i := range 8 {
		id := fmt.Sprintf("c%d", i)
		must(t, p.AddChunk(Chunk{ID: id, GPU: 3, NUMA: 0, Size: 64 << 20}))
		ids = append(ids, id)
	}
	must(t, p.Grant("A", ids))
	const n = 1_000_000
	s, err := p.Open("A", Spec{GPU: 3, PageSize: 256, DevicePages: n})
	must(t, err)
	if s.Capacity() != 1<<21 {
		t.Fatalf("capacity %d, want %d", s.Capacity(), 1<<21)
	}
	// Push the free list past 2^21 - n so that the long stream's pages
	// cross the 2^21 boundary.
	filler := make([]int32, n)
	for i := range filler {
		filler[i] = int32(i)
	}
	first, err := s.Offload("fill", "", filler, Meta{}, nil)
	must(t, err)
	gpu := make([]int32, n)
	for i := range gpu {
		gpu[i] = int32(n - 1 - i)
	}
	host, err := s.Offload("long", "kv", gpu, Meta{StoredLen: n * 16, Position: n * 16}, nil)
	must(t, err)
	if len(host) != n || host[n-1] < 1<<21-1-int32(len(first)) {
		t.Fatalf("offload returned %d pages ending at %d", len(host), host[len(host)-1])
	}
	if got, _ := s.NumPages("long", "kv"); got != n {
		t.Fatalf("num_pages %d, want %d", got, n)
	}
	must(t, s.Check())
	rl, err := s.Reload("long", "kv", gpu, nil)
	must(t, err)
	if !slices.Equal(rl.Pages, host) || rl.Meta.StoredLen != n*16 {
		t.Fatal("reload did not return the offloaded pages in order")
	}
	must(t, s.Fence(rl.Ticket))
	must(t, s.Check())
	if free := s.NumFreePages(); free != 1<<21-n {
		t.Fatalf("free %d, want %d", free, 1<<21-n)
	}
}

// TestManyStreamsOneRequest: 60,000 labels of one request stay in offload
// order through removals from the middle, and each lookup is by key (the
// benchmark BenchmarkOffloadManyLabels shows the cost does not grow).
func TestManyStreamsOneRequest(t *testing.T) {
	p := New()
	must(t, p.AddChunk(Chunk{ID: "c", GPU: 0, Size: 1 << 20}))
	must(t, p.Grant("A", []string{"c"}))
	s, err := p.Open("A", Spec{GPU: 0, PageSize: 4, DevicePages: 8})
	must(t, err)
	const n = 60000
	var want []string
	for i := range n {
		l := fmt.Sprint("l", i)
		_, err := s.Offload("r", l, []int32{int32(i % 8)}, Meta{}, nil)
		must(t, err)
		want = append(want, l)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		i := rng.IntN(len(want))
		if rng.IntN(2) == 0 {
			must(t, s.Discard("r", want[i]))
		} else {
			_, err := s.Reload("r", want[i], []int32{0}, nil)
			must(t, err)
		}
		want = slices.Delete(want, i, i+1)
	}
	if got := s.Labels("r"); !slices.Equal(got, want) {
		t.Fatalf("labels out of order after removals (%d labels, want %d)", len(got), len(want))
	}
	must(t, s.Check())
	if n, err := s.RemoveRequest("r"); err != nil || n != len(want) {
		t.Fatalf("remove_request = %d, %v; want %d", n, err, len(want))
	}
	must(t, s.Check())
}
