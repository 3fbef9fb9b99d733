package client

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/kvpool/kvpool/pkg/wire"
)

// The waits between tries: a dial that finds nobody listening is tried
// again within dialPoll (an agent restarting is back within 5 ms of
// listening), a broken connection or "unavailable" backs off to 100 ms, a
// refusal by a limit to limitBackoff, and no wait runs past the deadline.
func TestRetryWait(t *testing.T) {
	far := time.Now().Add(time.Hour)
	dial := fmt.Errorf("kvpool: %w: %w", errDial, syscall.ECONNREFUSED)
	limit := &Error{Status: wire.StatusLimit}
	for _, c := range []struct {
		name  string
		err   error
		waits []time.Duration // for tries 0, 1, 2, ...
	}{
		{"nobody listening", dial, []time.Duration{1, 2, 4, 5, 5, 5, 5, 5, 5, 5, 5}},
		{"broken connection", fmt.Errorf("x: %w", ErrDisconnected), []time.Duration{5, 10, 20, 40, 80, 100, 100, 100, 100, 100}},
		{"unavailable", &Error{Status: wire.StatusUnavailable}, []time.Duration{5, 10, 20, 40, 80, 100, 100}},
		{"a limit", limit, []time.Duration{5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000, 1000}},
	} {
		for try, want := range c.waits {
			if got := retryWait(try, c.err, far); got != want*time.Millisecond {
				t.Errorf("%s, try %d: wait %v, want %v", c.name, try, got, want*time.Millisecond)
			}
		}
		if got := retryWait(7, c.err, time.Now().Add(-time.Second)); got != 0 {
			t.Errorf("%s past the deadline: wait %v", c.name, got)
		}
		if got := retryWait(7, c.err, time.Now().Add(time.Millisecond)); got > time.Millisecond {
			t.Errorf("%s 1 ms before the deadline: wait %v", c.name, got)
		}
	}
}
