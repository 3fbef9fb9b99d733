package server_test

import (
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvpool/kvpool/internal/metrics"
	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/poolerr"
	"github.com/kvpool/kvpool/pkg/wire"
)

// errorCount is kvpool_errors_total{component, op, kind}, 0 when absent.
func errorCount(t *testing.T, m *metrics.Metrics, component, op, kind string) float64 {
	t.Helper()
	fams, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != "kvpool_errors_total" {
			continue
		}
		for _, mt := range f.GetMetric() {
			if label(mt, "component") == component && label(mt, "op") == op && label(mt, "kind") == kind {
				return mt.GetCounter().GetValue()
			}
		}
	}
	return 0
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// A refused request reaches the error ring and the metrics as the client
// got it: the ring shows the client's message, the session and the
// allocation; the ring and kvpool_errors_total name the same kind.
func TestRequestErrorReachesRingAndMetrics(t *testing.T) {
	ring := report.NewRing(8)
	var m *metrics.Metrics
	a := startServerWith(t, func(o *server.Options) {
		o.SweepInterval = time.Hour
		m = metrics.New(o.Pool.(*pool.Pool), metrics.Options{NoRuntime: true})
		o.Hooks.Request = server.ObserveRequests(observe.Multi(m, ring))
	})
	r := dial(t, a)
	r.open(0, "observe-instance")
	st, msg := r.do(wire.OpReload, 0, &wire.Reload{Rid: "nope", Label: "kv", GpuPages: []int32{0}}, &wire.ReloadReply{})
	if st != wire.StatusUnknownStream {
		t.Fatalf("reload of an unknown stream: %s %q", st, msg)
	}
	// A refused open on a second connection: no session, no allocation.
	r2 := dial(t, a)
	r2.hello()
	st2, msg2 := r2.do(wire.OpOpen, 0, openMsg("tok-nope", 0, "observe-instance-2"), &wire.OpenReply{})
	if st2 != wire.StatusUnauthorized {
		t.Fatalf("open with a bad token: %s %q", st2, msg2)
	}

	// The hook runs after the reply is sent (it adds nothing to the
	// client's wait), so the entries arrive a moment after the replies, in
	// either order.
	var got []report.Entry
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if got = ring.Entries(); len(got) >= 2 || time.Now().After(deadline) {
			break
		}
	}
	if len(got) != 2 {
		t.Fatalf("ring = %+v, want the reload and the open", got)
	}
	if got[0].Op != "reload" {
		got[0], got[1] = got[1], got[0]
	}
	e := got[0]
	if e.Component != "server" || e.Op != "reload" || e.Kind != "unknown_stream" || e.Message != msg ||
		e.Session == "" || e.Allocation != "A" {
		t.Errorf("ring entry = %+v, want server/reload/unknown_stream, message %q, a session, allocation A", e, msg)
	}
	if e := got[1]; e.Op != "open" || e.Kind != "unauthorized" || e.Message != msg2 || e.Session != "" || e.Allocation != "" {
		t.Errorf("ring entry = %+v, want open/unauthorized, message %q, no session", e, msg2)
	}
	for _, e := range got {
		if n := errorCount(t, m, e.Component, e.Op, e.Kind); n != 1 {
			t.Errorf("kvpool_errors_total{%s, %s, %s} = %v, want 1 (the ring's entry)", e.Component, e.Op, e.Kind, n)
		}
	}
}

// Every status but ok has a kind, and a request refused with it is counted
// in the metrics and recorded in the ring under that same kind; every pool
// error a client can meet maps to a status whose kind names it.
func TestEveryStatusOneKind(t *testing.T) {
	ring := report.NewRing(64)
	m := metrics.New(pool.New(), metrics.Options{NoRuntime: true})
	obs := observe.Multi(m, ring)
	for _, st := range wire.Statuses() {
		if st == wire.StatusOK {
			continue
		}
		ring := report.NewRing(1)
		err := &server.RequestError{Op: wire.OpOffload, Status: st, Message: "refused: " + st.String()}
		observe.Multi(obs, ring).Op(observe.Op{Name: "offload", Err: err})
		entries := ring.Entries()
		if len(entries) != 1 || entries[0].Kind != st.Kind() || entries[0].Message != err.Message {
			t.Errorf("status %s: ring %+v, want kind %q", st, entries, st.Kind())
		}
		if n := errorCount(t, m, "server", "offload", st.Kind()); n != 1 {
			t.Errorf("status %s: kvpool_errors_total{kind=%q} = %v, want 1", st, st.Kind(), n)
		}
	}
	for _, perr := range []error{poolerr.ErrUnknownStream, poolerr.ErrDuplicateStream, poolerr.ErrPageCount, poolerr.ErrOutOfRange,
		poolerr.ErrDuplicateIndex, poolerr.ErrBadName, poolerr.ErrBadSize, poolerr.ErrBadFence, poolerr.ErrClosed, poolerr.ErrNoCapacity,
		poolerr.ErrNoGPUChunks, poolerr.ErrUnknownAllocation, poolerr.ErrNotReady, poolerr.ErrPending} {
		st := wire.StatusOf(perr)
		if st == wire.StatusInternal || report.Kind(perr) != st.Kind() {
			t.Errorf("%v: status %s, kind %q", perr, st, report.Kind(perr))
		}
	}
}

// The observer's operation names are the wire's.
func TestObserveOpNamesAreWire(t *testing.T) {
	for name, op := range map[string]wire.Op{
		observe.OpHello: wire.OpHello, observe.OpOpen: wire.OpOpen, observe.OpOffload: wire.OpOffload,
		observe.OpReload: wire.OpReload, observe.OpFence: wire.OpFence, observe.OpDiscard: wire.OpDiscard,
		observe.OpRemoveRequest: wire.OpRemoveRequest, observe.OpNumPages: wire.OpNumPages, observe.OpClose: wire.OpClose,
	} {
		if op.String() != name {
			t.Errorf("observe names %q what the wire calls %q", name, op)
		}
	}
}
