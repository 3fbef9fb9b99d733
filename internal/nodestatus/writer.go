package nodestatus

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"

	"github.com/kvpool/kvpool/api/v1alpha1"
	"github.com/kvpool/kvpool/pkg/observe"
)

// Options configures a Writer.
type Options struct {
	// MinInterval is the least time between two writes; default 10s.
	// Changes within it are coalesced: only the latest is written.
	MinInterval time.Duration
	// UrgentInterval is the least time between two writes when the
	// status's health or a condition's status or reason changed (the
	// agent became ready, the keeper was lost): such a change is written
	// at once, at most this often; default 1s.
	UrgentInterval time.Duration
	// Resync rewrites an unchanged status this long after the last write,
	// refreshing LastUpdateTime: the agent's heartbeat. A status whose LastUpdateTime
	// is older than StaleAfter is from an agent that is not running.
	// Default Heartbeat; negative disables it.
	Resync time.Duration
	// Log receives write failures; default slog.Default().
	Log *slog.Logger
	// OnError, when set, is told of every failed write (for metrics).
	OnError func(error)
	// Now is the clock; default time.Now.
	Now func() time.Time
}

// Heartbeat is how often the agent refreshes its KVPoolNode's
// lastUpdateTime when nothing changed, and StaleAfter the age past which a
// reader must take the status as that of an agent that is not running (a
// crash, a kill -9, a node that lost the API server): three heartbeats, so
// one slow or failed write does not look like a dead agent. A graceful stop
// does not wait for it: the agent writes a final not-Ready status (Stop).
const (
	Heartbeat  = 10 * time.Second
	StaleAfter = 3 * Heartbeat
)

// Writer keeps the node's KVPoolNode in step with the latest status given to
// Set, writing on change at a bounded rate. The object is named after the
// node and owned by the Node, so it goes when the node does.
type Writer struct {
	c    Client
	node string
	opts Options

	kick chan struct{}

	mu      sync.Mutex
	obs     observe.Observer // ReportTo
	pending *v1alpha1.KVPoolNodeStatus
	nodeRef *metav1.OwnerReference
	written time.Time
	// writtenKey is urgencyKey of the last status written.
	writtenKey string
}

// urgencyKey is what of a status makes its change urgent: its health and
// each condition's status and reason (not the messages, which carry
// counts).
func urgencyKey(st *v1alpha1.KVPoolNodeStatus) string {
	key := string(st.Health)
	for _, c := range st.Conditions {
		key += "|" + c.Type + "=" + string(c.Status) + "/" + c.Reason
	}
	return key
}

// urgent says whether the pending status differs from the last written
// one in its urgencyKey.
func (w *Writer) urgent() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.pending != nil && urgencyKey(w.pending) != w.writtenKey
}

// NewWriter returns a Writer for node that writes through c (NewClient's
// in the agent).
func NewWriter(c Client, node string, opts Options) *Writer {
	if opts.MinInterval <= 0 {
		opts.MinInterval = 10 * time.Second
	}
	if opts.UrgentInterval <= 0 {
		opts.UrgentInterval = min(time.Second, opts.MinInterval)
	}
	if opts.Resync == 0 {
		opts.Resync = Heartbeat
	}
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &Writer{c: c, node: node, opts: opts, kick: make(chan struct{}, 1)}
}

// ReportTo makes Run report every failed write to obs (component
// "nodestatus", op "write"): kvpool_errors_total and the error ring. The
// agent builds the writer before its metrics, so this is separate from
// Options.
func (w *Writer) ReportTo(obs observe.Observer) {
	w.mu.Lock()
	w.obs = obs
	w.mu.Unlock()
}

// Set records the latest status; Run writes it. It never blocks.
func (w *Writer) Set(st v1alpha1.KVPoolNodeStatus) {
	w.mu.Lock()
	w.pending = st.DeepCopy()
	w.mu.Unlock()
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// Run writes until ctx ends: after each Set, but never twice within
// MinInterval, or UrgentInterval when the health or a condition changed
// (those are written at once); and Resync after the last write when
// nothing changed (the heartbeat). A failed write is retried after
// MinInterval (UrgentInterval for an urgent status). A conflict is such a failure too, reported and retried by
// the next pass (which reads the object afresh), not at once: an immediate
// retry would break the MinInterval bound on the agent's API writes.
// Stopped, which has no next pass, retries conflicts at once.
func (w *Writer) Run(ctx context.Context) error {
	var beat <-chan time.Time
	var resync *time.Timer
	if w.opts.Resync > 0 {
		resync = time.NewTimer(w.opts.Resync)
		defer resync.Stop()
		beat = resync.C
	}
	var last time.Time
	for {
		force := false
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-w.kick:
		case <-beat:
			force = true
		}
		if err := w.waitTurn(ctx, last); err != nil {
			return err
		}
		last = time.Now()
		err := w.Sync(ctx, force)
		if resync != nil {
			resync.Reset(w.opts.Resync)
		}
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			w.failed(err)
		}
	}
}

// waitTurn waits until a write is allowed after the one at last:
// MinInterval, cut to UrgentInterval as soon as the pending status is
// urgent (a Set during the wait may make it so).
func (w *Writer) waitTurn(ctx context.Context, last time.Time) error {
	if last.IsZero() {
		return nil
	}
	for {
		interval := w.opts.MinInterval
		if w.urgent() {
			interval = w.opts.UrgentInterval
		}
		wait := time.Until(last.Add(interval))
		if wait <= 0 {
			return nil
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
			return nil
		case <-w.kick:
			// A new status, which the write after this wait takes; its
			// urgency may shorten the wait.
			t.Stop()
		}
	}
}

// failed reports a failed write and asks for a retry after MinInterval.
func (w *Writer) failed(err error) {
	w.opts.Log.Warn("write KVPoolNode status", "node", w.node, "err", err)
	w.mu.Lock()
	obs := w.obs
	w.mu.Unlock()
	if obs != nil {
		observe.Report(obs, observe.ComponentNodeStatus, observe.OpWrite, err)
	}
	if w.opts.OnError != nil {
		w.opts.OnError(err)
	}
	select { // retry after MinInterval
	case w.kick <- struct{}{}:
	default:
	}
}

// Sync writes the latest status now when it differs from the object's, when
// the heartbeat is due (the object's lastUpdateTime is Resync old) or when
// force is set; it creates the object if it is missing. It returns nil when
// there is nothing to write.
func (w *Writer) Sync(ctx context.Context, force bool) error {
	w.mu.Lock()
	var want *v1alpha1.KVPoolNodeStatus
	if w.pending != nil {
		want = w.pending.DeepCopy()
	}
	w.mu.Unlock()
	if want == nil {
		return nil
	}
	obj, err := w.c.Get(ctx, w.node)
	switch {
	case apierrors.IsNotFound(err):
		if obj, err = w.create(ctx); err != nil {
			return err
		}
	case err != nil:
		return fmt.Errorf("get kvpoolnode %s: %w", w.node, err)
	}

	now := metav1.NewTime(w.opts.Now().Truncate(time.Second))
	next := want.DeepCopy()
	next.Conditions = obj.Status.DeepCopy().Conditions
	for _, c := range want.Conditions {
		c.LastTransitionTime = now
		c.ObservedGeneration = obj.Generation
		apimeta.SetStatusCondition(&next.Conditions, c)
	}
	next.LastUpdateTime = obj.Status.LastUpdateTime
	// The heartbeat is due when the object's lastUpdateTime is a Resync
	// old, whatever woke the caller: with a status fed more often than
	// MinInterval, the changes' wake-ups would otherwise crowd out the
	// resync tick and the heartbeat could go stale on a live agent.
	due := w.opts.Resync > 0 && now.Sub(obj.Status.LastUpdateTime.Time) >= w.opts.Resync
	if !force && !due && equality.Semantic.DeepEqual(&obj.Status, next) {
		return nil
	}
	next.LastUpdateTime = now
	obj.Status = *next
	if _, err := w.c.UpdateStatus(ctx, obj); err != nil {
		return fmt.Errorf("update kvpoolnode %s status: %w", w.node, err)
	}
	w.mu.Lock()
	w.written = now.Time
	w.writtenKey = urgencyKey(want)
	w.mu.Unlock()
	return nil
}

func (w *Writer) create(ctx context.Context) (*v1alpha1.KVPoolNode, error) {
	ref, err := w.owner(ctx)
	if err != nil {
		return nil, err
	}
	obj := &v1alpha1.KVPoolNode{
		ObjectMeta: metav1.ObjectMeta{
			Name:            w.node,
			Labels:          map[string]string{"app.kubernetes.io/name": "kvpool", "app.kubernetes.io/component": "agent"},
			OwnerReferences: []metav1.OwnerReference{*ref},
		},
	}
	obj, err = w.c.Create(ctx, obj)
	if err != nil {
		return nil, fmt.Errorf("create kvpoolnode %s: %w", w.node, err)
	}
	return obj, nil
}

// owner is the reference to the Node, looked up once.
func (w *Writer) owner(ctx context.Context) (*metav1.OwnerReference, error) {
	w.mu.Lock()
	ref := w.nodeRef
	w.mu.Unlock()
	if ref != nil {
		return ref, nil
	}
	node, err := w.c.GetNode(ctx, w.node)
	if err != nil {
		return nil, fmt.Errorf("get node %s for the owner reference: %w", w.node, err)
	}
	ref = &metav1.OwnerReference{APIVersion: "v1", Kind: "Node", Name: node.Name, UID: node.UID}
	w.mu.Lock()
	w.nodeRef = ref
	w.mu.Unlock()
	return ref, nil
}

// Stopped marks the latest status as that of a stopped agent and writes it
// at once (ignoring MinInterval): Health Unhealthy with reason as its
// message, the Ready condition False ("AgentStopped"), nothing ready and no
// sessions (the agent's memory and connections go with it). The agent calls
// it on SIGTERM, after Run has returned, with a context of its own: the
// status then stops claiming a serving agent within seconds instead of
// after StaleAfter. It does nothing when no status was ever set. Being the
// last write, it retries at once (retry.DefaultRetry: 5 tries within about
// 50ms) when the object changed under it (a conflict) or was created by
// someone else between its read and its create; other errors are returned.
func (w *Writer) Stopped(ctx context.Context, reason string) error {
	w.mu.Lock()
	if w.pending == nil {
		w.mu.Unlock()
		return nil
	}
	st := w.pending.DeepCopy()
	st.Health, st.Message = v1alpha1.HealthUnhealthy, reason
	st.Ready = bytesQ(0)
	st.Sessions = 0
	for i := range st.GPUs {
		st.GPUs[i].Ready = bytesQ(0)
	}
	for i := range st.Conditions {
		st.Conditions[i].Status = metav1.ConditionFalse
		st.Conditions[i].Reason = "AgentStopped"
		st.Conditions[i].Message = reason
	}
	w.pending = st
	w.mu.Unlock()
	return retry.OnError(retry.DefaultRetry, func(err error) bool {
		return apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err)
	}, func() error { return w.Sync(ctx, true) })
}

// LastWrite is when the status was last written, zero if never.
func (w *Writer) LastWrite() time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.written
}

// Feed calls build every interval until ctx ends and hands the result to w;
// w writes it only when it changed, at most once per MinInterval. It is the
// whole of the agent's status loop:
//
//	go w.Run(ctx)
//	go nodestatus.Feed(ctx, w, 5*time.Second, func() v1alpha1.KVPoolNodeStatus {
//		return nodestatus.Build(node, nodestatus.Input{Snapshot: report.Take(p, targets, time.Now()), ...})
//	})
func Feed(ctx context.Context, w *Writer, interval time.Duration, build func() v1alpha1.KVPoolNodeStatus) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		w.Set(build())
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
