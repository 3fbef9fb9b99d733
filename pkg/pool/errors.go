package pool

import (
	"fmt"

	"github.com/kvpool/kvpool/pkg/poolerr"
)

// Errors returned by the pool, defined in pkg/poolerr (which the client
// imports instead of the pool) and re-exported here: pool.ErrX is
// poolerr.ErrX. Each names one kind of misuse; the pool wraps them with the
// details of the call (see errors.Is). A call that returns any of them has
// changed nothing.
var (
	ErrFull              = poolerr.ErrFull
	ErrPending           = poolerr.ErrPending
	ErrNoPages           = poolerr.ErrNoPages
	ErrUnknownStream     = poolerr.ErrUnknownStream
	ErrDuplicateStream   = poolerr.ErrDuplicateStream
	ErrPageCount         = poolerr.ErrPageCount
	ErrBadSize           = poolerr.ErrBadSize
	ErrOutOfRange        = poolerr.ErrOutOfRange
	ErrDuplicateIndex    = poolerr.ErrDuplicateIndex
	ErrBadFence          = poolerr.ErrBadFence
	ErrClosed            = poolerr.ErrClosed
	ErrUnknownChunk      = poolerr.ErrUnknownChunk
	ErrDuplicateChunk    = poolerr.ErrDuplicateChunk
	ErrChunkBusy         = poolerr.ErrChunkBusy
	ErrChunkDirty        = poolerr.ErrChunkDirty
	ErrUnknownAllocation = poolerr.ErrUnknownAllocation
	ErrAllocationExists  = poolerr.ErrAllocationExists
	ErrNoCapacity        = poolerr.ErrNoCapacity
	ErrNoGPUChunks       = poolerr.ErrNoGPUChunks
	ErrBadName           = poolerr.ErrBadName
	ErrNotReady          = poolerr.ErrNotReady
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
