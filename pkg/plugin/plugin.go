// Package plugin is kvpool's kubelet device plugin: it advertises the pool's
// ready chunks as devices of one extended resource, hands each container an
// allocation token bound to exactly the chunks kubelet assigned to it, and
// reclaims the chunks of pods that are gone: a reclaimed chunk's memory is
// dropped and a fresh one put behind the same device ID before the device is
// offered again, so no byte and no mapping passes from one pod to the next.
//
// The agent feeds the plugin full device snapshots through a Source; the
// plugin diffs them and streams them to kubelet. Allocations (token, chunk
// IDs, when first seen, which pod holds them) live in memory, in a checkpoint
// in the state directory, and are reconciled against kubelet's PodResources
// service.
package plugin

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/pool"
)

// Defaults. What a container sees (mount, socket, environment) is in
// pkg/contract.
const (
	DefaultKubeletDir  = "/var/lib/kubelet"
	DefaultSocketDir   = "/var/lib/kvpool/sock"
	DefaultStateDir    = "/var/lib/kvpool/state"
	DefaultGracePeriod = 2 * time.Minute
	DefaultInterval    = 10 * time.Second
	DefaultWatch       = time.Second
)

// Pool is the part of *pool.Pool the plugin uses.
type Pool interface {
	Grant(alloc string, ids []string) error
	Revoke(alloc string) ([]pool.Chunk, error)
	Scrubbed(id string) error
}

// Holders says which pod holds which device of a resource; the plugin's
// PodResourcesClient is the real one.
type Holders interface {
	Held(ctx context.Context, resource string) (map[string]string, error)
}

// Options configure a Plugin. Pool, Devices and Renew are required.
type Options struct {
	ResourceName string // default contract.DefaultResourceName
	KubeletDir   string // default DefaultKubeletDir; device-plugins/ and pod-resources/ live inside
	SocketDir    string // host directory holding the agent socket; default DefaultSocketDir
	StateDir     string // checkpoint directory; default DefaultStateDir

	Pool    Pool
	Devices Source
	// Renew drops a reclaimed chunk's memory (the agent closes and unmaps
	// it; a pod that still maps it or holds its fd keeps only that old
	// memory) and puts a fresh chunk (new memfd, bound, pre-faulted, locked,
	// sealed) behind the same ID. The device stays listed, advertised
	// unhealthy, until Renew succeeds; a failure is retried with backoff.
	// It is called without the plugin's lock, one chunk at a time, and may
	// take as long as allocating the chunk takes.
	Renew func(id string) error
	// Holders overrides the PodResources client dialled from KubeletDir.
	Holders Holders

	// Reclaimed, when set, is told of each allocation taken back: the pod
	// that last held it ("" if none was seen) and its chunk IDs.
	Reclaimed func(pod string, devices []string)
	// ChunkHealth, when set, is told when renewing a chunk fails (healthy
	// false, with the error) and when a chunk that failed is renewed at last.
	// Both hooks run under the plugin's lock and must not block.
	ChunkHealth func(id string, healthy bool, reason string)

	// BindPods makes AuthorizePeer accept a token only from a process in
	// the pod that holds the allocation (cluster mode). ProcRoot (default
	// /proc) is where the clients' /proc/<pid>/cgroup are read; PodLogsDir
	// (default /var/log/pods, kubelet's podLogsDir) is where kubelet's
	// <namespace>_<name>_<uid> directories tie pod names to UIDs.
	BindPods   bool
	ProcRoot   string
	PodLogsDir string

	GracePeriod time.Duration // an unheld allocation lives this long; default 2m
	Interval    time.Duration // reconcile period; default 10s
	Watch       time.Duration // kubelet socket poll period; default 1s
	Now         func() time.Time
	Logger      *slog.Logger
}

func (o *Options) setDefaults() error {
	if o.Pool == nil || o.Devices == nil || o.Renew == nil {
		return errors.New("plugin: Options need Pool, Devices and Renew")
	}
	def := func(s *string, v string) {
		if *s == "" {
			*s = v
		}
	}
	def(&o.ResourceName, contract.DefaultResourceName)
	def(&o.KubeletDir, DefaultKubeletDir)
	def(&o.SocketDir, DefaultSocketDir)
	def(&o.StateDir, DefaultStateDir)
	def(&o.ProcRoot, DefaultProcRoot)
	def(&o.PodLogsDir, DefaultPodLogsDir)
	if err := contract.CheckResourceName(o.ResourceName); err != nil {
		return fmt.Errorf("plugin: resource name %w", err)
	}
	if !filepath.IsAbs(o.SocketDir) {
		return fmt.Errorf("plugin: socket directory %q is not absolute", o.SocketDir)
	}
	if o.GracePeriod <= 0 {
		o.GracePeriod = DefaultGracePeriod
	}
	if o.Interval <= 0 {
		o.Interval = DefaultInterval
	}
	if o.Watch <= 0 {
		o.Watch = DefaultWatch
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return nil
}

// Plugin is the device plugin server and the allocation bookkeeping.
type Plugin struct {
	pluginapi.UnimplementedDevicePluginServer

	o   Options
	log *slog.Logger

	// renewMu serializes renewals; taken before mu, never after.
	renewMu sync.Mutex
	kick    chan struct{} // wakes the renew loop

	mu       sync.Mutex
	allocs   map[string]*alloc // by token
	byDevice map[string]*alloc
	dirty    map[string]bool // revoked chunks not yet renewed
	retry    map[string]retry
	// scrubFailed: chunks reported unhealthy to Options.ChunkHealth
	scrubFailed map[string]bool
	withheld    map[string]bool // devices advertised unhealthy: dirty (not yet scrubbed)
	overlay     chan struct{}   // closed when withheld changes
	// stopping is closed when the agent stops: ListAndWatch then sends an
	// empty device list, so kubelet drops the capacity at once.
	stopping chan struct{}
	stopOnce sync.Once

	registrations atomic.Int64
	registered    atomic.Bool
}

type alloc struct {
	Record
	granted  bool      // the pool holds the grant
	lastSeen time.Time // last time a pod held it; FirstSeen until then
}

// New builds a Plugin and restores the allocations of its checkpoint. A
// corrupt checkpoint is moved aside and reported in the log; the plugin then
// starts empty, which is safe: chunks kubelet still assigns to pods are never
// handed to another pod by kubelet, and no token from the lost file grants
// anything.
func New(o Options) (*Plugin, error) {
	if err := o.setDefaults(); err != nil {
		return nil, err
	}
	p := &Plugin{
		o:           o,
		log:         o.Logger.With("component", "plugin", "resource", o.ResourceName),
		allocs:      make(map[string]*alloc),
		byDevice:    make(map[string]*alloc),
		dirty:       make(map[string]bool),
		retry:       make(map[string]retry),
		kick:        make(chan struct{}, 1),
		scrubFailed: make(map[string]bool),
		withheld:    make(map[string]bool),
		overlay:     make(chan struct{}),
		stopping:    make(chan struct{}),
	}
	recs, err := LoadCheckpoint(o.StateDir)
	if errors.Is(err, ErrCorruptCheckpoint) {
		moved, qerr := quarantineCheckpoint(o.StateDir, o.Now())
		p.log.Error("checkpoint is corrupt; starting without recorded allocations", "err", err, "movedTo", moved, "moveErr", qerr)
		if qerr != nil {
			return nil, errors.Join(err, qerr)
		}
		recs = nil
	} else if err != nil {
		return nil, err
	}
	now := o.Now()
	for _, r := range recs {
		a := &alloc{Record: r, lastSeen: now}
		p.allocs[r.Token] = a
		for _, d := range r.Devices {
			p.byDevice[d] = a
		}
		p.grantLocked(a)
	}
	if len(recs) > 0 {
		p.log.Info("restored allocations from checkpoint", "count", len(recs))
	}
	return p, nil
}

// grantLocked asks the pool for a restored allocation's chunks; chunks that
// are not ready yet are retried on the next reconcile.
func (p *Plugin) grantLocked(a *alloc) {
	if a.granted {
		return
	}
	if err := p.o.Pool.Grant(a.ID(), a.Devices); err != nil {
		p.log.Debug("grant of restored allocation deferred", "pod", a.Pod, "devices", a.Devices, "err", err)
		return
	}
	a.granted = true
}

// Allocations lists the allocations the plugin knows, sorted by first device.
func (p *Plugin) Allocations() []Record {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.recordsLocked()
}

func (p *Plugin) recordsLocked() []Record {
	out := make([]Record, 0, len(p.allocs))
	for _, a := range p.allocs {
		r := a.Record
		r.Devices = slices.Clone(r.Devices)
		out = append(out, r)
	}
	slices.SortFunc(out, func(a, b Record) int { return strings.Compare(a.Devices[0], b.Devices[0]) })
	return out
}

func (p *Plugin) saveLocked() error {
	return SaveCheckpoint(p.o.StateDir, p.recordsLocked())
}

// Registrations counts successful registrations with kubelet.
func (p *Plugin) Registrations() int64 { return p.registrations.Load() }

// Registered says whether the plugin is registered with the kubelet that is
// running now (for readiness): false from the moment a kubelet restart is
// seen until the next registration succeeds.
func (p *Plugin) Registered() bool { return p.registered.Load() }

// AllocationID is the pool's name for the allocation of token: a prefix
// of the token's SHA-256, so that listings of the pool (status, metrics,
// logs) never show a token, and no token can be worked back from them.
func AllocationID(token string) string {
	sum := sha256.Sum256([]byte(token))
	return "alloc-" + hex.EncodeToString(sum[:8])
}

// ID is the allocation's name in the pool.
func (r Record) ID() string { return AllocationID(r.Token) }

// ErrUnknownToken is returned by Authorize for a token no allocation has.
var ErrUnknownToken = contract.ErrUnknownToken

// Authorize maps a client's token (KVPOOL_TOKEN) to the pool allocation it
// may open sessions on. It fits the copy server's Authorizer.
func (p *Plugin) Authorize(token string) (string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	a, ok := p.allocs[token]
	if !ok {
		return "", ErrUnknownToken
	}
	if !a.granted {
		p.grantLocked(a)
		if !a.granted {
			return "", fmt.Errorf("%w: the allocation's chunks are not ready yet", pool.ErrNotReady)
		}
	}
	return a.ID(), nil
}

// GrantPending grants the restored allocations whose chunks have become
// ready; the agent calls it as each chunk joins the pool, so that a
// restored allocation is usable the moment its chunks are.
func (p *Plugin) GrantPending() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, a := range p.allocs {
		p.grantLocked(a)
	}
}

// GetDevicePluginOptions implements the device plugin API.
func (p *Plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true}, nil
}

// PreStartContainer implements the device plugin API; nothing to do.
func (p *Plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

// snapshot is the list kubelet should see now and the channels that signal a
// change of either input.
func (p *Plugin) snapshot() ([]*pluginapi.Device, <-chan struct{}, <-chan struct{}) {
	devs, srcCh := p.o.Devices.Devices()
	p.mu.Lock()
	withheld := maps.Clone(p.withheld)
	ovCh := p.overlay
	p.mu.Unlock()
	out := make([]*pluginapi.Device, len(devs))
	for i, d := range devs {
		health := pluginapi.Healthy
		if !d.Healthy || withheld[d.ID] {
			health = pluginapi.Unhealthy
		}
		out[i] = &pluginapi.Device{ID: d.ID, Health: health}
		if d.NUMA >= 0 {
			out[i].Topology = &pluginapi.TopologyInfo{Nodes: []*pluginapi.NUMANode{{ID: int64(d.NUMA)}}}
		}
	}
	return out, srcCh, ovCh
}

func sameList(a, b []*pluginapi.Device) bool {
	return slices.EqualFunc(a, b, func(x, y *pluginapi.Device) bool {
		return x.ID == y.ID && x.Health == y.Health && x.GetTopology().String() == y.GetTopology().String()
	})
}

// ListAndWatch sends the full device list at once and again on every change;
// when the agent stops (Withdraw), an empty list.
func (p *Plugin) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	return p.listAndWatch(stream)
}

// Withdraw makes every ListAndWatch stream send an empty device list and
// end: kubelet then reports the resource's capacity as 0 at once, instead
// of keeping the stopped plugin's devices in capacity (as unhealthy) for its
// endpoint grace period of 5 minutes. Run calls it when its context ends.
func (p *Plugin) Withdraw() {
	p.stopOnce.Do(func() { close(p.stopping) })
}

func (p *Plugin) listAndWatch(stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	var last []*pluginapi.Device
	first := true
	for {
		list, srcCh, ovCh := p.snapshot()
		if first || !sameList(list, last) {
			if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: list}); err != nil {
				return err
			}
			p.log.Debug("sent device list", "devices", len(list))
			last, first = list, false
		}
		select {
		case <-srcCh:
		case <-ovCh:
		case <-stream.Context().Done():
			return nil
		case <-p.stopping:
			if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: []*pluginapi.Device{}}); err != nil {
				return err
			}
			p.log.Info("withdrew every device from kubelet (agent stopping)")
			return nil
		}
	}
}

// setWithheldLocked recomputes the devices advertised unhealthy: only the
// dirty ones (a reclaimed chunk whose scrub failed), because only they must
// not go to a pod. A chunk whose pod is gone stays healthy during the grace
// period: kubelet frees a pod's devices only once the pod is no longer active
// (the same test PodResources lists by), and when it hands them to a new pod,
// Allocate reclaims the old allocation (sessions closed, chunks scrubbed)
// before it grants them. Advertising them unhealthy would only make kubelet
// refuse pods bound in that window (UnexpectedAdmissionError) for nothing.
func (p *Plugin) setWithheldLocked() {
	w := make(map[string]bool)
	for id := range p.dirty {
		w[id] = true
	}
	if maps.Equal(w, p.withheld) {
		return
	}
	p.withheld = w
	close(p.overlay)
	p.overlay = make(chan struct{})
}

// Allocate grants each container's chunks to a fresh token, or returns the
// existing token for a set already allocated, and tells kubelet to mount the
// socket directory and set the environment.
func (p *Plugin) Allocate(ctx context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	devs, _ := p.o.Devices.Devices()
	known := make(map[string]Device, len(devs))
	for _, d := range devs {
		known[d.ID] = d
	}
	if len(req.GetContainerRequests()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "allocate: no container requests")
	}
	// Validate everything before changing anything.
	sets := make([][]string, len(req.GetContainerRequests()))
	inRequest := make(map[string]int)
	for i, cr := range req.GetContainerRequests() {
		ids := cr.GetDevicesIds()
		if len(ids) == 0 {
			return nil, status.Errorf(codes.InvalidArgument, "allocate: container request %d names no devices", i)
		}
		for _, id := range ids {
			if j, dup := inRequest[id]; dup {
				return nil, status.Errorf(codes.InvalidArgument, "allocate: device %s requested twice (container requests %d and %d)", id, j, i)
			}
			inRequest[id] = i
			d, ok := known[id]
			switch {
			case !ok:
				return nil, status.Errorf(codes.InvalidArgument, "allocate: unknown device %s (not a ready chunk of %s)", id, p.o.ResourceName)
			case !d.Healthy:
				return nil, status.Errorf(codes.FailedPrecondition, "allocate: device %s is unhealthy", id)
			}
		}
		sets[i] = slices.Sorted(slices.Values(ids))
	}

	p.renewMu.Lock() // settleConflictsLocked may renew chunks
	defer p.renewMu.Unlock()
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.settleConflictsLocked(ctx, sets); err != nil {
		return nil, err
	}
	resp := &pluginapi.AllocateResponse{}
	var created []*alloc
	rollback := func() {
		for _, a := range created {
			p.dropLocked(a)
			// Never handed out: nobody could have written the chunks.
			if _, err := p.o.Pool.Revoke(a.ID()); err == nil {
				for _, d := range a.Devices {
					p.o.Pool.Scrubbed(d)
				}
			}
		}
	}
	now := p.o.Now()
	for _, ids := range sets {
		a := p.byDevice[ids[0]]
		if a == nil {
			a = &alloc{Record: Record{Token: contract.NewToken(), Devices: ids, FirstSeen: now}, lastSeen: now}
			if err := p.o.Pool.Grant(a.ID(), ids); err != nil {
				rollback()
				return nil, status.Errorf(codes.FailedPrecondition, "allocate %v: %v", ids, err)
			}
			a.granted = true
			p.allocs[a.Token] = a
			for _, d := range ids {
				p.byDevice[d] = a
			}
			created = append(created, a)
		} else {
			p.grantLocked(a)
			if !a.granted {
				rollback()
				return nil, status.Errorf(codes.Unavailable, "allocate %v: restored allocation not yet granted by the pool", ids)
			}
			if a.Pod == "" {
				a.lastSeen = now // kubelet is still admitting its pod
			}
		}
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{
				contract.EnvSocket: contract.ContainerSocket,
				contract.EnvToken:  a.Token,
			},
			// Read-only is enough: connecting to a Unix socket needs write
			// permission on the socket inode, which a read-only bind mount
			// does not take away, and it stops a pod from replacing the
			// socket that other pods connect to.
			Mounts: []*pluginapi.Mount{{ContainerPath: contract.ContainerSocketDir, HostPath: p.o.SocketDir, ReadOnly: true}},
		})
	}
	if len(created) > 0 {
		if err := p.saveLocked(); err != nil {
			rollback()
			return nil, status.Errorf(codes.Internal, "allocate: %v", err)
		}
	}
	for _, a := range created {
		p.log.Info("allocated", "allocation", a.ID(), "devices", a.Devices)
	}
	return resp, nil
}

// settleConflictsLocked makes sure each requested set is either exactly an
// existing allocation that is still live, or made only of free devices. A
// device held by an allocation whose pod kubelet no longer lists is
// reclaimed now (kubelet has given it to someone else; it is authoritative);
// one held by a listed pod is a conflict.
func (p *Plugin) settleConflictsLocked(ctx context.Context, sets [][]string) error {
	var stale []*alloc
	needList := false
	for _, ids := range sets {
		for _, id := range ids {
			if p.dirty[id] {
				return status.Errorf(codes.FailedPrecondition, "allocate: device %s has not been renewed since its last pod", id)
			}
			a := p.byDevice[id]
			if a == nil {
				continue
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
	if !needList {
		return nil
	}
	if p.o.Holders == nil {
		return status.Errorf(codes.FailedPrecondition, "allocate: devices are held by another allocation and there is no PodResources service to check it")
	}
	held, err := p.o.Holders.Held(ctx, p.o.ResourceName)
	if err != nil {
		return status.Errorf(codes.Unavailable, "allocate: devices are held by another allocation; checking it: %v", err)
	}
	var reclaim []*alloc
	for _, a := range stale {
		holder := ""
		for _, d := range a.Devices {
			if h, ok := held[d]; ok {
				holder = h
				break
			}
		}
		switch {
		case holder != "" && slices.ContainsFunc(sets, func(ids []string) bool { return slices.Equal(ids, a.Devices) }):
			// The same set again while its pod is listed: a retry.
		case holder != "":
			return status.Errorf(codes.FailedPrecondition, "allocate: devices %v are held by pod %s", a.Devices, holder)
		default:
			reclaim = append(reclaim, a)
		}
	}
	for _, a := range reclaim {
		p.log.Info("reclaiming allocation reassigned by kubelet", "allocation", a.ID(), "pod", a.Pod, "devices", a.Devices)
		if err := p.reclaimLocked(a); err != nil {
			return status.Errorf(codes.Internal, "allocate: %v", err)
		}
	}
	if len(reclaim) > 0 {
		p.setWithheldLocked()
		if err := p.saveLocked(); err != nil {
			p.log.Error("save checkpoint after reclaim", "err", err)
		}
	}
	// Kubelet wants these chunks now: renew them here rather than in the
	// background (the caller holds renewMu).
	for _, ids := range sets {
		for _, id := range ids {
			if p.dirty[id] {
				p.renewedLocked(id, p.o.Renew(id))
			}
			if p.dirty[id] {
				p.setWithheldLocked()
				return status.Errorf(codes.FailedPrecondition, "allocate: device %s could not be renewed after its last pod", id)
			}
		}
	}
	p.setWithheldLocked()
	return nil
}

func (p *Plugin) dropLocked(a *alloc) {
	delete(p.allocs, a.Token)
	for _, d := range a.Devices {
		if p.byDevice[d] == a {
			delete(p.byDevice, d)
		}
	}
}

// reclaimLocked ends an allocation: the pool closes its sessions and drops
// its streams, and each chunk stays dirty (advertised unhealthy, never
// granted) until Renew has put fresh memory behind it.
func (p *Plugin) reclaimLocked(a *alloc) error {
	p.dropLocked(a)
	chunks, err := p.o.Pool.Revoke(a.ID())
	if errors.Is(err, pool.ErrUnknownAllocation) {
		// Restored from the checkpoint but never granted in this process:
		// the chunks are the ones this process allocated; no client has
		// had them.
		return nil
	}
	if err != nil {
		return fmt.Errorf("reclaim %v: %w", a.Devices, err)
	}
	for _, c := range chunks {
		p.dirty[c.ID] = true
		delete(p.retry, c.ID)
	}
	if p.o.Reclaimed != nil {
		p.o.Reclaimed(a.Pod, slices.Clone(a.Devices))
	}
	select {
	case p.kick <- struct{}{}:
	default:
	}
	return nil
}

// chunkHealth reports a chunk's renewal outcome to Options.ChunkHealth once
// per change: the first failure, and the recovery of a chunk that failed.
func (p *Plugin) chunkHealth(id string, healthy bool, reason string) {
	if p.o.ChunkHealth == nil || p.scrubFailed[id] == !healthy {
		return
	}
	if healthy {
		delete(p.scrubFailed, id)
	} else {
		p.scrubFailed[id] = true
	}
	p.o.ChunkHealth(id, healthy, reason)
}

// Renewal backoff: the first retry after RenewRetryMin, doubling up to
// RenewRetryMax.
const (
	RenewRetryMin = time.Second
	RenewRetryMax = time.Minute
)

type retry struct {
	failures int
	next     time.Time
}

// renewedLocked records the outcome of renewing a dirty chunk: on success
// the pool may grant it again; on failure it stays dirty and is retried
// after a backoff.
func (p *Plugin) renewedLocked(id string, err error) {
	if !p.dirty[id] {
		return
	}
	if err == nil {
		if serr := p.o.Pool.Scrubbed(id); serr != nil && !errors.Is(serr, pool.ErrUnknownChunk) {
			err = fmt.Errorf("marking it clean in the pool: %w", serr)
		}
	}
	if err != nil {
		r := p.retry[id]
		wait := min(RenewRetryMin<<min(r.failures, 16), RenewRetryMax)
		r.failures++
		r.next = p.o.Now().Add(wait)
		p.retry[id] = r
		p.log.Error("renew chunk", "chunk", id, "failures", r.failures, "retryIn", wait, "err", err)
		p.chunkHealth(id, false, "renewing failed: "+err.Error())
		return
	}
	delete(p.dirty, id)
	delete(p.retry, id)
	p.chunkHealth(id, true, "")
}

// renewDirty renews every dirty chunk whose retry is due, each outside the
// plugin's lock, and returns when the earliest remaining retry is due (zero
// when none is left).
func (p *Plugin) renewDirty() time.Time {
	p.renewMu.Lock()
	defer p.renewMu.Unlock()
	p.mu.Lock()
	now := p.o.Now()
	var due []string
	for _, id := range slices.Sorted(maps.Keys(p.dirty)) {
		if r, ok := p.retry[id]; !ok || !now.Before(r.next) {
			due = append(due, id)
		}
	}
	p.mu.Unlock()
	for _, id := range due {
		err := p.o.Renew(id)
		p.mu.Lock()
		p.renewedLocked(id, err)
		p.mu.Unlock()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.setWithheldLocked()
	var next time.Time
	for id := range p.dirty {
		if t := p.retry[id].next; next.IsZero() || t.Before(next) {
			next = t
		}
	}
	return next
}

// Dirty lists the chunks waiting for renewal.
func (p *Plugin) Dirty() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Sorted(maps.Keys(p.dirty))
}

// Reconcile compares the allocations with what PodResources lists: an
// allocation a pod holds is kept; one that no pod has held for the grace
// period (counted from Allocate, or from the last time a pod held it) is
// reclaimed. A failed listing reclaims nothing.
func (p *Plugin) Reconcile(ctx context.Context) error {
	if p.o.Holders == nil {
		return errors.New("reconcile: no PodResources service")
	}
	held, err := p.o.Holders.Held(ctx, p.o.ResourceName)
	if err != nil {
		return fmt.Errorf("reconcile: %w", err)
	}
	err = p.reconcileLocked(held)
	p.renewDirty()
	return err
}

func (p *Plugin) reconcileLocked(held map[string]string) error {
	now := p.o.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	changed := false
	for _, a := range slices.Collect(maps.Values(p.allocs)) {
		p.grantLocked(a)
		holder := ""
		for _, d := range a.Devices {
			if h, ok := held[d]; ok {
				holder = h
				break
			}
		}
		if holder != "" {
			if a.Pod != holder {
				p.log.Info("allocation held by pod", "allocation", a.ID(), "pod", holder, "devices", a.Devices)
				a.Pod = holder
				changed = true
			}
			a.lastSeen = now
			continue
		}
		if now.Sub(a.lastSeen) < p.o.GracePeriod {
			continue
		}
		p.log.Info("reclaiming allocation of a pod that is gone", "allocation", a.ID(), "pod", a.Pod, "devices", a.Devices, "unheldFor", now.Sub(a.lastSeen))
		if err := p.reclaimLocked(a); err != nil {
			p.log.Error("reclaim", "err", err)
		}
		changed = true
	}
	p.setWithheldLocked()
	if changed {
		if err := p.saveLocked(); err != nil {
			return fmt.Errorf("reconcile: %w", err)
		}
	}
	return nil
}
