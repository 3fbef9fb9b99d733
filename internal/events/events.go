// Package events posts Kubernetes Events on the agent's Node for what an
// operator must notice: the pool becoming ready, huge pages falling back to
// small pages, chunks going unhealthy and recovering, chunks reclaimed
// from pods that are gone, the keeper lost and back, the pool lost, and
// an agent restarted in place.
package events

import (
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/record"

	"github.com/kvpool/kvpool/internal/bytesize"
	"github.com/kvpool/kvpool/internal/logging"
)

// Event reasons, stable for alerting and `kubectl get events --field-selector reason=...`.
const (
	ReasonPoolReady         = "KVPoolReady"
	ReasonHugePagesFallback = "KVPoolHugePagesFallback"
	ReasonChunkUnhealthy    = "KVPoolChunkUnhealthy"
	ReasonChunkRecovered    = "KVPoolChunkRecovered"
	ReasonChunksReclaimed   = "KVPoolChunksReclaimed"
	ReasonKeeperLost        = "KVPoolKeeperLost"
	ReasonKeeperReconnected = "KVPoolKeeperReconnected"
	ReasonPoolLost          = "KVPoolLost"
	ReasonRestartedInPlace  = "KVPoolAgentRestartedInPlace"
)

// Component is the event source the agent reports as.
const Component = "kvpool-agent"

// Events are the Node events the agent posts. Methods never block on the
// API server.
type Events interface {
	// PoolReady: every planned chunk is ready.
	PoolReady(bytes int64, chunks int, took time.Duration)
	// HugePagesFallback: huge pages were wanted but not available, so the
	// pool uses 4 KiB pages (slower pinning, more TLB pressure).
	HugePagesFallback(reason string)
	ChunkUnhealthy(id, reason string)
	ChunkRecovered(id string)
	// ChunksReclaimed: the pod holding chunks is gone, and its chunks were
	// taken back (and will be scrubbed) after the grace period.
	ChunksReclaimed(pod string, chunks []string)
	// KeeperLost: the keeper no longer holds the pool (it exited, or does
	// not answer); changes are refused until a keeper holds it again.
	KeeperLost(reason string)
	// KeeperReconnected: a keeper holds the pool again (the agent handed
	// it every chunk and the books), after the loss lasted for.
	KeeperReconnected(chunks int, after time.Duration)
	// PoolLost: at start the keeper held none of the pool an earlier agent
	// had kept in it: its sessions and streams are gone.
	PoolLost(chunks, sessions int)
	// RestartedInPlace: the agent before this one died (lastExit) and the
	// supervisor in its container started this one, the restarts-th such
	// restart there: the pod's restart count does not show it.
	RestartedInPlace(lastExit string, restarts int)
}

// Nop posts nothing; for standalone mode and tests.
var Nop Events = nop{}

type nop struct{}

func (nop) PoolReady(int64, int, time.Duration)  {}
func (nop) HugePagesFallback(string)             {}
func (nop) ChunkUnhealthy(string, string)        {}
func (nop) ChunkRecovered(string)                {}
func (nop) ChunksReclaimed(string, []string)     {}
func (nop) KeeperLost(string)                    {}
func (nop) KeeperReconnected(int, time.Duration) {}
func (nop) PoolLost(int, int)                    {}
func (nop) RestartedInPlace(string, int)         {}

// NodeRef is the reference events about node name are attached to. Kubelet
// uses the node name as the UID of its node events; pass the Node's real UID
// when known so that `kubectl describe node` finds them either way.
func NodeRef(name string, uid types.UID) *corev1.ObjectReference {
	if uid == "" {
		uid = types.UID(name)
	}
	return &corev1.ObjectReference{Kind: "Node", Name: name, UID: uid}
}

// recorder posts through a record.EventRecorder.
type recorder struct {
	rec record.EventRecorder
	ref *corev1.ObjectReference
}

// New posts events on node through rec.
func New(rec record.EventRecorder, node *corev1.ObjectReference) Events {
	return &recorder{rec: rec, ref: node}
}

// NewBroadcaster starts a broadcaster that writes to sink (in the agent:
// &typedcorev1.EventSinkImpl{Interface: clientset.CoreV1().Events("")}) and
// returns Events on node and a function that flushes and stops it.
// Repeated events are aggregated by the broadcaster as usual.
func NewBroadcaster(sink record.EventSink, node *corev1.ObjectReference) (Events, func()) {
	b := record.NewBroadcaster()
	b.StartRecordingToSink(sink)
	rec := b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: Component, Host: node.Name})
	return New(rec, node), b.Shutdown
}

func (r *recorder) PoolReady(bytes int64, chunks int, took time.Duration) {
	r.rec.Eventf(r.ref, corev1.EventTypeNormal, ReasonPoolReady,
		"host KV pool ready: %s in %d chunks, allocated and pinned in %s", bytesize.Exact(bytes), chunks, took.Round(time.Millisecond))
}

func (r *recorder) HugePagesFallback(reason string) {
	r.rec.Eventf(r.ref, corev1.EventTypeWarning, ReasonHugePagesFallback,
		"huge pages unavailable (%s); the pool uses 4 KiB pages", reason)
}

func (r *recorder) ChunkUnhealthy(id, reason string) {
	r.rec.Eventf(r.ref, corev1.EventTypeWarning, ReasonChunkUnhealthy, "chunk %s unhealthy: %s", id, reason)
}

func (r *recorder) ChunkRecovered(id string) {
	r.rec.Eventf(r.ref, corev1.EventTypeNormal, ReasonChunkRecovered, "chunk %s healthy again", id)
}

func (r *recorder) ChunksReclaimed(pod string, chunks []string) {
	r.rec.Eventf(r.ref, corev1.EventTypeNormal, ReasonChunksReclaimed,
		"reclaimed %d chunks of pod %s, which is gone: %s", len(chunks), pod, logging.ListIDs(chunks, 8, ", "))
}

func (r *recorder) KeeperLost(reason string) {
	r.rec.Eventf(r.ref, corev1.EventTypeWarning, ReasonKeeperLost,
		"keeper lost (%s): changes to sessions are refused (clients retry) until a keeper holds the pool again; the agent holds it meanwhile and reconnects", reason)
}

func (r *recorder) KeeperReconnected(chunks int, after time.Duration) {
	r.rec.Eventf(r.ref, corev1.EventTypeNormal, ReasonKeeperReconnected,
		"a keeper holds the pool again (%d chunks and the books handed over, %s after the loss): nothing was lost", chunks, after.Round(time.Millisecond))
}

func (r *recorder) PoolLost(chunks, sessions int) {
	r.rec.Eventf(r.ref, corev1.EventTypeWarning, ReasonPoolLost,
		"the keeper lost the pool an earlier agent had kept in it (%d chunks, about %d sessions): those sessions and streams are gone; the pool is allocated fresh", chunks, sessions)
}

func (r *recorder) RestartedInPlace(lastExit string, restarts int) {
	r.rec.Eventf(r.ref, corev1.EventTypeWarning, ReasonRestartedInPlace,
		"the agent died (%s) and its container's supervisor started it again at once (restart in place %d in this container; the pod's restart count does not show it)", lastExit, restarts)
}
