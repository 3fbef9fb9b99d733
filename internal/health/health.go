// Package health serves liveness and readiness probes whose checks exercise
// real function: loops prove they are turning by heartbeats, the socket is
// probed with a real handshake, and readiness asks the pool for ready chunks
// and the device plugin for its kubelet registration.
//
// Every check runs under a timeout. A check that does not return in time
// fails, and while it stays stuck no second copy of it is started, so a
// wedged component costs one goroutine, not one per probe.
package health

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Checker reports nil when the thing it checks works. It should honour ctx.
type Checker func(ctx context.Context) error

// Options configures New.
type Options struct {
	// Timeout bounds each check; default 2s.
	Timeout time.Duration
	// Now is the clock heartbeats are judged by; default time.Now.
	Now func() time.Time
}

// Health holds the liveness and readiness checks.
type Health struct {
	timeout time.Duration
	now     func() time.Time

	mu    sync.Mutex
	live  []*check
	ready []*check
}

type check struct {
	name string
	fn   Checker

	mu      sync.Mutex
	running chan struct{} // closed when the run in flight ends; nil when idle
	since   time.Time
	lastErr error
}

// New returns a Health with no checks: live and ready.
func New(opts Options) *Health {
	if opts.Timeout <= 0 {
		opts.Timeout = 2 * time.Second
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &Health{timeout: opts.Timeout, now: opts.Now}
}

// AddLiveness adds a check that must pass for the agent to count as alive.
// A failing liveness probe makes kubelet restart the agent: add only checks
// that a restart would fix.
func (h *Health) AddLiveness(name string, c Checker) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.live = append(h.live, &check{name: name, fn: c})
}

// AddReadiness adds a check that must pass for the agent to count as ready.
func (h *Health) AddReadiness(name string, c Checker) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ready = append(h.ready, &check{name: name, fn: c})
}

// Heartbeat registers a liveness check named name that fails when the
// returned Heartbeat has not beaten for longer than maxSilence. The loop it
// watches calls Beat on every turn; a loop that waits for work must wake at
// least once per maxSilence to beat (a ticker in its select).
func (h *Health) Heartbeat(name string, maxSilence time.Duration) *Heartbeat {
	b := &Heartbeat{name: name, max: maxSilence, now: h.now}
	b.Beat()
	h.AddLiveness(name, b.Check)
	return b
}

// Heartbeat is a loop's proof of progress.
type Heartbeat struct {
	name string
	max  time.Duration
	now  func() time.Time
	mu   sync.Mutex
	last time.Time
}

// Beat records progress now.
func (b *Heartbeat) Beat() {
	t := b.now()
	b.mu.Lock()
	b.last = t
	b.mu.Unlock()
}

// Check fails when the last beat is older than the allowed silence.
func (b *Heartbeat) Check(context.Context) error {
	b.mu.Lock()
	last := b.last
	b.mu.Unlock()
	if d := b.now().Sub(last); d > b.max {
		return fmt.Errorf("%s made no progress for %s (limit %s)", b.name, d.Round(time.Millisecond), b.max)
	}
	return nil
}

// Result is the outcome of one probe.
type Result struct {
	Checks []CheckResult
}

// CheckResult is one check's outcome.
type CheckResult struct {
	Name string
	Err  error
}

// OK reports whether every check passed.
func (r Result) OK() bool {
	for _, c := range r.Checks {
		if c.Err != nil {
			return false
		}
	}
	return true
}

// Err joins the failures, nil when there are none.
func (r Result) Err() error {
	var errs []error
	for _, c := range r.Checks {
		if c.Err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", c.Name, c.Err))
		}
	}
	return errors.Join(errs...)
}

// Reason is a one-line summary of the failures, "" when there are none.
func (r Result) Reason() string {
	var parts []string
	for _, c := range r.Checks {
		if c.Err != nil {
			parts = append(parts, c.Name+": "+c.Err.Error())
		}
	}
	return strings.Join(parts, "; ")
}

// String lists every check, one a line, in the style of the Kubernetes
// apiserver's verbose probes.
func (r Result) String() string {
	var b strings.Builder
	for _, c := range r.Checks {
		if c.Err != nil {
			fmt.Fprintf(&b, "[-]%s failed: %v\n", c.Name, c.Err)
		} else {
			fmt.Fprintf(&b, "[+]%s ok\n", c.Name)
		}
	}
	return b.String()
}

// Live runs the liveness checks.
func (h *Health) Live(ctx context.Context) Result { return h.run(ctx, &h.live, "") }

// Ready runs the readiness checks.
func (h *Health) Ready(ctx context.Context) Result { return h.run(ctx, &h.ready, "") }

// run runs the checks of list, or only the one named only when only is not
// "" (none when list has no such check).
func (h *Health) run(ctx context.Context, list *[]*check, only string) Result {
	h.mu.Lock()
	var checks []*check
	for _, c := range *list {
		if only == "" || c.name == only {
			checks = append(checks, c)
		}
	}
	h.mu.Unlock()
	res := Result{Checks: make([]CheckResult, len(checks))}
	var wg sync.WaitGroup
	for i, c := range checks {
		wg.Go(func() {
			res.Checks[i] = CheckResult{Name: c.name, Err: h.runOne(ctx, c)}
		})
	}
	wg.Wait()
	return res
}

func (h *Health) runOne(ctx context.Context, c *check) error {
	c.mu.Lock()
	if c.running != nil {
		since := c.since
		c.mu.Unlock()
		return fmt.Errorf("still running since %s ago (wedged)", h.now().Sub(since).Round(time.Millisecond))
	}
	done := make(chan struct{})
	c.running, c.since = done, h.now()
	c.mu.Unlock()

	ctx, cancel := context.WithTimeout(ctx, h.timeout)
	defer cancel()
	go func() {
		err := c.fn(ctx)
		c.mu.Lock()
		c.lastErr, c.running = err, nil
		c.mu.Unlock()
		close(done)
	}()
	select {
	case <-done:
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.lastErr
	case <-ctx.Done():
		return fmt.Errorf("no answer within %s: %w", h.timeout, ctx.Err())
	}
}

// Handler serves GET /livez and /readyz: 200 with "ok" on the last line when
// every check passes, 503 otherwise; the body lists each check and why it
// failed. GET /livez/<check> and /readyz/<check> run that one check (404
// for a name the probe does not have).
//
// This is not controller-runtime's healthz.Handler, although it serves the
// same kind of probe, because that handler would lose what this one is for:
// it runs the checks one after another, so two wedged checks at the 2 s
// timeout outlast kubelet's 3 s probe timeout and the probe fails with no
// reason, where here they run together and the answer always comes within
// one timeout naming the wedged check; it withholds the failure reasons
// ("reason withheld") that kubectl describe shows from this body; it takes
// its checks as a map fixed before serving, where components add theirs to
// a Health while it serves; and it answers 500, not 503. The wedge
// detection itself (runOne) would survive under either.
func (h *Health) Handler() http.Handler {
	mux := http.NewServeMux()
	for _, probe := range []struct {
		name string
		list *[]*check
	}{{"livez", &h.live}, {"readyz", &h.ready}} {
		mux.HandleFunc("GET /"+probe.name, func(w http.ResponseWriter, r *http.Request) {
			h.serve(w, probe.name, h.run(r.Context(), probe.list, ""))
		})
		mux.HandleFunc("GET /"+probe.name+"/{check}", func(w http.ResponseWriter, r *http.Request) {
			name := r.PathValue("check")
			res := h.run(r.Context(), probe.list, name)
			if len(res.Checks) == 0 {
				http.Error(w, fmt.Sprintf("%s has no check %q", probe.name, name), http.StatusNotFound)
				return
			}
			h.serve(w, probe.name+"/"+name, res)
		})
	}
	return mux
}

func (h *Health) serve(w http.ResponseWriter, probe string, r Result) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if r.OK() {
		w.WriteHeader(http.StatusOK)
		fmt.Fprintf(w, "%s%s ok\n", r, probe)
		return
	}
	w.WriteHeader(http.StatusServiceUnavailable)
	fmt.Fprintf(w, "%s%s failed\n", r, probe)
}
