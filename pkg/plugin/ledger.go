package plugin

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/poolerr"
)

// ledger is the device plugin's allocation bookkeeping: which chunks each
// allocation holds, its token, the pod that holds it, whether the pool has
// granted it, the chunks taken back and not yet renewed, and the decisions
// to reclaim. It makes no gRPC call, never asks kubelet anything and never
// renews a chunk: its caller (Plugin, the adapter to kubelet) does that slow
// work between two calls to the ledger, without the ledger's lock.
//
// Lock order: Plugin.renewMu, then ledger.mu, then the pool's own lock
// (the ledger calls Pool.Grant, Revoke and Scrubbed under mu; they work in
// memory and return at once). Nothing that waits on kubelet or on memory
// (Holders.Held, Options.Renew) runs under ledger.mu, so Authorize, which
// takes only ledger.mu, never waits for an Allocate, a reconcile or a
// renewal.
type ledger struct {
	pool        Pool
	devices     Source // the ready chunks (the DRA door picks shares among them)
	now         func() time.Time
	grace       time.Duration
	stateDir    string
	log         *slog.Logger
	reclaimed   func(pod string, devices []string)           // Options.Reclaimed
	chunkHealth func(id string, healthy bool, reason string) // Options.ChunkHealth
	kick        chan struct{}                                // wakes the renew loop

	mu       sync.Mutex
	allocs   map[string]*alloc // by token
	byDevice map[string]*alloc
	dirty    map[string]bool // revoked chunks not yet renewed
	retry    map[string]retry
	// scrubFailed: chunks reported unhealthy to chunkHealth
	scrubFailed map[string]bool
	withheld    map[string]bool // devices advertised unhealthy: dirty (not yet renewed) or held by a claim
	overlay     chan struct{}   // closed when withheld changes
	// changed is closed (and replaced) at every change of the
	// allocations or of the dirty chunks: the DRA driver republishes its
	// ResourceSlices then.
	changed chan struct{}
}

type alloc struct {
	Record
	granted  bool      // the pool holds the grant
	lastSeen time.Time // last time a pod held it; FirstSeen until then
	// gpus are the GPU device IDs of the container holding it, once
	// kubelet has listed them (gpusKnown); ContainerGPUs.
	gpus      []string
	gpusKnown bool
}

func newLedger(o *Options, log *slog.Logger) *ledger {
	return &ledger{
		pool: o.Pool, devices: o.Devices, now: o.Now, grace: o.GracePeriod, stateDir: o.StateDir, log: log,
		reclaimed: o.Reclaimed, chunkHealth: o.ChunkHealth,
		kick:        make(chan struct{}, 1),
		allocs:      make(map[string]*alloc),
		byDevice:    make(map[string]*alloc),
		dirty:       make(map[string]bool),
		retry:       make(map[string]retry),
		scrubFailed: make(map[string]bool),
		withheld:    make(map[string]bool),
		overlay:     make(chan struct{}),
		changed:     make(chan struct{}),
	}
}

// bumpLocked tells the watchers of changed that the allocations or the
// dirty chunks changed.
func (l *ledger) bumpLocked() {
	close(l.changed)
	l.changed = make(chan struct{})
}

// restore adds the allocations of a checkpoint and asks the pool for their
// chunks.
func (l *ledger) restore(recs []Record) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	for _, r := range recs {
		a := &alloc{Record: r, lastSeen: now}
		l.allocs[r.Token] = a
		for _, d := range r.Devices {
			l.byDevice[d] = a
		}
		l.grantLocked(a)
	}
	l.setWithheldLocked()
	l.bumpLocked()
}

// grantLocked asks the pool for a restored allocation's chunks; chunks that
// are not ready yet are retried on the next reconcile.
func (l *ledger) grantLocked(a *alloc) {
	if a.granted {
		return
	}
	if err := l.pool.Grant(a.ID(), a.Devices); err != nil {
		l.log.Debug("grant of restored allocation deferred", "pod", a.Pod, "devices", a.Devices, "err", err)
		return
	}
	a.granted = true
}

func (l *ledger) records() []Record {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.recordsLocked()
}

func (l *ledger) recordsLocked() []Record {
	out := make([]Record, 0, len(l.allocs))
	for _, a := range l.allocs {
		r := a.Record
		r.Devices = slices.Clone(r.Devices)
		out = append(out, r)
	}
	slices.SortFunc(out, func(a, b Record) int { return strings.Compare(a.Devices[0], b.Devices[0]) })
	return out
}

func (l *ledger) save() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.saveLocked()
}

func (l *ledger) saveLocked() error {
	return SaveCheckpoint(l.stateDir, l.recordsLocked())
}

// authorize maps a token to its allocation's ID, granting a restored
// allocation whose chunks have become ready.
func (l *ledger) authorize(token string) (string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	a, ok := l.allocs[token]
	if !ok {
		return "", contract.ErrUnknownToken
	}
	if !a.granted {
		l.grantLocked(a)
		if !a.granted {
			return "", fmt.Errorf("%w: the allocation's chunks are not ready yet", poolerr.ErrNotReady)
		}
	}
	return a.ID(), nil
}

// lookup returns what AuthorizePeer checks a client against: for a
// claim's allocation, the UIDs of the pods the claim was reserved for
// (podUIDs non-nil, possibly empty).
func (l *ledger) lookup(token string) (id, pod string, devices, podUIDs []string, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	a, ok := l.allocs[token]
	if !ok {
		return "", "", nil, nil, false
	}
	if a.Claim != nil {
		podUIDs = append([]string{}, a.Claim.PodUIDs...)
	}
	return a.ID(), a.Pod, slices.Clone(a.Devices), podUIDs, true
}

func (l *ledger) grantPending() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, a := range l.allocs {
		l.grantLocked(a)
	}
}

// overlayView is the set of withheld devices and the channel closed when it
// changes.
func (l *ledger) overlayView() (map[string]bool, <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return maps.Clone(l.withheld), l.overlay
}

func (l *ledger) dirtyIDs() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Sorted(maps.Keys(l.dirty))
}

// unhealthyIDs lists the chunks whose renewal has failed (reported to
// Options.ChunkHealth as unhealthy and not recovered since).
func (l *ledger) unhealthyIDs() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Sorted(maps.Keys(l.scrubFailed))
}

// Allocate outcomes: every Allocate error of the ledger is an *AllocateError
// with one of these results (kvpool_plugin_allocations_total counts them,
// with "ok").
const (
	ResultOK          = "ok"
	ResultInvalid     = "invalid"     // the request names unknown devices, one twice, or none
	ResultRefused     = "refused"     // a device is unhealthy, not renewed, or held by a live pod
	ResultUnavailable = "unavailable" // kubelet or the pool cannot answer now; kubelet retries
	ResultFailed      = "failed"      // the agent could not do its part (reclaim, checkpoint)
)

// AllocateResults lists every result of an Allocate, "ok" first.
var AllocateResults = []string{ResultOK, ResultInvalid, ResultRefused, ResultUnavailable, ResultFailed}

// AllocateError is why an Allocate was refused. Result is one of the
// Result* constants; it is also the error's Kind (metrics, the error ring).
type AllocateError struct {
	Result string
	Err    error
}

func (e *AllocateError) Error() string { return "allocate: " + e.Err.Error() }
func (e *AllocateError) Unwrap() error { return e.Err }

// Kind is the result, for metrics labels and the error ring.
func (e *AllocateError) Kind() string { return e.Result }

func allocErr(result, format string, args ...any) error {
	return &AllocateError{Result: result, Err: fmt.Errorf(format, args...)}
}

// errChanged: the allocations changed between two steps of one Allocate (a
// reconcile reclaimed one meanwhile); the Allocate starts over.
var errChanged = errors.New("the allocations changed while allocating")

// conflicts checks the requested sets against the allocations: each must be
// exactly an allocation not yet held by a listed pod, or free devices. It
// says whether kubelet must be asked which pods hold the rest (needList).
func (l *ledger) conflicts(sets [][]string) (needList bool, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, needList, err = l.conflictsLocked(sets)
	return needList, err
}

func (l *ledger) conflictsLocked(sets [][]string) (stale []*alloc, needList bool, err error) {
	for _, ids := range sets {
		for _, id := range ids {
			if l.dirty[id] {
				return nil, false, allocErr(ResultRefused, "device %s has not been renewed since its last pod", id)
			}
			a := l.byDevice[id]
			if a == nil {
				continue
			}
			if a.Claim != nil {
				return nil, false, allocErr(ResultRefused, "device %s is held by ResourceClaim %s/%s (the DRA driver prepared it)", id, a.Claim.Namespace, a.Claim.Name)
			}
			if slices.Equal(a.Devices, ids) && a.Pod == "" {
				continue // a repeated Allocate before the pod was ever listed
			}
			needList = true
			if !slices.Contains(stale, a) {
				stale = append(stale, a)
			}
		}
	}
	return stale, needList, nil
}

// settle decides, with held (PodResources' answer: device -> pod), what
// happens to the allocations the requested sets overlap: a set that is
// exactly an allocation its pod still holds is a retry; an overlap with an
// allocation a listed pod holds is refused; an allocation no listed pod
// holds is reclaimed now (kubelet, which is authoritative, has given its
// devices to someone else). It returns the reclaimed devices of the sets,
// which must be renewed before they are granted, and the IDs of the
// allocations it reclaimed.
func (l *ledger) settle(sets [][]string, held map[string]string) (renew, reclaimed []string, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	reclaim, err := l.decideLocked(sets, held)
	if err != nil {
		return nil, nil, err
	}
	for _, a := range reclaim {
		l.log.Info("reclaiming allocation reassigned by kubelet", "allocation", a.ID(), "pod", a.Pod, "devices", a.Devices)
		if err := l.reclaimLocked(a); err != nil {
			l.setWithheldLocked()
			return nil, reclaimed, allocErr(ResultFailed, "%v", err)
		}
		reclaimed = append(reclaimed, a.ID())
	}
	l.setWithheldLocked()
	if len(reclaim) > 0 {
		if err := l.saveLocked(); err != nil {
			l.log.Error("save checkpoint after reclaim", "err", err)
		}
	}
	for _, ids := range sets {
		for _, id := range ids {
			if l.dirty[id] {
				renew = append(renew, id)
			}
		}
	}
	return renew, reclaimed, nil
}

// decideLocked returns the allocations the sets overlap that must be
// reclaimed first, or why the sets cannot be granted. held is nil when
// PodResources was not asked.
func (l *ledger) decideLocked(sets [][]string, held map[string]string) ([]*alloc, error) {
	stale, needList, err := l.conflictsLocked(sets)
	if err != nil || !needList {
		return nil, err
	}
	if held == nil {
		return nil, errChanged // an overlap appeared after the listing was skipped
	}
	var reclaim []*alloc
	for _, a := range stale {
		holder := holderOf(a, held)
		switch {
		case holder != "" && slices.ContainsFunc(sets, func(ids []string) bool { return slices.Equal(ids, a.Devices) }):
			// The same set again while its pod is listed: a retry.
		case holder != "":
			return nil, allocErr(ResultRefused, "devices %v are held by pod %s", a.Devices, holder)
		default:
			reclaim = append(reclaim, a)
		}
	}
	return reclaim, nil
}

func holderOf(a *alloc, held map[string]string) string {
	for _, d := range a.Devices {
		if h, ok := held[d]; ok {
			return h
		}
	}
	return ""
}

// grant records the sets as allocations: an existing allocation is
// returned as it is; free devices get a new allocation, token and pool
// grant. Nothing changes unless every set succeeds and the checkpoint is
// saved. held is the listing settle decided by. It returns each set's
// token, or errChanged when the allocations changed since settle.
func (l *ledger) grant(sets [][]string, held map[string]string) ([]string, []string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if reclaim, err := l.decideLocked(sets, held); err != nil || len(reclaim) > 0 {
		if err == nil {
			err = errChanged
		}
		return nil, nil, err
	}
	var created []*alloc
	rollback := func() {
		for _, a := range created {
			l.dropLocked(a)
			// Never handed out: nobody could have written the chunks.
			if _, err := l.pool.Revoke(a.ID()); err == nil {
				for _, d := range a.Devices {
					// Revoke just made d dirty: Scrubbed cannot refuse it.
					_ = l.pool.Scrubbed(d)
				}
			}
		}
	}
	now := l.now()
	tokens := make([]string, 0, len(sets))
	for _, ids := range sets {
		a := l.byDevice[ids[0]]
		if a == nil {
			a = &alloc{Record: Record{Token: contract.NewToken(), Devices: ids, FirstSeen: now}, lastSeen: now}
			if err := l.pool.Grant(a.ID(), ids); err != nil {
				rollback()
				return nil, nil, allocErr(ResultRefused, "%v: %v", ids, err)
			}
			a.granted = true
			l.allocs[a.Token] = a
			for _, d := range ids {
				l.byDevice[d] = a
			}
			created = append(created, a)
		} else {
			l.grantLocked(a)
			if !a.granted {
				rollback()
				return nil, nil, allocErr(ResultUnavailable, "%v: restored allocation not yet granted by the pool", ids)
			}
			if a.Pod == "" {
				a.lastSeen = now // kubelet is still admitting its pod
			}
		}
		tokens = append(tokens, a.Token)
	}
	if len(created) > 0 {
		if err := l.saveLocked(); err != nil {
			rollback()
			return nil, nil, allocErr(ResultFailed, "%v", err)
		}
	}
	ids := make([]string, len(created))
	for i, a := range created {
		ids[i] = a.ID()
		l.log.Info("allocated", "allocation", a.ID(), "devices", a.Devices)
	}
	if len(created) > 0 {
		l.bumpLocked()
	}
	return tokens, ids, nil
}

func (l *ledger) dropLocked(a *alloc) {
	delete(l.allocs, a.Token)
	for _, d := range a.Devices {
		if l.byDevice[d] == a {
			delete(l.byDevice, d)
		}
	}
}

// reclaimLocked ends an allocation: the pool closes its sessions and drops
// its streams, and each chunk stays dirty (advertised unhealthy, never
// granted) until Renew has put fresh memory behind it.
func (l *ledger) reclaimLocked(a *alloc) error {
	l.dropLocked(a)
	chunks, err := l.pool.Revoke(a.ID())
	if errors.Is(err, poolerr.ErrUnknownAllocation) {
		// Restored from the checkpoint but never granted in this process:
		// the chunks are the ones this process allocated; no client has
		// had them.
		return nil
	}
	if err != nil {
		return fmt.Errorf("reclaim %v: %w", a.Devices, err)
	}
	for _, c := range chunks {
		l.dirty[c.ID] = true
		delete(l.retry, c.ID)
	}
	if l.reclaimed != nil {
		pod := a.Pod
		if a.Claim != nil {
			pod = a.Claim.Namespace + "/" + a.Claim.Name
		}
		l.reclaimed(pod, slices.Clone(a.Devices))
	}
	l.bumpLocked()
	select {
	case l.kick <- struct{}{}:
	default:
	}
	return nil
}

// setWithheldLocked recomputes the devices advertised unhealthy: the
// dirty ones (a reclaimed chunk not yet renewed), and the ones a
// ResourceClaim holds (after a move from the DRA driver back to the device
// plugin), because only they must not go to a pod. A chunk whose pod is gone stays healthy during the grace
// period: kubelet frees a pod's devices only once the pod is no longer active
// (the same test PodResources lists by), and when it hands them to a new pod,
// Allocate reclaims the old allocation (sessions closed, chunks renewed)
// before it grants them. Advertising them unhealthy would only make kubelet
// refuse pods bound in that window (UnexpectedAdmissionError) for nothing.
func (l *ledger) setWithheldLocked() {
	w := make(map[string]bool)
	for id := range l.dirty {
		w[id] = true
	}
	for id, a := range l.byDevice {
		if a.Claim != nil {
			w[id] = true
		}
	}
	if maps.Equal(w, l.withheld) {
		return
	}
	l.withheld = w
	close(l.overlay)
	l.overlay = make(chan struct{})
}

// chunkHealthLocked reports a chunk's renewal outcome to Options.ChunkHealth
// once per change: the first failure, and the recovery of a chunk that failed.
func (l *ledger) chunkHealthLocked(id string, healthy bool, reason string) {
	if l.scrubFailed[id] == !healthy {
		return
	}
	if healthy {
		delete(l.scrubFailed, id)
	} else {
		l.scrubFailed[id] = true
	}
	if l.chunkHealth != nil {
		l.chunkHealth(id, healthy, reason)
	}
}

// Renewal backoff: the first retry after RenewRetryFirst, doubling up to
// RenewRetryCap.
const (
	RenewRetryFirst = time.Second
	RenewRetryCap   = time.Minute
)

type retry struct {
	failures int
	next     time.Time
}

// renewed records the outcome of renewing a dirty chunk: on success the
// pool may grant it again; on failure it stays dirty and is retried after a
// backoff. It returns the error that keeps the chunk dirty, nil once it is
// clean.
func (l *ledger) renewed(id string, err error) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.dirty[id] {
		return nil
	}
	if err == nil {
		if serr := l.pool.Scrubbed(id); serr != nil && !errors.Is(serr, poolerr.ErrUnknownChunk) {
			err = fmt.Errorf("marking it clean in the pool: %w", serr)
		}
	}
	if err != nil {
		r := l.retry[id]
		wait := min(RenewRetryFirst<<min(r.failures, 16), RenewRetryCap)
		r.failures++
		r.next = l.now().Add(wait)
		l.retry[id] = r
		l.log.Error("renew chunk", "chunk", id, "failures", r.failures, "retryIn", wait, "err", err)
		l.chunkHealthLocked(id, false, "renewing failed: "+err.Error())
		return err
	}
	delete(l.dirty, id)
	delete(l.retry, id)
	l.chunkHealthLocked(id, true, "")
	l.bumpLocked()
	return nil
}

// due lists the dirty chunks whose renewal (or retry) is due now.
func (l *ledger) due() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	var due []string
	for _, id := range slices.Sorted(maps.Keys(l.dirty)) {
		if r, ok := l.retry[id]; !ok || !now.Before(r.next) {
			due = append(due, id)
		}
	}
	return due
}

// settled updates the withheld devices after renewals and returns when the
// earliest remaining retry is due (zero when no chunk is dirty).
func (l *ledger) settled() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.setWithheldLocked()
	var next time.Time
	for id := range l.dirty {
		if t := l.retry[id].next; next.IsZero() || t.Before(next) {
			next = t
		}
	}
	return next
}

// reconcile compares the allocations with held (PodResources' answer): an
// allocation a pod holds is kept; one that no pod has held for the grace
// period (counted from Allocate, or from the last time a pod held it) is
// reclaimed. It returns the IDs of the allocations it reclaimed, the
// errors of the reclaims that failed, and the error of saving the
// checkpoint.
func (l *ledger) reconcile(held map[string]string) (reclaimed []string, reclaimErr, err error) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	changed := false
	var errs []error
	for _, a := range slices.Collect(maps.Values(l.allocs)) {
		l.grantLocked(a)
		if a.Claim != nil {
			continue // a claim's allocation ends with its Unprepare, never by PodResources
		}
		if holder := holderOf(a, held); holder != "" {
			if a.Pod != holder {
				l.log.Info("allocation held by pod", "allocation", a.ID(), "pod", holder, "devices", a.Devices)
				a.Pod = holder
				changed = true
			}
			a.lastSeen = now
			continue
		}
		if now.Sub(a.lastSeen) < l.grace {
			continue
		}
		l.log.Info("reclaiming allocation of a pod that is gone", "allocation", a.ID(), "pod", a.Pod, "devices", a.Devices, "unheldFor", now.Sub(a.lastSeen))
		if err := l.reclaimLocked(a); err != nil {
			l.log.Error("reclaim", "err", err)
			errs = append(errs, err)
		} else {
			reclaimed = append(reclaimed, a.ID())
		}
		changed = true
	}
	l.setWithheldLocked()
	if changed {
		if serr := l.saveLocked(); serr != nil {
			err = fmt.Errorf("reconcile: %w", serr)
		}
	}
	return reclaimed, errors.Join(errs...), err
}
