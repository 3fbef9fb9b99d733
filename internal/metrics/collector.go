package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvpool/kvpool/internal/report"
)

// poolCollector reads the pool at scrape time.
type poolCollector struct {
	src     report.Source
	targets func() map[int]int64
	now     func() time.Time

	target, ready, allocated, used, progress *prometheus.Desc
	chunks, bound                            *prometheus.Desc
	sessions, streams, requests, pages       *prometheus.Desc
}

func newPoolCollector(src report.Source, targets func() map[int]int64, now func() time.Time) *poolCollector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(Namespace, "", name), help, append([]string{"gpu"}, labels...), nil)
	}
	return &poolCollector{
		src: src, targets: targets, now: now,
		target:    d("pool_target_bytes", "Bytes sizing planned for the GPU's pool."),
		ready:     d("pool_ready_bytes", "Bytes of chunks allocated, pinned and held by the pool (free, granted or awaiting scrub)."),
		allocated: d("pool_allocated_bytes", "Bytes of chunks granted to pods."),
		used:      d("pool_used_bytes", "Bytes of host pages holding offloaded streams, for sessions serving the GPU."),
		progress:  d("pool_allocation_progress_ratio", "Ready bytes over planned bytes, from 0 to 1; absent without a plan."),
		chunks:    d("chunks", "Chunks by state: free (scrubbed, unallocated), granted (held by a pod), dirty (released, awaiting scrub).", "state"),
		bound:     d("chunks_bound", "Granted chunks bound to an open session."),
		sessions:  d("sessions", "Open client sessions serving the GPU."),
		streams:   d("streams", "Offloaded streams held by sessions serving the GPU."),
		requests:  d("requests", "Requests with at least one offloaded stream."),
		pages:     d("session_pages", "Host pages of open sessions by state: used (holding streams), pending (released by a reload, awaiting its fence), available.", "state"),
	}
}

func (c *poolCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.target, c.ready, c.allocated, c.used, c.progress,
		c.chunks, c.bound, c.sessions, c.streams, c.requests, c.pages} {
		ch <- d
	}
}

func (c *poolCollector) Collect(ch chan<- prometheus.Metric) {
	var targets map[int]int64
	if c.targets != nil {
		targets = c.targets()
	}
	snap := report.Take(c.src, targets, c.now())
	g := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	for _, p := range snap.GPUs {
		gpu := gpuLabel(p.Index)
		if p.TargetBytes > 0 {
			g(c.target, float64(p.TargetBytes), gpu)
			g(c.progress, min(float64(p.ReadyBytes)/float64(p.TargetBytes), 1), gpu)
		}
		g(c.ready, float64(p.ReadyBytes), gpu)
		g(c.allocated, float64(p.AllocatedBytes), gpu)
		g(c.used, float64(p.UsedBytes), gpu)
		g(c.chunks, float64(p.Chunks.Free), gpu, "free")
		g(c.chunks, float64(p.Chunks.Granted), gpu, "granted")
		g(c.chunks, float64(p.Chunks.Dirty), gpu, "dirty")
		g(c.bound, float64(p.Chunks.Bound), gpu)
		g(c.sessions, float64(p.Sessions), gpu)
		g(c.streams, float64(p.Streams), gpu)
		g(c.requests, float64(p.Requests), gpu)
		g(c.pages, float64(p.PagesUsed), gpu, "used")
		g(c.pages, float64(p.PagesPending), gpu, "pending")
		g(c.pages, float64(p.PagesTotal-p.PagesUsed-p.PagesPending), gpu, "available")
	}
}
