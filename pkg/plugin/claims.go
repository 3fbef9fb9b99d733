package plugin

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/observe"
)

// The DRA front door. The DRA driver (internal/dra) turns a ResourceClaim
// kubelet asks it to prepare into a Claim and calls PrepareClaim; the
// ledger then grants the chunks exactly as an Allocate does (a fresh token
// per request, the pool's grant, the checkpoint), keeps the allocation
// until UnprepareClaim, and renews the chunks (fresh memory) before they
// are offered again. The device plugin and the DRA driver are two doors to
// this one ledger: a chunk is held by at most one allocation, whichever
// door made it.

// Claim is what the DRA driver asks to prepare: one ResourceClaim's
// requests for this driver's devices.
type Claim struct {
	UID, Namespace, Name string
	// PodUIDs are the pods the claim is reserved for (its status's
	// reservedFor); with BindPods its tokens work only from them.
	PodUIDs  []string
	Requests []ClaimRequest
}

// ClaimRequest is one request of a claim: the chunks the scheduler
// allocated to it by name (Devices), and shares of GPUs' consumable
// devices, whose chunks the ledger picks (Shares). At least one chunk in
// all.
type ClaimRequest struct {
	Name    string
	Devices []string
	Shares  []Share
}

// ClaimGrant is a prepared request: its token and chunks.
type ClaimGrant struct {
	Request string
	Token   string
	Devices []string // sorted
}

// ClaimError results: Prepare's errors are *AllocateError values with the
// Result* constants (invalid, refused, unavailable, failed), like an
// Allocate's.

// maxClaimRequests bounds the requests of one claim (the API allows 32).
const maxClaimRequests = 64

// PrepareClaim grants each request of c its chunks under a fresh token,
// records them in the checkpoint and returns the grants, in the order of
// c.Requests. A claim prepared before with the same requests gets the same
// grants again (its pods updated): kubelet retries and calls Prepare for
// every pod that uses a shared claim. A claim prepared with other requests
// is refused: it must be unprepared first. Chunks a claim released a moment
// ago are renewed now, before they are granted; chunks another allocation
// holds are refused. Nothing changes unless every request is granted.
func (p *Plugin) PrepareClaim(ctx context.Context, c Claim) ([]ClaimGrant, error) {
	if err := p.checkClaim(c); err != nil {
		return nil, err
	}
	p.renewMu.Lock()
	defer p.renewMu.Unlock()
	for attempt := 1; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return nil, allocErr(ResultUnavailable, "prepare claim %s: %v", c.UID, err)
		}
		grants, plan, err := p.l.prepared(c)
		if err != nil || grants != nil {
			return grants, err
		}
		for _, id := range plan.renew {
			if rerr := p.renew(id); rerr != nil {
				p.l.settled()
				return nil, allocErr(ResultUnavailable, "claim %s/%s: chunk %s could not be renewed after its last holder: %v", c.Namespace, c.Name, id, rerr)
			}
		}
		if len(plan.renew) > 0 {
			p.l.settled()
		}
		grants, err = p.l.grantClaim(c, plan)
		if !errors.Is(err, errChanged) {
			return grants, err
		}
		if attempt == allocateAttempts {
			return nil, allocErr(ResultUnavailable, "claim %s/%s: %v %d times; retry", c.Namespace, c.Name, err, attempt)
		}
	}
}

// checkClaim validates c before anything is looked up.
func (p *Plugin) checkClaim(c Claim) error {
	switch {
	case !ValidUID(c.UID):
		return allocErr(ResultInvalid, "claim UID %q is not a UID", c.UID)
	case c.Namespace == "" || c.Name == "":
		return allocErr(ResultInvalid, "claim %s has no namespace or name", c.UID)
	case len(c.Requests) == 0:
		return allocErr(ResultInvalid, "claim %s/%s has no request for this driver", c.Namespace, c.Name)
	case len(c.Requests) > maxClaimRequests:
		return allocErr(ResultInvalid, "claim %s/%s has %d requests, at most %d", c.Namespace, c.Name, len(c.Requests), maxClaimRequests)
	}
	for _, u := range c.PodUIDs {
		if !ValidUID(u) {
			return allocErr(ResultInvalid, "claim %s/%s: pod UID %q is not a UID", c.Namespace, c.Name, u)
		}
	}
	devs, _ := p.o.Devices.Devices()
	known := make(map[string]Device, len(devs))
	for _, d := range devs {
		known[d.ID] = d
	}
	names := map[string]bool{}
	named := map[string]string{}
	for _, r := range c.Requests {
		if r.Name == "" || names[r.Name] {
			return allocErr(ResultInvalid, "claim %s/%s: request name %q empty or repeated", c.Namespace, c.Name, r.Name)
		}
		names[r.Name] = true
		if len(r.Devices) == 0 && len(r.Shares) == 0 {
			return allocErr(ResultInvalid, "claim %s/%s: request %s asks for no chunk", c.Namespace, c.Name, r.Name)
		}
		for _, s := range r.Shares {
			if s.Chunks <= 0 || s.GPU < 0 {
				return allocErr(ResultInvalid, "claim %s/%s: request %s: share of %d chunks of GPU %d", c.Namespace, c.Name, r.Name, s.Chunks, s.GPU)
			}
		}
		for _, id := range r.Devices {
			if other, dup := named[id]; dup {
				return allocErr(ResultInvalid, "claim %s/%s: chunk %s named by requests %s and %s", c.Namespace, c.Name, id, other, r.Name)
			}
			named[id] = r.Name
			d, ok := known[id]
			switch {
			case !ok:
				return allocErr(ResultInvalid, "claim %s/%s: unknown chunk %s (not a ready chunk of this node)", c.Namespace, c.Name, id)
			case !d.Healthy:
				return allocErr(ResultRefused, "claim %s/%s: chunk %s is unhealthy", c.Namespace, c.Name, id)
			}
		}
	}
	return nil
}

// claimPlan is what grantClaim grants: per request, the named chunks and
// the picked ones. renew lists the dirty chunks among them, which must be
// renewed first.
type claimPlan struct {
	picked [][]string
	renew  []string
}

// prepared answers a repeated Prepare from the records (grants non-nil),
// refuses a claim prepared with other requests, or plans a new grant:
// which chunks each share gets and which of them must be renewed first.
func (l *ledger) prepared(c Claim) ([]ClaimGrant, *claimPlan, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if have := l.claimAllocsLocked(c.UID); len(have) > 0 {
		grants, err := l.samePrepareLocked(c, have)
		return grants, nil, err
	}
	plan := &claimPlan{picked: make([][]string, len(c.Requests))}
	taken := map[string]bool{}
	for _, r := range c.Requests {
		for _, id := range r.Devices {
			taken[id] = true
			if a := l.byDevice[id]; a != nil {
				return nil, nil, allocErr(ResultRefused, "claim %s/%s: chunk %s is held by %s", c.Namespace, c.Name, id, holderName(a))
			}
			if l.dirty[id] {
				plan.renew = append(plan.renew, id)
			}
		}
	}
	for i, r := range c.Requests {
		for _, s := range r.Shares {
			ids, renew, err := l.pickLocked(s, taken)
			if err != nil {
				return nil, nil, allocErr(ResultUnavailable, "claim %s/%s: request %s: %v", c.Namespace, c.Name, r.Name, err)
			}
			plan.picked[i] = append(plan.picked[i], ids...)
			plan.renew = append(plan.renew, renew...)
		}
	}
	return nil, plan, nil
}

// holderName says who holds an allocation, for errors.
func holderName(a *alloc) string {
	if a.Claim != nil {
		return fmt.Sprintf("ResourceClaim %s/%s", a.Claim.Namespace, a.Claim.Name)
	}
	if a.Pod != "" {
		return "the device plugin's allocation of pod " + a.Pod
	}
	return "a device plugin allocation"
}

// pickLocked chooses s.Chunks chunks of GPU s.GPU that no allocation
// holds and taken does not name, clean ones first (in chunk order), then
// dirty ones (returned in renew too: they are renewed before the grant).
// Too few is an error that says why; kubelet retries.
func (l *ledger) pickLocked(s Share, taken map[string]bool) (ids, renew []string, err error) {
	devs, _ := l.devices.Devices()
	var clean, dirty []string
	for _, d := range devs {
		g, _, _, perr := contract.ParseChunkID(d.ID)
		if perr != nil || g != s.GPU || !d.Healthy || taken[d.ID] || l.byDevice[d.ID] != nil {
			continue
		}
		if l.dirty[d.ID] {
			dirty = append(dirty, d.ID)
		} else {
			clean = append(clean, d.ID)
		}
	}
	byIndex := func(a, b string) int {
		_, _, ia, _ := contract.ParseChunkID(a)
		_, _, ib, _ := contract.ParseChunkID(b)
		return cmp.Or(cmp.Compare(ia, ib), strings.Compare(a, b))
	}
	slices.SortFunc(clean, byIndex)
	slices.SortFunc(dirty, byIndex)
	if len(clean)+len(dirty) < s.Chunks {
		return nil, nil, fmt.Errorf("GPU %d has %d free chunks, the share needs %d (chunks of an allocation that is ending come back once it has been released)", s.GPU, len(clean)+len(dirty), s.Chunks)
	}
	ids = append(ids, clean[:min(len(clean), s.Chunks)]...)
	if n := s.Chunks - len(ids); n > 0 {
		renew = dirty[:n]
		ids = append(ids, renew...)
	}
	for _, id := range ids {
		taken[id] = true
	}
	return ids, renew, nil
}

// claimAllocsLocked lists the allocations of the claim with UID uid.
func (l *ledger) claimAllocsLocked(uid string) []*alloc {
	var out []*alloc
	for _, a := range l.allocs {
		if a.Claim != nil && a.Claim.UID == uid {
			out = append(out, a)
		}
	}
	return out
}

// samePrepareLocked answers a Prepare of a claim already prepared: the
// same requests get their grants again, and the claim's pods are updated
// (and saved); other requests are refused.
func (l *ledger) samePrepareLocked(c Claim, have []*alloc) ([]ClaimGrant, error) {
	byReq := make(map[string]*alloc, len(have))
	for _, a := range have {
		byReq[a.Claim.Request] = a
	}
	mismatch := func(why string) error {
		return allocErr(ResultRefused, "claim %s/%s is prepared already, with other devices (%s); kubelet must unprepare it first", c.Namespace, c.Name, why)
	}
	if len(byReq) != len(c.Requests) {
		return nil, mismatch(fmt.Sprintf("%d requests prepared, %d asked", len(byReq), len(c.Requests)))
	}
	grants := make([]ClaimGrant, len(c.Requests))
	changed := false
	pods := slices.Sorted(slices.Values(slices.Clone(c.PodUIDs)))
	pods = slices.Compact(pods)
	for i, r := range c.Requests {
		a := byReq[r.Name]
		if a == nil {
			return nil, mismatch("request " + r.Name + " was not prepared")
		}
		named := slices.DeleteFunc(slices.Clone(a.Devices), func(d string) bool {
			_, picked := slices.BinarySearch(a.Claim.Picked, d)
			return picked
		})
		if !slices.Equal(named, slices.Sorted(slices.Values(slices.Clone(r.Devices)))) || !slices.Equal(a.Claim.Shares, r.Shares) {
			return nil, mismatch("request " + r.Name + " differs")
		}
		if !slices.Equal(a.Claim.PodUIDs, pods) {
			a.Claim.PodUIDs = pods
			changed = true
		}
		l.grantLocked(a)
		if !a.granted {
			return nil, allocErr(ResultUnavailable, "claim %s/%s: restored allocation not yet granted by the pool (its chunks are not ready yet)", c.Namespace, c.Name)
		}
		grants[i] = ClaimGrant{Request: r.Name, Token: a.Token, Devices: slices.Clone(a.Devices)}
	}
	if changed {
		if err := l.saveLocked(); err != nil {
			return nil, allocErr(ResultFailed, "%v", err)
		}
	}
	return grants, nil
}

// grantClaim grants the plan: one new allocation per request, all or
// none, saved in the checkpoint. errChanged: something changed since
// prepared planned it (the caller plans again).
func (l *ledger) grantClaim(c Claim, plan *claimPlan) ([]ClaimGrant, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.claimAllocsLocked(c.UID)) > 0 {
		return nil, errChanged
	}
	var created []*alloc
	rollback := func() {
		for _, a := range created {
			l.dropLocked(a)
			if _, err := l.pool.Revoke(a.ID()); err == nil {
				for _, d := range a.Devices {
					_ = l.pool.Scrubbed(d) // never handed out: nobody wrote the chunks
				}
			}
		}
	}
	pods := slices.Compact(slices.Sorted(slices.Values(slices.Clone(c.PodUIDs))))
	now := l.now()
	grants := make([]ClaimGrant, len(c.Requests))
	for i, r := range c.Requests {
		ids := slices.Sorted(slices.Values(append(slices.Clone(r.Devices), plan.picked[i]...)))
		for _, id := range ids {
			if l.byDevice[id] != nil || l.dirty[id] {
				rollback()
				return nil, errChanged
			}
		}
		ref := &ClaimRef{UID: c.UID, Namespace: c.Namespace, Name: c.Name, Request: r.Name, PodUIDs: pods,
			Shares: slices.Clone(r.Shares), Picked: slices.Sorted(slices.Values(slices.Clone(plan.picked[i])))}
		a := &alloc{Record: Record{Token: contract.NewToken(), Devices: ids, FirstSeen: now, Claim: ref}, lastSeen: now}
		if err := l.pool.Grant(a.ID(), ids); err != nil {
			rollback()
			return nil, allocErr(ResultRefused, "claim %s/%s: request %s: %v", c.Namespace, c.Name, r.Name, err)
		}
		a.granted = true
		l.allocs[a.Token] = a
		for _, d := range ids {
			l.byDevice[d] = a
		}
		created = append(created, a)
		grants[i] = ClaimGrant{Request: r.Name, Token: a.Token, Devices: slices.Clone(ids)}
	}
	if err := l.saveLocked(); err != nil {
		rollback()
		return nil, allocErr(ResultFailed, "%v", err)
	}
	for _, a := range created {
		l.log.Info("claim prepared", "claim", c.Namespace+"/"+c.Name, "uid", c.UID, "request", a.Claim.Request,
			"allocation", a.ID(), "devices", a.Devices)
	}
	l.setWithheldLocked()
	l.bumpLocked()
	return grants, nil
}

// UnprepareClaim ends the allocations of the claim with UID uid: the pool
// closes their sessions, and their chunks are renewed (fresh memory) before
// any door offers them again. An unknown claim (never prepared, or
// unprepared already) is not an error: kubelet repeats Unprepare. It
// returns how many allocations it ended.
func (p *Plugin) UnprepareClaim(uid string) (int, error) {
	if !ValidUID(uid) {
		return 0, allocErr(ResultInvalid, "claim UID %q is not a UID", uid)
	}
	ended, err := p.l.unprepare(uid)
	for _, id := range ended {
		p.report(observe.Op{Component: observe.ComponentReclaim, Name: ReclaimUnprepared, Allocation: id})
	}
	if err != nil {
		p.report(observe.Op{Component: observe.ComponentReclaim, Name: ReclaimUnprepared, Err: err})
	}
	return len(ended), err
}

// ReclaimUnprepared is the trigger of a reclaim by the DRA driver's
// Unprepare (kvpool_plugin_reclaims_total{trigger="unprepared"}).
const ReclaimUnprepared = observe.OpUnprepared

func (l *ledger) unprepare(uid string) ([]string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	have := l.claimAllocsLocked(uid)
	if len(have) == 0 {
		return nil, nil
	}
	var ended []string
	var errs []error
	for _, a := range have {
		l.log.Info("claim unprepared", "claim", a.Claim.Namespace+"/"+a.Claim.Name, "uid", uid, "request", a.Claim.Request,
			"allocation", a.ID(), "devices", a.Devices)
		if err := l.reclaimLocked(a); err != nil {
			errs = append(errs, err)
			continue
		}
		ended = append(ended, a.ID())
	}
	l.setWithheldLocked()
	if err := l.saveLocked(); err != nil {
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		return ended, allocErr(ResultFailed, "unprepare claim %s: %v", uid, errors.Join(errs...))
	}
	return ended, nil
}

// Claims lists the allocations the DRA driver prepared, sorted by
// namespace, name and request.
func (p *Plugin) Claims() []Record {
	var out []Record
	for _, r := range p.l.records() {
		if r.Claim != nil {
			out = append(out, r)
		}
	}
	slices.SortFunc(out, func(a, b Record) int {
		return cmp.Or(cmp.Compare(a.Claim.Namespace, b.Claim.Namespace), cmp.Compare(a.Claim.Name, b.Claim.Name),
			cmp.Compare(a.Claim.Request, b.Claim.Request))
	})
	return out
}

// Holder says which door holds a chunk.
type Holder uint8

const (
	HeldFree         Holder = iota // no allocation holds it, and it is clean
	HeldClaim                      // a ResourceClaim's allocation (the DRA driver)
	HeldDevicePlugin               // a device plugin allocation
	HeldRenewing                   // released, waiting for fresh memory
)

func (h Holder) String() string {
	switch h {
	case HeldFree:
		return "free"
	case HeldClaim:
		return "claim"
	case HeldDevicePlugin:
		return "device-plugin"
	case HeldRenewing:
		return "renewing"
	}
	return fmt.Sprintf("Holder(%d)", uint8(h))
}

// ChunkHolders says who holds each chunk the ledger knows as held or renewing
// (a chunk missing from the map is free), and returns a channel closed at
// the ledger's next change: the DRA driver publishes what is free or a
// claim's, and nothing that renews or a device plugin allocation holds.
func (p *Plugin) ChunkHolders() (map[string]Holder, <-chan struct{}) {
	p.l.mu.Lock()
	defer p.l.mu.Unlock()
	out := make(map[string]Holder, len(p.l.byDevice)+len(p.l.dirty))
	for id, a := range p.l.byDevice {
		if a.Claim != nil {
			out[id] = HeldClaim
		} else {
			out[id] = HeldDevicePlugin
		}
	}
	for id := range maps.Keys(p.l.dirty) {
		out[id] = HeldRenewing
	}
	return out, p.l.changed
}

// Maintain runs the plugin's background work without the device plugin
// door: allocations of pods that are gone are reclaimed (device plugin
// allocations left from before a move to the DRA driver: PodResources
// still lists their pods) and released chunks are renewed. The DRA driver's
// agent runs it instead of Run; it returns when ctx ends.
func (p *Plugin) Maintain(ctx context.Context) error {
	return p.run(ctx, false)
}
