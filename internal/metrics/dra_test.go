package metrics

import (
	"errors"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/plugin"
	"github.com/kvpool/kvpool/pkg/pool"
)

// The DRA driver's Prepares and Unprepares are counted by result and
// timed; a failure also counts in kvpool_errors_total and lands in the
// ring; the prepared claims and each one's bytes and chunks are read at
// scrape time, so a claim's series leaves with its Unprepare.
func TestDRAMetrics(t *testing.T) {
	m := New(pool.New(), Options{NoRuntime: true})
	var mu sync.Mutex
	claims := []report.Claim{{Namespace: "ns", Name: "a", Chunks: 3, Bytes: 3 << 30}, {Namespace: "ns", Name: "b", Chunks: 1, Bytes: 1 << 30}}
	m.InitDRA(func() []report.Claim { mu.Lock(); defer mu.Unlock(); return claims })
	ring := report.NewRing(8)
	obs := observe.Multi(m, ring)
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	full := &plugin.AllocateError{Result: plugin.ResultUnavailable, Err: errors.New("GPU 0 has 1 free chunks, the share needs 2")}
	for _, op := range []observe.Op{
		{Component: observe.ComponentDRA, Name: observe.OpPrepare, Duration: 3 * time.Millisecond},
		{Component: observe.ComponentDRA, Name: observe.OpPrepare, Duration: time.Millisecond, Err: full},
		{Component: observe.ComponentDRA, Name: observe.OpUnprepare, Duration: time.Millisecond},
		{Component: observe.ComponentDRA, Name: observe.OpPublish, Err: errors.New("create resource slice: forbidden")},
		{Component: observe.ComponentReclaim, Name: observe.OpUnprepared, Allocation: "alloc-1"},
	} {
		obs.Op(op)
	}
	m.InitPlugin()
	expect(t, scrape(t, srv.URL), []check{
		{"kvpool_dra_operations_total", []string{"op", "prepare", "result", "ok"}, 1},
		{"kvpool_dra_operations_total", []string{"op", "prepare", "result", "unavailable"}, 1},
		{"kvpool_dra_operations_total", []string{"op", "unprepare", "result", "ok"}, 1},
		{"kvpool_dra_prepare_duration_seconds", nil, 2},
		{"kvpool_dra_unprepare_duration_seconds", nil, 1},
		{"kvpool_dra_prepared_claims", nil, 2},
		{"kvpool_dra_claim_bytes", []string{"namespace", "ns", "claim", "a"}, 3 << 30},
		{"kvpool_dra_claim_chunks", []string{"namespace", "ns", "claim", "b"}, 1},
		{"kvpool_plugin_reclaims_total", []string{"trigger", "unprepared"}, 1},
		{"kvpool_errors_total", []string{"component", "dra", "op", "prepare", "kind", "unavailable"}, 1},
		{"kvpool_errors_total", []string{"component", "dra", "op", "publish", "kind", "other"}, 1},
	})
	if n := len(ring.Entries()); n != 2 {
		t.Errorf("ring holds %d entries, want the 2 failures", n)
	}
	mu.Lock()
	claims = claims[1:]
	mu.Unlock()
	fams := scrape(t, srv.URL)
	if _, ok := value(fams, "kvpool_dra_claim_bytes", "claim", "a"); ok {
		t.Error("claim a's series outlived its Unprepare")
	}
	if v, _ := value(fams, "kvpool_dra_prepared_claims"); v != 1 {
		t.Errorf("prepared claims %v, want 1", v)
	}
}
