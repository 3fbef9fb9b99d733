package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvpool/kvpool/internal/report"
)

// Restart registers the gauges of what the agent took over from the keeper
// at start: chunks adopted and chunks allocated fresh, and the last gap in
// service. f is read at scrape time; it returns nil when there is no keeper
// (the gauges are then absent).
func (m *Metrics) Restart(f func() *report.Restart) {
	metric := func(kind prometheus.ValueType) func(name, help string, v func(r *report.Restart) float64) prometheus.Collector {
		return func(name, help string, v func(r *report.Restart) float64) prometheus.Collector {
			return &restartGauge{desc: prometheus.NewDesc(prometheus.BuildFQName(Namespace, "", name), help, nil, nil), f: f, v: v, kind: kind}
		}
	}
	gauge, counter := metric(prometheus.GaugeValue), metric(prometheus.CounterValue)
	m.reg.MustRegister(
		gauge("chunks_adopted", "Chunks this agent adopted from the keeper at start: the previous agent's memory, not pinned again.",
			func(r *report.Restart) float64 { return float64(r.AdoptedChunks) }),
		gauge("chunks_fresh", "Chunks this agent allocated and pinned itself.",
			func(r *report.Restart) float64 { return float64(r.FreshChunks) }),
		gauge("restart_gap_seconds", "How long the pool went unserved before this agent started serving: from the previous agent's last sign of life (0 on a first start).",
			func(r *report.Restart) float64 { return r.LastGapSeconds }),
		gauge("chunks_locked_by_keeper", "Chunks whose lock the keeper holds: the agent maps none of them, so its restart waits for no unmapping of them.",
			func(r *report.Restart) float64 { return float64(r.KeeperLockedChunks) }),
		gauge("keeper_connected", "1 while the keeper holds the pool and its books; 0 while it is lost (changes are refused, the agent reconnects).",
			func(r *report.Restart) float64 { return b2f(r.KeeperConnected) }),
		counter("keeper_losses_total", "Keeper connections this agent lost (the keeper exited, or did not answer within its deadline).",
			func(r *report.Restart) float64 { return float64(r.KeeperLosses) }),
		gauge("pool_lost_at_start", "1 when at this agent's start the keeper held none of the pool an earlier agent had kept in it (its sessions and streams are gone).",
			func(r *report.Restart) float64 { return b2f(r.PoolLost) }),
		gauge("books_log_bytes", "Bytes of the books' memfd in use: its 4 KiB header, the snapshot and the records after it (a restart replays them all).",
			func(r *report.Restart) float64 { return float64(r.BooksLogBytes) }),
		gauge("books_snapshot_bytes", "Bytes of the books' last snapshot.",
			func(r *report.Restart) float64 { return float64(r.BooksSnapshotBytes) }),
		counter("books_compactions_total", "Compactions of the books since this agent started.",
			func(r *report.Restart) float64 { return float64(r.BooksCompactions) }),
		&restoreSteps{desc: prometheus.NewDesc(prometheus.BuildFQName(Namespace, "", "restore_step_seconds"),
			"How long each step of the restore at this agent's start took, before it served: warm (the heap made resident), load (the books replayed), adopt (the kept chunks), rebuild (the pool's tables), books (the wait for the fresh books memfd). Absent when nothing was restored.",
			[]string{"step"}, nil), f: f},
		gauge("books_compaction_hold_seconds_max", "The longest one compaction of the books held every session's changes up since this agent started (a compaction runs beside them: only its last copy and the hand-over to the keeper hold them).",
			func(r *report.Restart) float64 { return r.BooksLongestHoldSeconds }),
	)
}

// RestartsInPlace registers kvpool_agent_restarts_in_place_total: n, the
// restarts of a dead agent by its supervisor in this container before this
// agent (restartInPlace; 0 where there is none). A counter: it only grows
// until the container restarts.
func (m *Metrics) RestartsInPlace(n int) {
	c := prometheus.NewCounter(prometheus.CounterOpts{Namespace: Namespace, Name: "agent_restarts_in_place_total",
		Help: "Restarts of a dead agent by the supervisor in its container (restartInPlace) before this agent: crashes that kubelet's restart count does not show."})
	c.Add(float64(n))
	m.reg.MustRegister(c)
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

type restartGauge struct {
	desc *prometheus.Desc
	f    func() *report.Restart
	v    func(*report.Restart) float64
	kind prometheus.ValueType
}

func (g *restartGauge) Describe(ch chan<- *prometheus.Desc) { ch <- g.desc }

func (g *restartGauge) Collect(ch chan<- prometheus.Metric) {
	if r := g.f(); r != nil {
		ch <- prometheus.MustNewConstMetric(g.desc, g.kind, g.v(r))
	}
}

// restoreSteps exports report.RestoreSteps, one series a step.
type restoreSteps struct {
	desc *prometheus.Desc
	f    func() *report.Restart
}

func (c *restoreSteps) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *restoreSteps) Collect(ch chan<- prometheus.Metric) {
	r := c.f()
	if r == nil || r.Restore == nil {
		return
	}
	s := r.Restore
	for _, step := range []struct {
		name string
		v    float64
	}{{"spare", s.SpareSeconds}, {"warm", s.WarmSeconds}, {"load", s.LoadSeconds}, {"adopt", s.AdoptSeconds}, {"rebuild", s.RebuildSeconds}, {"books", s.BooksSeconds}} {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, step.v, step.name)
	}
}
