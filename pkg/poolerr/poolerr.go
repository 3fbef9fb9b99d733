// Package poolerr holds the pool's error values: the kinds of failure a
// session call can meet. The pool returns them (wrapped with the details of
// the call), the socket server turns them into wire statuses and the client
// back into the same values, both through pkg/wire's one table (StatusOf,
// ErrorOf), so errors.Is works on both sides. Everyone names them here:
// the client imports this package instead of the pool.
//
// It imports only the standard library.
package poolerr

import "errors"

// Errors of the pool. Each names one kind of misuse; the pool wraps them
// with the details of the call (see errors.Is). A call that returns any of
// them has changed nothing.
var (
	// ErrFull reports that the pool cannot hold every page of an offload,
	// counting pages whose release is still pending. It is the seed API's
	// "offload returned False", not a misuse.
	ErrFull = errors.New("not enough free host pages")
	// ErrPending reports that an offload fits only once earlier reloads'
	// copies complete; see pool.PendingError.
	ErrPending = errors.New("host pages still pending release")
	// ErrNoPages reports an offload of zero pages. Like ErrFull it is the
	// seed API's "offload returned False" (the engine then discards what it
	// claimed), not a misuse: nothing is recorded.
	ErrNoPages = errors.New("offload of zero pages")

	ErrUnknownStream   = errors.New("unknown stream")
	ErrDuplicateStream = errors.New("stream already offloaded")
	ErrPageCount       = errors.New("wrong page count")
	ErrBadSize         = errors.New("bad size")
	ErrOutOfRange      = errors.New("page index out of range")
	ErrDuplicateIndex  = errors.New("duplicate page index")
	ErrBadFence        = errors.New("fence names a reload that was never issued")
	ErrClosed          = errors.New("session closed")
	// ErrBadName reports an empty request ID, or a request ID or label
	// longer than the pool's bound.
	ErrBadName = errors.New("bad request ID or label")

	ErrUnknownChunk      = errors.New("unknown chunk")
	ErrDuplicateChunk    = errors.New("chunk already known")
	ErrChunkBusy         = errors.New("chunk in use")
	ErrChunkDirty        = errors.New("chunk not scrubbed since its last allocation")
	ErrUnknownAllocation = errors.New("unknown allocation")
	ErrAllocationExists  = errors.New("allocation already holds other chunks")
	ErrNoCapacity        = errors.New("allocation has too few unbound chunks")
	// ErrNoGPUChunks is what status 21 stands for: an older agent's refusal
	// of a session for a GPU under whose name the allocation holds no
	// chunk. The pool binds by locality and never returns it.
	ErrNoGPUChunks = errors.New("allocation holds no chunk of this GPU")
	// ErrUnknownGPU reports an Open for a GPU the agent does not serve:
	// its UUID is not in the node's plan (a GPU of another node, or a
	// device the agent could not see).
	ErrUnknownGPU = errors.New("GPU is not one of the agent's")

	// ErrNotReady reports that the pool (or the agent around it) cannot
	// answer yet but will: it is starting or restoring its books. The
	// caller retries.
	ErrNotReady = errors.New("not ready yet, retry")
)
