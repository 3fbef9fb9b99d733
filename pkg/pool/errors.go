package pool

import (
	"errors"
	"fmt"
)

// Errors returned by the pool. Each names one kind of misuse; the pool wraps
// them with the details of the call (see errors.Is). A call that returns any of
// them has changed nothing.
var (
	// ErrFull reports that the pool cannot hold every page of an offload,
	// counting pages whose release is still pending. It is the seed API's
	// "offload returned False", not a misuse.
	ErrFull = errors.New("not enough free host pages")
	// ErrPending reports that an offload fits only once earlier reloads'
	// copies complete; see PendingError.
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

	ErrUnknownChunk      = errors.New("unknown chunk")
	ErrDuplicateChunk    = errors.New("chunk already known")
	ErrChunkBusy         = errors.New("chunk in use")
	ErrChunkDirty        = errors.New("chunk not scrubbed since its last allocation")
	ErrUnknownAllocation = errors.New("unknown allocation")
	ErrAllocationExists  = errors.New("allocation already holds other chunks")
	ErrNoCapacity        = errors.New("allocation has too few unbound chunks")
	// ErrNoGPUChunks reports a session for a GPU of which the allocation
	// holds no chunk: a session binds only chunks of its own GPU.
	ErrNoGPUChunks = errors.New("allocation holds no chunk of this GPU")
)

// PendingError is returned by Offload when the free pages alone are too few
// but enough pages are pending release behind reload copies that have not been
// confirmed. The caller waits until the reload with Ticket has completed,
// passes that ticket to Fence, and retries.
type PendingError struct {
	Ticket uint64 // the oldest reload whose completion makes room
	Need   int    // pages the offload needs
	Free   int    // pages free now
}

func (e *PendingError) Error() string {
	return fmt.Sprintf("%v: need %d pages, %d free; fence reload %d first", ErrPending, e.Need, e.Free, e.Ticket)
}

func (e *PendingError) Unwrap() error { return ErrPending }

// streamErr wraps err with the stream it concerns.
func streamErr(op, rid, label string, err error) error {
	return fmt.Errorf("%s %q/%q: %w", op, rid, label, err)
}
