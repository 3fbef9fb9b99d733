package client

import (
	"errors"
	"testing"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/wire"
)

// The client maps each status back to the pool error the agent maps to it
// (server.StatusOf), and its errors have the agent's kind.
func TestStatusErrorsInvertServer(t *testing.T) {
	for _, m := range statusErrs {
		if errors.Is(m.err, ErrUnknownGPU) {
			continue // the client's own; the agent refuses an unknown GPU before the pool
		}
		if got := server.StatusOf(m.err); got != m.st {
			t.Errorf("client maps %s to %v, the agent maps that error to %s", m.st, m.err, got)
		}
		e := &Error{Op: wire.OpOffload, Status: m.st}
		if !errors.Is(e, m.err) || e.Kind() != m.st.Kind() {
			t.Errorf("%s: errors.Is %v, kind %q", m.st, errors.Is(e, m.err), e.Kind())
		}
	}
}
