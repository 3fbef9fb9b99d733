// Package observe is the seam between the components that do work (the
// socket server, the device plugin, start-up) and the ones that watch it
// (metrics, the recent-errors ring). It has no dependencies, so a component
// reports what it did without importing Prometheus.
package observe

import (
	"sync"
	"time"
)

// Operation names the server reports. Metrics count offloads, reloads,
// discards and full-pool rejects by these names; any other name is timed and
// counted as a generic operation.
const (
	OpHello         = "hello"
	OpOpen          = "open"
	OpOffload       = "offload"
	OpReload        = "reload"
	OpFence         = "fence"
	OpDiscard       = "discard"
	OpRemoveRequest = "remove_request"
	OpNumPages      = "num_pages"
	OpClose         = "close"
)

// Operation names of the other components (Op.Component set).
const (
	OpAllocate   = "allocate"   // plugin: kubelet's Allocate
	OpRegister   = "register"   // plugin: a registration with kubelet
	OpReconcile  = "reconcile"  // plugin: allocations checked against PodResources
	OpCheckpoint = "checkpoint" // plugin: the checkpoint could not be read
	OpPodGone    = "pod_gone"   // reclaim: no pod held the allocation for the grace period
	OpReassigned = "reassigned" // reclaim: kubelet gave the allocation's devices to another pod
	OpUnprepared = "unprepared" // reclaim: kubelet unprepared the ResourceClaim the allocation served (DRA)
	OpPrepare    = "prepare"    // dra: kubelet's NodePrepareResources, one claim
	OpUnprepare  = "unprepare"  // dra: kubelet's NodeUnprepareResources, one claim
	OpPublish    = "publish"    // dra: the ResourceSlices published (their controller's errors)
	OpRenew      = "renew"      // reclaim: fresh memory put behind a reclaimed chunk
	OpPin        = "pin"        // allocation: a chunk allocated, pre-faulted and locked at start
	OpWrite      = "write"      // nodestatus: the KVPoolNode status written
)

// Components that report operations. The socket server leaves
// Op.Component empty (it means ComponentServer).
const (
	ComponentServer     = "server"     // socket calls
	ComponentPlugin     = "plugin"     // the device plugin: allocate, register, reconcile, checkpoint
	ComponentReclaim    = "reclaim"    // reclaims of allocations and renewals of their chunks
	ComponentAllocation = "allocation" // chunks allocated and pinned at start ("pin")
	ComponentNodeStatus = "nodestatus" // writes of the KVPoolNode status ("write")
	ComponentDRA        = "dra"        // the DRA driver: prepare, unprepare, publish
)

// Op is one completed operation.
type Op struct {
	// Component is who did it: "" (the socket server) or one of the
	// Component* constants.
	Component  string
	Name       string        // one of the Op* constants, or another stable name
	GPU        int           // GPU the session serves; -1 when none applies
	Session    string        // the session's identity for the error log; may be empty
	Allocation string        // the pool allocation the call was for; may be empty
	Duration   time.Duration // time the agent spent serving the call
	Pages      int           // host pages the call offloaded, reloaded or discarded
	Bytes      int64         // bytes the client reports it copied for this call
	Err        error         // nil on success
}

// Observer receives completed operations. Implementations must be safe for
// concurrent use and must not block: Op is called on the hot path.
type Observer interface {
	Op(Op)
}

// Nop discards every operation. It is the default for components that were
// given no observer.
var Nop Observer = nop{}

type nop struct{}

func (nop) Op(Op) {}

// Report passes a failure of component's operation op to o; nil is
// ignored. Metrics count it (kvpool_errors_total{component, op, kind}) and
// the error ring records it, from this one call.
func Report(o Observer, component, op string, err error) {
	if err != nil {
		o.Op(Op{Component: component, Name: op, GPU: -1, Err: err})
	}
}

// Multi returns an Observer that passes each operation to every non-nil
// observer in order.
func Multi(obs ...Observer) Observer {
	var out multi
	for _, o := range obs {
		if o != nil {
			out = append(out, o)
		}
	}
	switch len(out) {
	case 0:
		return Nop
	case 1:
		return out[0]
	}
	return out
}

type multi []Observer

func (m multi) Op(op Op) {
	for _, o := range m {
		o.Op(op)
	}
}

// Func adapts a function to the Observer interface.
type Func func(Op)

// Op calls f(op).
func (f Func) Op(op Op) { f(op) }

// Recorder is an Observer that keeps every operation; tests use it.
type Recorder struct {
	mu  sync.Mutex
	ops []Op
}

// Op records op.
func (r *Recorder) Op(op Op) {
	r.mu.Lock()
	r.ops = append(r.ops, op)
	r.mu.Unlock()
}

// Ops returns a copy of the recorded operations.
func (r *Recorder) Ops() []Op {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Op(nil), r.ops...)
}
