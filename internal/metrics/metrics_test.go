package metrics

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/poolerr"
)

const (
	mib      = 1 << 20
	pageSize = 64 << 10
)

// scrape fetches url over real HTTP and parses the text exposition.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("GET %s: %s: %s", url, resp.Status, b)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse exposition: %v", err)
	}
	return fams
}

// value returns the value of the series of name whose labels include want
// (given as name, value pairs), and whether there is one.
func value(fams map[string]*dto.MetricFamily, name string, want ...string) (float64, bool) {
	f, ok := fams[name]
	if !ok {
		return 0, false
	}
next:
	for _, m := range f.GetMetric() {
		have := map[string]string{}
		for _, l := range m.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		for i := 0; i+1 < len(want); i += 2 {
			if have[want[i]] != want[i+1] {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount()), true
		}
	}
	return 0, false
}

type check struct {
	name   string
	labels []string
	want   float64
}

func expect(t *testing.T, fams map[string]*dto.MetricFamily, checks []check) {
	t.Helper()
	for _, c := range checks {
		got, ok := value(fams, c.name, c.labels...)
		if !ok {
			t.Errorf("%s%v: no such series", c.name, c.labels)
			continue
		}
		if got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
}

// server stands in for the socket server: it runs each call against a real
// pool session and reports it the way internal/server does.
type server struct {
	obs observe.Observer
	s   *pool.Session
}

func (sv *server) call(name string, pages int, f func() error) error {
	start := time.Now()
	err := f()
	op := observe.Op{Name: name, GPU: sv.s.Spec().GPU, Session: sv.s.Allocation(), Duration: time.Since(start), Err: err}
	if err == nil {
		op.Pages = pages
		if name == observe.OpOffload || name == observe.OpReload {
			op.Bytes = int64(pages) * sv.s.Spec().PageSize
		}
	}
	sv.obs.Op(op)
	return err
}

func (sv *server) offload(rid, label string, gpuPages ...int32) error {
	return sv.call(observe.OpOffload, len(gpuPages), func() error {
		_, err := sv.s.Offload(rid, label, gpuPages, pool.Meta{StoredLen: int64(len(gpuPages))}, nil)
		return err
	})
}

func (sv *server) reload(rid, label string, gpuPages ...int32) (uint64, error) {
	var r pool.Reloaded
	err := sv.call(observe.OpReload, len(gpuPages), func() (err error) {
		r, err = sv.s.Reload(rid, label, gpuPages, nil)
		return err
	})
	return r.Ticket, err
}

func pages(from, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(from + i)
	}
	return out
}

func testPool(t *testing.T) *pool.Pool {
	t.Helper()
	p := pool.New()
	for _, c := range []pool.Chunk{
		{ID: "gpu0-numa0-0", GPU: 0, NUMA: 0, Size: mib},
		{ID: "gpu0-numa0-1", GPU: 0, NUMA: 0, Size: mib},
		{ID: "gpu0-numa0-2", GPU: 0, NUMA: 0, Size: mib},
		{ID: "gpu0-numa0-3", GPU: 0, NUMA: 0, Size: mib},
		{ID: "gpu1-numa1-0", GPU: 1, NUMA: 1, Size: mib},
		{ID: "gpu1-numa1-1", GPU: 1, NUMA: 1, Size: mib},
	} {
		if err := p.AddChunk(c); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

func TestScrapeAfterWorkload(t *testing.T) {
	p := testPool(t)
	m := New(p, Options{Targets: func() map[int]int64 { return map[int]int64{0: 8 * mib, 1: 2 * mib} }})
	ring := report.NewRing(8)
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()

	// Before any pod: everything ready and free, nothing else.
	expect(t, scrape(t, srv.URL), []check{
		{"kvpool_pool_ready_bytes", []string{"gpu", "0"}, 4 * mib},
		{"kvpool_pool_target_bytes", []string{"gpu", "0"}, 8 * mib},
		{"kvpool_pool_allocation_progress_ratio", []string{"gpu", "0"}, 0.5},
		{"kvpool_pool_allocation_progress_ratio", []string{"gpu", "1"}, 1},
		{"kvpool_chunks", []string{"gpu", "0", "state", "free"}, 4},
		{"kvpool_pool_allocated_bytes", []string{"gpu", "0"}, 0},
		{"kvpool_sessions", []string{"gpu", "0"}, 0},
	})

	// Kubelet grants chunks to three pods; one pod goes away.
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(p.Grant("podA", []string{"gpu0-numa0-0", "gpu0-numa0-1"}))
	must(p.Grant("podB", []string{"gpu1-numa1-0"}))
	must(p.Grant("podC", []string{"gpu0-numa0-2"}))
	_, err := p.Revoke("podC")
	must(err)

	s, err := p.Open("podA", pool.Spec{GPU: 0, PageSize: pageSize, DevicePages: 1000})
	must(err)
	sv := &server{obs: observe.Multi(m, ring), s: s}
	// 32 pages: three offloads of 4, 3 and 5 pages succeed.
	must(sv.offload("r1", "a", pages(0, 4)...))
	must(sv.offload("r1", "b", pages(4, 3)...))
	must(sv.offload("r2", "a", pages(10, 5)...))
	// Reload r1/a (pending until fenced), discard r1/b.
	ticket, err := sv.reload("r1", "a", pages(0, 4)...)
	must(err)
	must(sv.call(observe.OpDiscard, 3, func() error { return s.Discard("r1", "b") }))
	// A request that does not fit is rejected, not an error.
	if err := sv.offload("r3", "a", pages(100, 40)...); !errors.Is(err, poolerr.ErrFull) {
		t.Fatalf("big offload: %v, want ErrFull", err)
	}
	// Misuse: a duplicate stream and an unknown one.
	if err := sv.offload("r2", "a", pages(20, 1)...); !errors.Is(err, poolerr.ErrDuplicateStream) {
		t.Fatalf("duplicate offload: %v", err)
	}
	if _, err := sv.reload("nope", "a", pages(0, 1)...); !errors.Is(err, poolerr.ErrUnknownStream) {
		t.Fatalf("unknown reload: %v", err)
	}
	m.ChunkPinned(0, 120*time.Millisecond)
	m.ChunkPinned(0, 80*time.Millisecond)
	pinErr := errors.New("mlock: cannot allocate memory")
	m.ChunkPinFailed(1, pinErr)
	observe.Report(sv.obs, observe.ComponentAllocation, observe.OpPin, pinErr)
	m.PoolFilled(1, 3*time.Second)
	m.FirstChunk(1, 250*time.Millisecond)
	m.PinRate(0, 3*mib, 2*time.Second)
	m.PinRate(-1, mib, time.Second)
	m.PinRate(-1, 2*mib, 0) // no time yet: no rate, the last one stays

	fams := scrape(t, srv.URL)
	expect(t, fams, []check{
		{"kvpool_offloads_total", []string{"gpu", "0"}, 3},
		{"kvpool_reloads_total", []string{"gpu", "0"}, 1},
		{"kvpool_discards_total", []string{"gpu", "0"}, 1},
		{"kvpool_offload_rejects_total", []string{"gpu", "0", "reason", "full"}, 1},
		{"kvpool_pages_moved_total", []string{"gpu", "0", "direction", "offload"}, 12},
		{"kvpool_pages_moved_total", []string{"gpu", "0", "direction", "reload"}, 4},
		{"kvpool_client_copied_bytes_total", []string{"gpu", "0", "direction", "offload"}, 12 * pageSize},
		{"kvpool_client_copied_bytes_total", []string{"gpu", "0", "direction", "reload"}, 4 * pageSize},
		{"kvpool_errors_total", []string{"component", "server", "op", "offload", "kind", "duplicate_stream"}, 1},
		{"kvpool_errors_total", []string{"component", "server", "op", "reload", "kind", "unknown_stream"}, 1},
		{"kvpool_errors_total", []string{"component", "allocation", "op", "pin", "kind", "other"}, 1},
		{"kvpool_server_op_duration_seconds", []string{"op", "offload"}, 5},
		{"kvpool_server_op_duration_seconds", []string{"op", "reload"}, 2},
		{"kvpool_server_op_duration_seconds", []string{"op", "discard"}, 1},
		{"kvpool_chunk_pin_seconds", []string{"gpu", "0"}, 2},
		{"kvpool_chunk_pin_failures_total", []string{"gpu", "1"}, 1},
		{"kvpool_pool_fill_seconds", []string{"gpu", "1"}, 3},
		{"kvpool_pool_first_chunk_seconds", []string{"gpu", "1"}, 0.25},
		{"kvpool_pool_pin_bytes_per_second", []string{"numa", "0"}, 1.5 * mib},
		{"kvpool_pool_pin_bytes_per_second", []string{"numa", "-1"}, mib},

		{"kvpool_pool_ready_bytes", []string{"gpu", "0"}, 4 * mib},
		{"kvpool_pool_ready_bytes", []string{"gpu", "1"}, 2 * mib},
		{"kvpool_pool_allocated_bytes", []string{"gpu", "0"}, 2 * mib},
		{"kvpool_pool_allocated_bytes", []string{"gpu", "1"}, mib},
		{"kvpool_pool_used_bytes", []string{"gpu", "0"}, 5 * pageSize},
		{"kvpool_pool_used_bytes", []string{"gpu", "1"}, 0},
		{"kvpool_chunks", []string{"gpu", "0", "state", "free"}, 1},
		{"kvpool_chunks", []string{"gpu", "0", "state", "granted"}, 2},
		{"kvpool_chunks", []string{"gpu", "0", "state", "dirty"}, 1},
		{"kvpool_chunks", []string{"gpu", "1", "state", "granted"}, 1},
		{"kvpool_chunks_bound", []string{"gpu", "0"}, 2},
		{"kvpool_chunks_bound", []string{"gpu", "1"}, 0},
		{"kvpool_sessions", []string{"gpu", "0"}, 1},
		{"kvpool_streams", []string{"gpu", "0"}, 1},
		{"kvpool_requests", []string{"gpu", "0"}, 1},
		{"kvpool_session_pages", []string{"gpu", "0", "state", "used"}, 5},
		{"kvpool_session_pages", []string{"gpu", "0", "state", "pending"}, 4},
		{"kvpool_session_pages", []string{"gpu", "0", "state", "available"}, 23},
	})
	if _, ok := value(fams, "kvpool_offload_rejects_total", "reason", "pending"); ok {
		t.Error("a pending reject was counted, none happened")
	}
	if _, ok := value(fams, "go_goroutines"); !ok {
		t.Error("runtime collector missing")
	}
	// The ring holds the two misuses and the pin failure (the same
	// component, op and kind as in kvpool_errors_total), not the full-pool
	// reject.
	if got := ring.Entries(); len(got) != 3 || got[0].Kind != "duplicate_stream" || got[1].Kind != "unknown_stream" || got[0].Session != "podA" ||
		got[2].Component != "allocation" || got[2].Op != "pin" || got[2].Kind != "other" {
		t.Errorf("recent errors = %+v", got)
	}

	// The collector reads the pool at scrape time: fencing frees the pending
	// pages and closing the session empties it, with no metric call at all.
	must(s.Fence(ticket))
	expect(t, scrape(t, srv.URL), []check{
		{"kvpool_session_pages", []string{"gpu", "0", "state", "pending"}, 0},
		{"kvpool_session_pages", []string{"gpu", "0", "state", "available"}, 27},
	})
	p.Close(s)
	_, err = p.Revoke("podA")
	must(err)
	expect(t, scrape(t, srv.URL), []check{
		{"kvpool_sessions", []string{"gpu", "0"}, 0},
		{"kvpool_pool_used_bytes", []string{"gpu", "0"}, 0},
		{"kvpool_pool_allocated_bytes", []string{"gpu", "0"}, 0},
		{"kvpool_chunks", []string{"gpu", "0", "state", "dirty"}, 3},
	})
}

func TestRejectReasons(t *testing.T) {
	p := testPool(t)
	if err := p.Grant("a", []string{"gpu1-numa1-0"}); err != nil {
		t.Fatal(err)
	}
	s, err := p.Open("a", pool.Spec{GPU: 1, PageSize: mib / 4, DevicePages: 16})
	if err != nil {
		t.Fatal(err)
	}
	m := New(p, Options{NoRuntime: true})
	sv := &server{obs: m, s: s}
	if err := sv.offload("r", "x", pages(0, 4)...); err != nil {
		t.Fatal(err)
	}
	if _, err := sv.reload("r", "x", pages(0, 4)...); err != nil {
		t.Fatal(err)
	}
	// All four pages are pending release: an offload of 2 must wait.
	var pe *pool.PendingError
	if err := sv.offload("q", "x", pages(0, 2)...); !errors.As(err, &pe) {
		t.Fatalf("offload behind pending reload: %v, want *PendingError", err)
	}
	if err := sv.offload("q", "x", pages(0, 5)...); !errors.Is(err, poolerr.ErrFull) {
		t.Fatalf("oversized offload: %v", err)
	}
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	fams := scrape(t, srv.URL)
	expect(t, fams, []check{
		{"kvpool_offload_rejects_total", []string{"gpu", "1", "reason", "pending"}, 1},
		{"kvpool_offload_rejects_total", []string{"gpu", "1", "reason", "full"}, 1},
	})
	if _, ok := fams["kvpool_errors_total"]; ok {
		t.Error("rejects were counted as errors")
	}
	if _, ok := fams["go_goroutines"]; ok {
		t.Error("NoRuntime still registered the Go collector")
	}
	if _, ok := fams["kvpool_pool_target_bytes"]; ok {
		t.Error("target exported without a plan")
	}
}

func TestInitGPU(t *testing.T) {
	m := New(pool.New(), Options{NoRuntime: true})
	m.InitGPU(2)
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	fams := scrape(t, srv.URL)
	expect(t, fams, []check{
		{"kvpool_offloads_total", []string{"gpu", "2"}, 0},
		{"kvpool_reloads_total", []string{"gpu", "2"}, 0},
		{"kvpool_discards_total", []string{"gpu", "2"}, 0},
		{"kvpool_offload_rejects_total", []string{"gpu", "2", "reason", "full"}, 0},
		{"kvpool_offload_rejects_total", []string{"gpu", "2", "reason", "pending"}, 0},
		{"kvpool_pages_moved_total", []string{"gpu", "2", "direction", "reload"}, 0},
		{"kvpool_client_copied_bytes_total", []string{"gpu", "2", "direction", "offload"}, 0},
		{"kvpool_chunk_pin_failures_total", []string{"gpu", "2"}, 0},
	})
	if _, ok := value(fams, "kvpool_offloads_total", "gpu", "0"); ok {
		t.Error("series for a GPU never initialised")
	}
}

// A GPU that has a plan but no chunk yet shows up with zero ready bytes.
func TestProgressBeforeFirstChunk(t *testing.T) {
	m := New(pool.New(), Options{NoRuntime: true, Targets: func() map[int]int64 { return map[int]int64{3: 4 * mib} }})
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	expect(t, scrape(t, srv.URL), []check{
		{"kvpool_pool_allocation_progress_ratio", []string{"gpu", "3"}, 0},
		{"kvpool_pool_ready_bytes", []string{"gpu", "3"}, 0},
		{"kvpool_pool_target_bytes", []string{"gpu", "3"}, 4 * mib},
	})
}

// Metric values are consistent under concurrent operations and scrapes.
func TestConcurrentOpsAndScrapes(t *testing.T) {
	p := testPool(t)
	if err := p.Grant("a", []string{"gpu0-numa0-0", "gpu0-numa0-1"}); err != nil {
		t.Fatal(err)
	}
	m := New(p, Options{NoRuntime: true})
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	const workers, rounds = 2, 200
	done := make(chan error, workers)
	for w := range workers {
		s, err := p.Open("a", pool.Spec{GPU: 0, PageSize: pageSize, DevicePages: 64, MaxPages: 16})
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			sv := &server{obs: m, s: s}
			for i := range rounds {
				rid := fmt.Sprintf("w%d-%d", w, i)
				if err := sv.offload(rid, "l", pages(0, 4)...); err != nil {
					done <- err
					return
				}
				tk, err := sv.reload(rid, "l", pages(0, 4)...)
				if err == nil {
					err = s.Fence(tk)
				}
				if err != nil {
					done <- err
					return
				}
			}
			done <- nil
		}()
	}
	for range 5 {
		scrape(t, srv.URL)
	}
	for range workers {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	expect(t, scrape(t, srv.URL), []check{
		{"kvpool_offloads_total", []string{"gpu", "0"}, workers * rounds},
		{"kvpool_pages_moved_total", []string{"gpu", "0", "direction", "reload"}, workers * rounds * 4},
		{"kvpool_session_pages", []string{"gpu", "0", "state", "available"}, workers * 16},
	})
}

// A session's chunks on other NUMA nodes than its GPU's count by node
// pair; chunks on the GPU's node, or where a node is unknown, do not.
func TestCrossNUMAChunks(t *testing.T) {
	m := New(pool.New(), Options{NoRuntime: true})
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	m.SessionBound(3, 1, []int{1, 0, 0, -1})
	m.SessionBound(3, 1, []int{2})
	m.SessionBound(0, -1, []int{0, 1})
	m.SessionBound(5, 0, []int{0, 0})
	fams := scrape(t, srv.URL)
	for _, c := range []check{
		{"kvpool_cross_numa_chunks_total", []string{"gpu", "3", "gpu_numa", "1", "chunk_numa", "0"}, 2},
		{"kvpool_cross_numa_chunks_total", []string{"gpu", "3", "gpu_numa", "1", "chunk_numa", "2"}, 1},
	} {
		if got, ok := value(fams, c.name, c.labels...); !ok || got != c.want {
			t.Errorf("%s%v = %v (present %v), want %v", c.name, c.labels, got, ok, c.want)
		}
	}
	if n := len(fams["kvpool_cross_numa_chunks_total"].GetMetric()); n != 2 {
		t.Errorf("%d series, want 2 (no series for local or unknown nodes)", n)
	}
}
