package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/pkg/observe"
)

// DRA operation results (kvpool_dra_operations_total{op, result}): "ok",
// or the kind of the error (report.Kind: invalid, refused, unavailable,
// failed, ...).

// InitDRA registers the DRA driver's metrics: the prepared claims and each
// one's bytes, read from claims at scrape time (so a claim's series goes
// with its Unprepare), and the Prepare and Unprepare counters and
// durations, which the driver reports through the observer (component
// "dra"). The agent calls it when it runs the driver.
func (m *Metrics) InitDRA(claims func() []report.Claim) {
	m.reg.MustRegister(m.draOps, m.draPrepareSecs, m.draUnprepareSecs, &claimCollector{claims: claims,
		count: prometheus.NewDesc(prometheus.BuildFQName(Namespace, "dra", "prepared_claims"),
			"ResourceClaims the DRA driver has prepared on this node.", nil, nil),
		bytes: prometheus.NewDesc(prometheus.BuildFQName(Namespace, "dra", "claim_bytes"),
			"Host KV bytes a prepared ResourceClaim holds.", []string{"namespace", "claim"}, nil),
		chunks: prometheus.NewDesc(prometheus.BuildFQName(Namespace, "dra", "claim_chunks"),
			"Chunks a prepared ResourceClaim holds.", []string{"namespace", "claim"}, nil),
	})
	for _, op := range []string{observe.OpPrepare, observe.OpUnprepare} {
		m.draOps.WithLabelValues(op, "ok")
	}
}

func newDRAMetrics() (*prometheus.CounterVec, prometheus.Histogram, prometheus.Histogram) {
	ops := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Subsystem: "dra", Name: "operations_total",
		Help: "Claims kubelet asked the DRA driver to prepare or unprepare, by operation and result (ok, or the error's kind).",
	}, []string{"op", "result"})
	hist := func(name, help string) prometheus.Histogram {
		return prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: Namespace, Subsystem: "dra", Name: name, Help: help,
			// 100 µs to about 105 s: a Prepare may renew chunks.
			Buckets: prometheus.ExponentialBuckets(1e-4, 2, 21),
		})
	}
	return ops,
		hist("prepare_duration_seconds", "Time the DRA driver spent preparing one claim (the grant, chunk renewals and its CDI spec)."),
		hist("unprepare_duration_seconds", "Time the DRA driver spent unpreparing one claim (the revoke and its CDI spec's removal).")
}

// draOp counts one of the driver's operations.
func (m *Metrics) draOp(op observe.Op) {
	result := "ok"
	if op.Err != nil {
		result = report.Kind(op.Err)
	}
	switch op.Name {
	case observe.OpPrepare:
		m.draOps.WithLabelValues(op.Name, result).Inc()
		m.draPrepareSecs.Observe(op.Duration.Seconds())
	case observe.OpUnprepare:
		m.draOps.WithLabelValues(op.Name, result).Inc()
		m.draUnprepareSecs.Observe(op.Duration.Seconds())
	}
}

type claimCollector struct {
	claims               func() []report.Claim
	count, bytes, chunks *prometheus.Desc
}

func (c *claimCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.count
	ch <- c.bytes
	ch <- c.chunks
}

func (c *claimCollector) Collect(ch chan<- prometheus.Metric) {
	claims := c.claims()
	ch <- prometheus.MustNewConstMetric(c.count, prometheus.GaugeValue, float64(len(claims)))
	for _, cl := range claims {
		ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.GaugeValue, float64(cl.Bytes), cl.Namespace, cl.Name)
		ch <- prometheus.MustNewConstMetric(c.chunks, prometheus.GaugeValue, float64(cl.Chunks), cl.Namespace, cl.Name)
	}
}
