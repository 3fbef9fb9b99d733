package metrics

import (
	"encoding/json"
	"errors"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/pool"
)

const dashboardPath = "../../charts/kvpool/dashboards/kvpool-dashboard.json"

// exported runs a workload that touches every metric and returns each series
// name the agent exports (histograms as _bucket, _sum and _count) with its
// label names.
func exported(t *testing.T) map[string][]string {
	t.Helper()
	p := testPool(t)
	if err := p.Grant("a", []string{"gpu0-numa0-0"}); err != nil {
		t.Fatal(err)
	}
	s, err := p.Open("a", pool.Spec{GPU: 0, PageSize: mib / 4, DevicePages: 16})
	if err != nil {
		t.Fatal(err)
	}
	m := New(p, Options{Targets: func() map[int]int64 { return map[int]int64{0: 4 * mib} }})
	sv := &server{obs: m, s: s}
	_ = sv.offload("r", "x", pages(0, 4)...)
	_, _ = sv.reload("r", "x", pages(0, 4)...)
	_ = sv.offload("q", "x", pages(0, 2)...) // pending
	_ = sv.offload("q", "x", pages(0, 9)...) // full
	_ = sv.call(observe.OpDiscard, 0, func() error { return s.Discard("q", "x") })
	_ = sv.offload("d", "x", pages(0, 0)...)
	_ = sv.call(observe.OpDiscard, 0, func() error { return s.Discard("d", "x") })
	m.ChunkPinned(0, time.Second)
	m.ChunkPinFailed(0, errors.New("mlock"))
	m.PoolFilled(0, time.Second)
	m.InitPlugin()
	m.Restart(func() *report.Restart { return &report.Restart{AdoptedChunks: 1} }) // an agent with a keeper

	fams, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	for _, f := range fams {
		var labels []string
		for _, mt := range f.GetMetric() {
			for _, l := range mt.GetLabel() {
				if !slices.Contains(labels, l.GetName()) {
					labels = append(labels, l.GetName())
				}
			}
		}
		name := f.GetName()
		if f.GetType() == dto.MetricType_HISTOGRAM {
			out[name+"_bucket"] = append(slices.Clone(labels), "le")
			out[name+"_sum"] = labels
			out[name+"_count"] = labels
			continue
		}
		out[name] = labels
	}
	for _, want := range []string{"kvpool_offload_rejects_total", "kvpool_discards_total", "kvpool_errors_total", "kvpool_pool_fill_seconds"} {
		if _, ok := out[want]; !ok {
			t.Fatalf("workload did not produce %s", want)
		}
	}
	return out
}

// queries returns every PromQL string in the dashboard: panel targets and
// template variable queries.
func queries(v any) []string {
	var out []string
	switch v := v.(type) {
	case map[string]any:
		for k, x := range v {
			if s, ok := x.(string); ok && (k == "expr" || k == "definition" || (k == "query" && strings.Contains(s, "("))) {
				out = append(out, s)
			}
			out = append(out, queries(x)...)
		}
	case []any:
		for _, x := range v {
			out = append(out, queries(x)...)
		}
	}
	return out
}

var (
	metricName = regexp.MustCompile(`\b(kvpool|process|go)_[a-z0-9_]+\b`)
	byClause   = regexp.MustCompile(`\bby \(([^)]*)\)`)
)

func TestDashboardQueriesNameExportedMetrics(t *testing.T) {
	b, err := os.ReadFile(dashboardPath)
	if err != nil {
		t.Fatal(err)
	}
	var dash map[string]any
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("%s: %v", dashboardPath, err)
	}
	exp := exported(t)
	qs := queries(dash)
	if len(qs) < 10 {
		t.Fatalf("found only %d queries in the dashboard", len(qs))
	}
	used := map[string]bool{}
	for _, q := range qs {
		names := metricName.FindAllString(q, -1)
		if len(names) == 0 {
			t.Errorf("query names no agent metric: %s", q)
		}
		var labels []string
		for _, n := range names {
			l, ok := exp[n]
			if !ok {
				t.Errorf("query uses %s, which the agent does not export: %s", n, q)
			}
			used[strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(n, "_bucket"), "_sum"), "_count")] = true
			labels = append(labels, l...)
		}
		// Labels grouped by must exist on the metrics (instance and job are
		// added by Prometheus at scrape time).
		for _, m := range byClause.FindAllStringSubmatch(q, -1) {
			for _, l := range strings.Split(m[1], ",") {
				l = strings.TrimSpace(l)
				if l != "instance" && l != "job" && !slices.Contains(labels, l) {
					t.Errorf("query groups by %q, a label none of %v has: %s", l, names, q)
				}
			}
		}
	}
	// Every kvpool metric is on the dashboard somewhere.
	for n := range exp {
		base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(n, "_bucket"), "_sum"), "_count")
		if strings.HasPrefix(base, "kvpool_") && !used[base] {
			t.Errorf("%s is exported but not on the dashboard", base)
		}
	}
}
