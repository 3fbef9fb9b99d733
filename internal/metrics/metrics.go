// Package metrics exports the agent's Prometheus metrics on its own registry.
//
// Pool state (bytes, chunks, sessions, streams, pages) is read from the pool
// at scrape time by a collector, so it can never drift from the pool's own
// bookkeeping. Events (operations, rejects, errors, pinning) are counted as
// they happen: the socket server reports each operation through the
// observe.Observer that *Metrics implements.
package metrics

import (
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/pkg/observe"
)

// Namespace prefixes every metric name.
const Namespace = "kvpool"

// Options configures New.
type Options struct {
	// Targets returns the bytes sizing planned per GPU; nil when unknown.
	Targets func() map[int]int64
	// Now is the clock; defaults to time.Now.
	Now func() time.Time
	// NoRuntime leaves out the Go runtime and process collectors.
	NoRuntime bool
}

// Metrics holds the agent's metrics. Its methods are safe for concurrent use.
type Metrics struct {
	reg *prometheus.Registry

	opDuration  *prometheus.HistogramVec
	offloads    *prometheus.CounterVec
	reloads     *prometheus.CounterVec
	discards    *prometheus.CounterVec
	rejects     *prometheus.CounterVec
	pagesMoved  *prometheus.CounterVec
	clientBytes *prometheus.CounterVec
	errors      *prometheus.CounterVec
	limits      *prometheus.CounterVec
	pinSeconds  *prometheus.HistogramVec
	pinFailures *prometheus.CounterVec
	renewSecs   *prometheus.HistogramVec
	renewFails  *prometheus.CounterVec
	fillSeconds *prometheus.GaugeVec
	firstChunk  *prometheus.GaugeVec
	pinRate     *prometheus.GaugeVec
	crossNUMA   *prometheus.CounterVec

	// The device plugin's (observe.Op with Component "plugin" or "reclaim").
	allocations   *prometheus.CounterVec
	allocateSecs  prometheus.Histogram
	registrations *prometheus.CounterVec
	reclaims      *prometheus.CounterVec

	// The DRA driver's (observe.Op with Component "dra"; InitDRA
	// registers them).
	draOps                           *prometheus.CounterVec
	draPrepareSecs, draUnprepareSecs prometheus.Histogram

	// Series the hot path uses, resolved once: WithLabelValues hashes its
	// labels on every call.
	opSeries  sync.Map // op name -> prometheus.Observer
	gpuSeries sync.Map // gpu int -> *gpuCounters
}

type gpuCounters struct {
	offloads, reloads, discards prometheus.Counter
	pagesOffload, pagesReload   prometheus.Counter
	bytesOffload, bytesReload   prometheus.Counter
}

func (m *Metrics) opHist(name string) prometheus.Observer {
	if h, ok := m.opSeries.Load(name); ok {
		return h.(prometheus.Observer)
	}
	h, _ := m.opSeries.LoadOrStore(name, m.opDuration.WithLabelValues(name))
	return h.(prometheus.Observer)
}

func (m *Metrics) gpu(gpu int) *gpuCounters {
	if c, ok := m.gpuSeries.Load(gpu); ok {
		return c.(*gpuCounters)
	}
	g := gpuLabel(gpu)
	c, _ := m.gpuSeries.LoadOrStore(gpu, &gpuCounters{
		offloads:     m.offloads.WithLabelValues(g),
		reloads:      m.reloads.WithLabelValues(g),
		discards:     m.discards.WithLabelValues(g),
		pagesOffload: m.pagesMoved.WithLabelValues(g, "offload"),
		pagesReload:  m.pagesMoved.WithLabelValues(g, "reload"),
		bytesOffload: m.clientBytes.WithLabelValues(g, "offload"),
		bytesReload:  m.clientBytes.WithLabelValues(g, "reload"),
	})
	return c.(*gpuCounters)
}

// New registers the metrics for src on a fresh registry.
func New(src report.Source, opts Options) *Metrics {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	m := &Metrics{reg: prometheus.NewRegistry()}
	m.initServer()
	m.initChunks()
	m.initPlugin()
	m.draOps, m.draPrepareSecs, m.draUnprepareSecs = newDRAMetrics()
	m.reg.MustRegister(m.opDuration, m.offloads, m.reloads, m.discards, m.rejects, m.pagesMoved,
		m.clientBytes, m.errors, m.limits, m.pinSeconds, m.pinFailures, m.renewSecs, m.renewFails, m.fillSeconds, m.firstChunk, m.pinRate, m.crossNUMA,
		m.allocations, m.allocateSecs, m.registrations, m.reclaims,
		newPoolCollector(src, opts.Targets, opts.Now))
	if !opts.NoRuntime {
		m.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	return m
}

// counterVec and gaugeVec make a kvpool_<name> series by labels.
func counterVec(name, help string, labels ...string) *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: name, Help: help}, labels)
}

func gaugeVec(name, help string, labels ...string) *prometheus.GaugeVec {
	return prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: name, Help: help}, labels)
}

// initServer makes the socket server's metrics: operations and what they
// moved, refusals and errors.
func (m *Metrics) initServer() {
	m.opDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace, Subsystem: "server", Name: "op_duration_seconds",
		Help: "Time the agent spent serving one socket operation, by operation.",
		// 5 µs to about 0.75 s.
		Buckets: prometheus.ExponentialBuckets(5e-6, 2.5, 14),
	}, []string{"op"})
	m.offloads = counterVec("offloads_total", "Streams offloaded to host pages (successful offload calls).", "gpu")
	m.reloads = counterVec("reloads_total", "Streams reloaded from host pages (successful reload calls).", "gpu")
	m.discards = counterVec("discards_total", "Offloaded streams discarded after an aborted offload.", "gpu")
	m.rejects = counterVec("offload_rejects_total",
		"Offloads refused because the session's pool could not hold every page (reason full), or could only after a pending reload is fenced (reason pending).",
		"gpu", "reason")
	m.pagesMoved = counterVec("pages_moved_total", "Host pages handed out by offloads or returned by reloads.", "gpu", "direction")
	m.clientBytes = counterVec("client_copied_bytes_total",
		"Bytes clients copied between GPU and host pages: host pages offloaded or reloaded times the session's host page size.",
		"gpu", "direction")
	m.errors = counterVec("errors_total",
		"Errors by component, operation and kind (full-pool rejects are not errors; see kvpool_offload_rejects_total).",
		"component", "op", "kind")
	m.limits = counterVec("limit_rejects_total",
		"Connections and requests the socket server refused by a per-tenant bound, a bad token, a resume by another process, or a temporary accept failure, by reason.",
		"reason")
	m.crossNUMA = counterVec("cross_numa_chunks_total",
		"Chunks bound by new sessions on another NUMA node than the session's GPU (their copies cross the socket interconnect), by GPU, the GPU's node and the chunk's.",
		"gpu", "gpu_numa", "chunk_numa")
}

// initChunks makes the metrics of the pool's memory: pinning at start,
// renewals, and how soon each GPU served.
func (m *Metrics) initChunks() {
	// 10 ms to about 40 s.
	chunkBuckets := prometheus.ExponentialBuckets(0.01, 2, 13)
	m.pinSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "chunk_pin_seconds",
		Help:    "Time to allocate, pre-fault and lock one chunk at start (its own Alloc; NUMA nodes pin side by side).",
		Buckets: chunkBuckets,
	}, []string{"gpu"})
	m.pinFailures = counterVec("chunk_pin_failures_total", "Chunks that could not be allocated, pre-faulted or locked.", "gpu")
	m.renewSecs = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "chunk_renew_seconds",
		Help:    "Time to replace a reclaimed chunk with fresh memory (drop the old, allocate, bind, pre-fault, lock and seal the new).",
		Buckets: chunkBuckets,
	}, []string{"gpu"})
	m.renewFails = counterVec("chunk_renew_failures_total",
		"Failed attempts to replace a reclaimed chunk (the chunk stays unhealthy and is retried).", "gpu")
	m.fillSeconds = gaugeVec("pool_fill_seconds",
		"Seconds from agent start until the GPU's pool reached its planned size; absent until it has.", "gpu")
	m.firstChunk = gaugeVec("pool_first_chunk_seconds",
		"Seconds from the start of the pool's allocation until the GPU's first chunk was in the pool (the GPU serves from then on); absent until it is.",
		"gpu")
	m.pinRate = gaugeVec("pool_pin_bytes_per_second",
		"Bytes pinned at start on the NUMA node (-1: unbound chunks) over the seconds since the allocation started, as of its latest chunk.",
		"numa")
}

// initPlugin makes the device plugin's metrics.
func (m *Metrics) initPlugin() {
	plugin := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Subsystem: "plugin", Name: name, Help: help}, labels)
	}
	m.allocations = plugin("allocations_total", "Kubelet's Allocate calls by result: ok, invalid, refused, unavailable, failed.", "result")
	m.allocateSecs = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: Namespace, Subsystem: "plugin", Name: "allocate_duration_seconds",
		Help: "Time the device plugin spent answering one Allocate, PodResources calls and chunk renewals included.",
		// 100 µs to about 105 s.
		Buckets: prometheus.ExponentialBuckets(1e-4, 2, 21),
	})
	m.registrations = plugin("registrations_total", "Registrations of the device plugin with kubelet by result: ok, failed.", "result")
	m.reclaims = plugin("reclaims_total",
		"Allocations taken back, by trigger: pod_gone (no pod held it for the grace period), reassigned (kubelet gave its devices to another pod), unprepared (kubelet unprepared the ResourceClaim it served).",
		"trigger")
}

// Registry is the registry the metrics live on; add more collectors to it.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler serves the registry in the Prometheus exposition formats.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

func gpuLabel(gpu int) string {
	if gpu < 0 {
		return "unknown"
	}
	return strconv.Itoa(gpu)
}

// Op counts one operation; *Metrics is an observe.Observer. Socket calls
// (no Component) count by op and GPU; the device plugin's by result or
// trigger; every failure, whoever reports it, counts in
// kvpool_errors_total{component, op, kind} with the kind report.Kind gives,
// which is the kind the error ring shows.
func (m *Metrics) Op(op observe.Op) {
	if op.Component != "" && op.Component != observe.ComponentServer {
		m.componentOp(op)
		return
	}
	m.opHist(op.Name).Observe(op.Duration.Seconds())
	if op.Err != nil {
		kind := report.Kind(op.Err)
		if report.Rejected(op.Err) && op.Name == observe.OpOffload {
			m.rejects.WithLabelValues(gpuLabel(op.GPU), kind).Inc()
			return
		}
		m.errors.WithLabelValues(observe.ComponentServer, op.Name, kind).Inc()
		return
	}
	switch op.Name {
	case observe.OpOffload:
		c := m.gpu(op.GPU)
		c.offloads.Inc()
		c.pagesOffload.Add(float64(op.Pages))
		if op.Bytes > 0 {
			c.bytesOffload.Add(float64(op.Bytes))
		}
	case observe.OpReload:
		c := m.gpu(op.GPU)
		c.reloads.Inc()
		c.pagesReload.Add(float64(op.Pages))
		if op.Bytes > 0 {
			c.bytesReload.Add(float64(op.Bytes))
		}
	case observe.OpDiscard:
		m.gpu(op.GPU).discards.Inc()
	}
}

func (m *Metrics) componentOp(op observe.Op) {
	switch {
	case op.Component == observe.ComponentPlugin && op.Name == observe.OpAllocate:
		result := "ok"
		if op.Err != nil {
			result = report.Kind(op.Err)
		}
		m.allocations.WithLabelValues(result).Inc()
		m.allocateSecs.Observe(op.Duration.Seconds())
	case op.Component == observe.ComponentPlugin && op.Name == observe.OpRegister:
		result := "ok"
		if op.Err != nil {
			result = "failed"
		}
		m.registrations.WithLabelValues(result).Inc()
	case op.Component == observe.ComponentReclaim && op.Err == nil &&
		(op.Name == observe.OpPodGone || op.Name == observe.OpReassigned || op.Name == observe.OpUnprepared):
		m.reclaims.WithLabelValues(op.Name).Inc()
	case op.Component == observe.ComponentDRA:
		m.draOp(op)
	}
	if op.Err != nil {
		m.errors.WithLabelValues(op.Component, op.Name, report.Kind(op.Err)).Inc()
	}
}

// PluginAllocateResults and PluginReclaimTriggers are the label values
// InitPlugin exports from zero (plugin.AllocateResults; the reclaim
// operations).
var (
	PluginAllocateResults = []string{"ok", "invalid", "refused", "unavailable", "failed"}
	PluginReclaimTriggers = []string{observe.OpPodGone, observe.OpReassigned, observe.OpUnprepared}
)

// InitPlugin creates the device plugin's counter series at zero; the agent
// calls it when it runs the plugin.
func (m *Metrics) InitPlugin() {
	for _, r := range PluginAllocateResults {
		m.allocations.WithLabelValues(r)
	}
	for _, r := range []string{"ok", "failed"} {
		m.registrations.WithLabelValues(r)
	}
	for _, t := range PluginReclaimTriggers {
		m.reclaims.WithLabelValues(t)
	}
}

// LimitRejected counts one refusal of the socket server by reason
// (server.Hooks.Refused): kvpool_limit_rejects_total.
func (m *Metrics) LimitRejected(reason string) {
	m.limits.WithLabelValues(reason).Inc()
}

// InitLimitRejects creates the kvpool_limit_rejects_total series of every
// reason at zero (the agent passes server.RefusalReasons).
func (m *Metrics) InitLimitRejects(reasons []string) {
	for _, r := range reasons {
		m.limits.WithLabelValues(r)
	}
}

// ChunkPinned records one chunk made ready at start, and how long it took.
func (m *Metrics) ChunkPinned(gpu int, d time.Duration) {
	m.pinSeconds.WithLabelValues(gpuLabel(gpu)).Observe(d.Seconds())
}

// ChunkPinFailed counts a chunk that could not be made ready. The error
// itself goes to kvpool_errors_total and the ring through the observer
// (observe.Report, component "allocation", op "pin").
func (m *Metrics) ChunkPinFailed(gpu int, err error) {
	m.pinFailures.WithLabelValues(gpuLabel(gpu)).Inc()
}

// ChunkRenewed records a reclaimed chunk replaced by fresh memory in d.
func (m *Metrics) ChunkRenewed(gpu int, d time.Duration) {
	m.renewSecs.WithLabelValues(gpuLabel(gpu)).Observe(d.Seconds())
}

// ChunkRenewFailed counts a failed replacement of a reclaimed chunk. The
// error itself the device plugin reports (component "reclaim", op "renew").
func (m *Metrics) ChunkRenewFailed(gpu int, err error) {
	m.renewFails.WithLabelValues(gpuLabel(gpu)).Inc()
}

// PoolFilled records that gpu's pool reached its planned size d after start.
func (m *Metrics) PoolFilled(gpu int, d time.Duration) {
	m.fillSeconds.WithLabelValues(gpuLabel(gpu)).Set(d.Seconds())
}

// FirstChunk records that gpu's first chunk was in the pool d after the
// allocation started.
func (m *Metrics) FirstChunk(gpu int, d time.Duration) {
	m.firstChunk.WithLabelValues(gpuLabel(gpu)).Set(d.Seconds())
}

// PinRate records the start's pinning rate on a NUMA node (-1: unbound
// chunks): bytes pinned there in d since the allocation started.
func (m *Metrics) PinRate(numa int, bytes int64, d time.Duration) {
	if d <= 0 {
		return
	}
	m.pinRate.WithLabelValues(strconv.Itoa(numa)).Set(float64(bytes) / d.Seconds())
}

// SessionBound counts the chunks a new session on gpu (whose NUMA node is
// gpuNUMA) bound on other NUMA nodes than its GPU's, in
// kvpool_cross_numa_chunks_total by node pair; chunks on the GPU's node,
// or where a node is unknown, are not counted.
func (m *Metrics) SessionBound(gpu, gpuNUMA int, chunkNUMA []int) {
	for _, n := range chunkNUMA {
		if n >= 0 && gpuNUMA >= 0 && n != gpuNUMA {
			m.crossNUMA.WithLabelValues(gpuLabel(gpu), strconv.Itoa(gpuNUMA), strconv.Itoa(n)).Inc()
		}
	}
}

// InitGPU creates gpu's counter series at zero, so that they are exported
// (and rate() sees their first increase) before the first operation.
func (m *Metrics) InitGPU(gpu int) {
	g := gpuLabel(gpu)
	m.gpu(gpu)
	for _, r := range []string{"full", "pending"} {
		m.rejects.WithLabelValues(g, r)
	}
	m.pinFailures.WithLabelValues(g)
	m.renewFails.WithLabelValues(g)
}
