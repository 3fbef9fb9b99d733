package pool

import (
	"fmt"

	"github.com/kvpool/kvpool/pkg/poolerr"
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
	return fmt.Sprintf("%v: need %d pages, %d free; fence reload %d first", poolerr.ErrPending, e.Need, e.Free, e.Ticket)
}

func (e *PendingError) Unwrap() error { return poolerr.ErrPending }

// streamErr wraps err with the stream it concerns.
func streamErr(op, rid, label string, err error) error {
	return fmt.Errorf("%s %q/%q: %w", op, rid, label, err)
}
