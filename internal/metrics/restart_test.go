package metrics

import (
	"maps"
	"testing"

	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/pkg/pool"
)

func TestRestartGauges(t *testing.T) {
	var r *report.Restart
	m := New(pool.New(), Options{NoRuntime: true})
	m.Restart(func() *report.Restart { return r })
	values := func() map[string]float64 {
		fams, err := m.Registry().Gather()
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]float64{}
		for _, f := range fams {
			for _, x := range f.GetMetric() {
				if g := x.GetGauge(); g != nil && len(x.GetLabel()) == 0 {
					out[f.GetName()] = g.GetValue()
				}
			}
		}
		return out
	}
	if v := values(); len(v) != 0 {
		if _, ok := v["kvpool_chunks_adopted"]; ok {
			t.Fatalf("restart gauges without a keeper: %v", v)
		}
	}
	r = &report.Restart{AdoptedChunks: 6, FreshChunks: 2, LastGapSeconds: 0.25, KeeperLockedChunks: 5,
		BooksLogBytes: 3 << 20, BooksSnapshotBytes: 1 << 20, BooksLongestHoldSeconds: 0.004}
	v := values()
	if v["kvpool_chunks_adopted"] != 6 || v["kvpool_chunks_fresh"] != 2 || v["kvpool_restart_gap_seconds"] != 0.25 || v["kvpool_chunks_locked_by_keeper"] != 5 {
		t.Fatalf("restart gauges %v", v)
	}
	if _, ok := v["kvpool_restore_step_seconds"]; ok {
		t.Fatalf("restore steps without a restore: %v", v)
	}
	if steps := stepValues(t, m); len(steps) != 0 {
		t.Fatalf("restore steps without a restore: %v", steps)
	}
	r.Restore = &report.RestoreSteps{SpareSeconds: 0.0007, WarmSeconds: 0.013, LoadSeconds: 0.084, AdoptSeconds: 0.0001, RebuildSeconds: 0.041, BooksSeconds: 0.002}
	want := map[string]float64{"spare": 0.0007, "warm": 0.013, "load": 0.084, "adopt": 0.0001, "rebuild": 0.041, "books": 0.002}
	if steps := stepValues(t, m); !maps.Equal(steps, want) {
		t.Fatalf("restore steps %v, want %v", steps, want)
	}
	if v["kvpool_books_log_bytes"] != 3<<20 || v["kvpool_books_snapshot_bytes"] != 1<<20 || v["kvpool_books_compaction_hold_seconds_max"] != 0.004 {
		t.Fatalf("books gauges %v", v)
	}
}

// stepValues is kvpool_restore_step_seconds by step.
func stepValues(t *testing.T, m *Metrics) map[string]float64 {
	t.Helper()
	fams, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range fams {
		if f.GetName() != "kvpool_restore_step_seconds" {
			continue
		}
		for _, x := range f.GetMetric() {
			if l := x.GetLabel(); len(l) == 1 && l[0].GetName() == "step" {
				out[l[0].GetValue()] = x.GetGauge().GetValue()
			}
		}
	}
	return out
}
