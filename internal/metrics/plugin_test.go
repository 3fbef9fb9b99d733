package metrics

import (
	"errors"
	"fmt"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/plugin"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/poolerr"
)

// The device plugin's operations and the failures of the plugin, reclaim
// and nodestatus components are counted, and each failure lands in the
// ring with the component, op and kind of its kvpool_errors_total series.
func TestPluginAndComponentErrors(t *testing.T) {
	m := New(pool.New(), Options{NoRuntime: true})
	m.InitPlugin()
	ring := report.NewRing(16)
	obs := observe.Multi(m, ring)
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()

	refused := &plugin.AllocateError{Result: plugin.ResultRefused, Err: errors.New("device gpu0-numa0-0 is unhealthy")}
	ops := []observe.Op{
		{Component: observe.ComponentPlugin, Name: observe.OpAllocate, Duration: time.Millisecond},
		{Component: observe.ComponentPlugin, Name: observe.OpAllocate, Duration: time.Second, Err: refused},
		{Component: observe.ComponentPlugin, Name: observe.OpRegister},
		{Component: observe.ComponentPlugin, Name: observe.OpRegister, Err: errors.New("kubelet.sock: connection refused")},
		{Component: observe.ComponentPlugin, Name: observe.OpReconcile, Err: fmt.Errorf("reconcile: %w", errors.New("pod resources list: deadline"))},
		{Component: observe.ComponentReclaim, Name: observe.OpPodGone, Allocation: "alloc-1"},
		{Component: observe.ComponentReclaim, Name: observe.OpReassigned, Allocation: "alloc-2"},
		{Component: observe.ComponentReclaim, Name: observe.OpReassigned, Err: fmt.Errorf("reclaim: %w", poolerr.ErrUnknownChunk)},
		{Component: observe.ComponentReclaim, Name: observe.OpRenew, Err: errors.New("chunk gpu0-numa0-1: mlock: ENOMEM")},
		{Component: observe.ComponentNodeStatus, Name: observe.OpWrite, Err: errors.New("update kvpoolnode n1 status: forbidden")},
	}
	for _, op := range ops {
		obs.Op(op)
	}
	fams := scrape(t, srv.URL)
	expect(t, fams, []check{
		{"kvpool_plugin_allocations_total", []string{"result", "ok"}, 1},
		{"kvpool_plugin_allocations_total", []string{"result", "refused"}, 1},
		{"kvpool_plugin_allocations_total", []string{"result", "invalid"}, 0},
		{"kvpool_plugin_allocate_duration_seconds", nil, 2},
		{"kvpool_plugin_registrations_total", []string{"result", "ok"}, 1},
		{"kvpool_plugin_registrations_total", []string{"result", "failed"}, 1},
		{"kvpool_plugin_reclaims_total", []string{"trigger", "pod_gone"}, 1},
		{"kvpool_plugin_reclaims_total", []string{"trigger", "reassigned"}, 1},
		{"kvpool_errors_total", []string{"component", "plugin", "op", "allocate", "kind", "refused"}, 1},
		{"kvpool_errors_total", []string{"component", "plugin", "op", "register", "kind", "other"}, 1},
		{"kvpool_errors_total", []string{"component", "plugin", "op", "reconcile", "kind", "other"}, 1},
		{"kvpool_errors_total", []string{"component", "reclaim", "op", "reassigned", "kind", "unknown_chunk"}, 1},
		{"kvpool_errors_total", []string{"component", "reclaim", "op", "renew", "kind", "other"}, 1},
		{"kvpool_errors_total", []string{"component", "nodestatus", "op", "write", "kind", "other"}, 1},
	})
	entries := ring.Entries()
	if len(entries) != 6 {
		t.Fatalf("ring has %d entries, want the 6 failures: %+v", len(entries), entries)
	}
	for _, e := range entries {
		if v, ok := value(fams, "kvpool_errors_total", "component", e.Component, "op", e.Op, "kind", e.Kind); !ok || v != 1 {
			t.Errorf("ring entry %s/%s/%s has no kvpool_errors_total series of its own (%v)", e.Component, e.Op, e.Kind, v)
		}
	}
	if entries[0].Message != refused.Error() {
		t.Errorf("ring message %q, want %q", entries[0].Message, refused.Error())
	}
}

// InitPlugin exports every result the plugin can report.
func TestInitPluginCoversResults(t *testing.T) {
	if !slices.Equal(PluginAllocateResults, plugin.AllocateResults) {
		t.Errorf("metrics export results %v, the plugin reports %v", PluginAllocateResults, plugin.AllocateResults)
	}
	if !slices.Equal(PluginReclaimTriggers, []string{plugin.ReclaimPodGone, plugin.ReclaimReassigned, plugin.ReclaimUnprepared}) {
		t.Errorf("reclaim triggers %v", PluginReclaimTriggers)
	}
}
