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
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/pool"
)

// DefaultWatch is the default of Options.Watch. What a container sees
// (mount, socket, environment) is in pkg/contract.
const DefaultWatch = 10 * time.Second

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

// Options configure a Plugin. Pool, Devices and Renew are required, and so
// are the directories and the reclaim periods, which have no default here:
// the agent's configuration (internal/config.Default) is the one place
// their defaults are written, and the agent, the plugin's one caller,
// passes them all. (pkg/ cannot read internal/config, and the
// configuration reading defaults from here would make every reader of it
// import the kubelet API.)
type Options struct {
	ResourceName string // default contract.DefaultResourceName
	KubeletDir   string // required; device-plugins/ and pod-resources/ live inside
	SocketDir    string // host directory holding the agent socket; required, absolute
	StateDir     string // checkpoint directory; required

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
	// One that is also a ContainerLister answers ContainerGPUs.
	Holders Holders
	// GPUResources names the resources whose devices are a container's
	// GPUs (a trailing "*" matches by prefix), for ContainerGPUs: the
	// configuration's gpuResources (its default is the NVIDIA device
	// plugin's). Empty: ContainerGPUs finds none.
	GPUResources []string
	// Observer is told of every Allocate, registration and reconcile
	// (component "plugin") and of every reclaim and renewal (component
	// "reclaim"); default observe.Nop. It must not block.
	Observer observe.Observer

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
	// (kubelet's podLogsDir, required with BindPods) is where kubelet's
	// <namespace>_<name>_<uid> directories tie pod names to UIDs.
	BindPods   bool
	ProcRoot   string
	PodLogsDir string

	GracePeriod time.Duration // an unheld allocation lives this long; 0: reclaimed at the first reconcile that sees no pod hold it
	Interval    time.Duration // reconcile period; required, positive
	// Watch is the period of the fallback poll of the device-plugins
	// directory (kubelet's restart is seen through inotify as it happens);
	// default 10s. A failed listen or registration is retried after the
	// smaller of Watch and 1s.
	Watch  time.Duration
	Now    func() time.Time
	Logger *slog.Logger
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
	def(&o.ProcRoot, DefaultProcRoot)
	if err := contract.CheckResourceName(o.ResourceName); err != nil {
		return fmt.Errorf("plugin: resource name %w", err)
	}
	switch {
	case o.KubeletDir == "" || o.SocketDir == "" || o.StateDir == "":
		return errors.New("plugin: Options need KubeletDir, SocketDir and StateDir")
	case !filepath.IsAbs(o.SocketDir):
		return fmt.Errorf("plugin: socket directory %q is not absolute", o.SocketDir)
	case o.BindPods && o.PodLogsDir == "":
		return errors.New("plugin: BindPods needs PodLogsDir")
	case o.GracePeriod < 0:
		return fmt.Errorf("plugin: grace period %v is negative", o.GracePeriod)
	case o.Interval <= 0:
		return fmt.Errorf("plugin: reconcile interval %v is not positive", o.Interval)
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
	if o.Observer == nil {
		o.Observer = observe.Nop
	}
	return nil
}

// Plugin is the device plugin: the adapter between kubelet's gRPC API
// (Allocate, ListAndWatch, GetPreferredAllocation, registration in run.go)
// and the allocation bookkeeping (ledger.go), which it calls. The slow work
// of an Allocate or a reconcile (asking kubelet's PodResources, renewing
// chunks) runs here, between calls to the ledger, never under its lock.
//
// Lock order: renewMu, then the ledger's mu, then the pool's lock.
// renewMu serializes the Allocates and the renewals, and is held across
// their slow work; Authorize takes only the ledger's lock.
type Plugin struct {
	pluginapi.UnimplementedDevicePluginServer

	o   Options
	log *slog.Logger
	obs observe.Observer
	l   *ledger
	// podResources is the PodResources client New dialled (Options.Holders
	// unset); Close closes it.
	podResources *PodResourcesClient

	// renewMu serializes Allocates and renewals; taken before the
	// ledger's lock, never after.
	renewMu sync.Mutex

	// stopping is closed when the agent stops: ListAndWatch then sends an
	// empty device list, so kubelet drops the capacity at once.
	stopping chan struct{}
	stopOnce sync.Once

	registrations atomic.Int64
	registered    atomic.Bool
}

// New builds a Plugin and restores the allocations of its checkpoint. A
// corrupt checkpoint is moved aside and reported in the log; the plugin then
// starts empty, which is safe: chunks kubelet still assigns to pods are never
// handed to another pod by kubelet, and no token from the lost file grants
// anything. A checkpoint of a newer version (the agent was downgraded) is
// refused (ErrNewerCheckpoint) and left in place for the newer agent. One
// of an older version is converted and rewritten in the current version.
func New(o Options) (*Plugin, error) {
	if err := o.setDefaults(); err != nil {
		return nil, err
	}
	p := &Plugin{
		o:        o,
		log:      o.Logger.With("component", "plugin", "resource", o.ResourceName),
		obs:      o.Observer,
		stopping: make(chan struct{}),
	}
	p.l = newLedger(&p.o, p.log)
	recs, version, err := loadCheckpoint(o.StateDir)
	switch {
	case errors.Is(err, ErrCorruptCheckpoint):
		moved, qerr := quarantineCheckpoint(o.StateDir, o.Now())
		p.log.Error("checkpoint is corrupt; starting without recorded allocations", "err", err, "movedTo", moved, "moveErr", qerr)
		p.report(observe.Op{Name: observe.OpCheckpoint, Err: err})
		if qerr != nil {
			return nil, errors.Join(err, qerr)
		}
		recs = nil
	case errors.Is(err, ErrNewerCheckpoint):
		p.report(observe.Op{Name: observe.OpCheckpoint, Err: err})
		return nil, fmt.Errorf("plugin: %w; run the newer agent again, or move the file away to start without its allocations (their pods then lose their tokens)", err)
	case err != nil:
		return nil, err
	}
	p.l.restore(recs)
	if len(recs) > 0 {
		p.log.Info("restored allocations from checkpoint", "count", len(recs), "version", version)
	}
	if version != 0 && version < checkpointVersion {
		p.migrated(version)
	}
	// Dialled here, not in Run: a client's first open may come before Run
	// starts (the agent serves its socket first), and its pod check needs
	// it. The dial is lazy: it connects on the first call.
	if p.o.Holders == nil {
		c, err := DialPodResources(filepath.Join(o.KubeletDir, "pod-resources", "kubelet.sock"))
		if err != nil {
			return nil, err
		}
		p.o.Holders, p.podResources = c, c
	}
	return p, nil
}

// Close closes the PodResources client New dialled; call it once Run or
// Maintain has returned.
func (p *Plugin) Close() error {
	if p.podResources == nil {
		return nil
	}
	return p.podResources.Close()
}

// migrated rewrites a checkpoint read in an older version in the current
// one. A failure leaves the old file, which still reads, and is retried by
// the next save.
func (p *Plugin) migrated(from int) {
	if err := p.l.save(); err != nil {
		p.log.Warn("checkpoint of an older version not rewritten; it still reads", "version", from, "err", err)
		p.report(observe.Op{Name: observe.OpCheckpoint, Err: err})
		return
	}
	p.log.Info("checkpoint converted", "from", from, "to", checkpointVersion)
}

// report passes one of the plugin's operations to the observer: component
// "plugin" unless op names another.
func (p *Plugin) report(op observe.Op) {
	if op.Component == "" {
		op.Component = observe.ComponentPlugin
	}
	op.GPU = -1
	p.obs.Op(op)
}

// Allocations lists the allocations the plugin knows, sorted by first device.
func (p *Plugin) Allocations() []Record { return p.l.records() }

// Registrations counts successful registrations with kubelet.
func (p *Plugin) Registrations() int64 { return p.registrations.Load() }

// Registered says whether the plugin is registered with the kubelet that is
// running now (for readiness): false from the moment a kubelet restart is
// seen until the next registration succeeds.
func (p *Plugin) Registered() bool { return p.registered.Load() }

// UnhealthyChunks lists the devices kubelet is told are unhealthy now: the
// chunks the agent's feed marks unhealthy and the reclaimed chunks whose
// renewal has failed (and not yet succeeded on a retry). A reclaimed chunk
// waiting for its first renewal is withheld too but is not unhealthy.
func (p *Plugin) UnhealthyChunks() []string {
	devs, _ := p.o.Devices.Devices()
	out := p.l.unhealthyIDs()
	for _, d := range devs {
		if !d.Healthy && !slices.Contains(out, d.ID) {
			out = append(out, d.ID)
		}
	}
	slices.Sort(out)
	return out
}

// UnhealthyByGPU counts UnhealthyChunks by GPU (read from the chunk IDs;
// an ID that is not a chunk ID is left out): the KVPoolNode's
// chunks.unhealthy, which makes its health Degraded.
func (p *Plugin) UnhealthyByGPU() map[int]int {
	out := make(map[int]int)
	for _, id := range p.UnhealthyChunks() {
		if gpu, _, _, err := contract.ParseChunkID(id); err == nil {
			out[gpu]++
		}
	}
	return out
}

// AllocationID is the pool's name for the allocation of token: a prefix
// of the token's SHA-256, so that listings of the pool (status, metrics,
// logs) never show a token, and no token can be worked back from them.
func AllocationID(token string) string {
	sum := sha256.Sum256([]byte(token))
	return "alloc-" + hex.EncodeToString(sum[:8])
}

// ID is the allocation's name in the pool.
func (r Record) ID() string { return AllocationID(r.Token) }

// Authorize maps a client's token (KVPOOL_TOKEN) to the pool allocation it
// may open sessions on. It fits the copy server's Authorizer. It takes only
// the ledger's lock, so it never waits for an Allocate or a reconcile that
// is asking kubelet or renewing chunks.
func (p *Plugin) Authorize(token string) (string, error) { return p.l.authorize(token) }

// GrantPending grants the restored allocations whose chunks have become
// ready; the agent calls it as each chunk joins the pool, so that a
// restored allocation is usable the moment its chunks are.
func (p *Plugin) GrantPending() { p.l.grantPending() }

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
	withheld, ovCh := p.l.overlayView()
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

// Allocate grants each container's chunks to a fresh token, or returns the
// existing token for a set already allocated, and tells kubelet to mount the
// socket directory and set the environment.
func (p *Plugin) Allocate(ctx context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	start := time.Now()
	resp, err := p.allocate(ctx, req)
	p.report(observe.Op{Name: observe.OpAllocate, Duration: time.Since(start), Err: err})
	if err != nil {
		return nil, grpcError(err)
	}
	return resp, nil
}

// grpcError turns an *AllocateError into the gRPC status kubelet sees.
func grpcError(err error) error {
	code := codes.Internal
	var ae *AllocateError
	if errors.As(err, &ae) {
		code = map[string]codes.Code{
			ResultInvalid:     codes.InvalidArgument,
			ResultRefused:     codes.FailedPrecondition,
			ResultUnavailable: codes.Unavailable,
		}[ae.Result]
		if code == codes.OK {
			code = codes.Internal
		}
	}
	return status.Error(code, err.Error())
}

func (p *Plugin) allocate(ctx context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	devs, _ := p.o.Devices.Devices()
	known := make(map[string]Device, len(devs))
	for _, d := range devs {
		known[d.ID] = d
	}
	if len(req.GetContainerRequests()) == 0 {
		return nil, allocErr(ResultInvalid, "no container requests")
	}
	// Validate everything before changing anything.
	sets := make([][]string, len(req.GetContainerRequests()))
	inRequest := make(map[string]int)
	for i, cr := range req.GetContainerRequests() {
		ids := cr.GetDevicesIds()
		if len(ids) == 0 {
			return nil, allocErr(ResultInvalid, "container request %d names no devices", i)
		}
		for _, id := range ids {
			if j, dup := inRequest[id]; dup {
				return nil, allocErr(ResultInvalid, "device %s requested twice (container requests %d and %d)", id, j, i)
			}
			inRequest[id] = i
			d, ok := known[id]
			switch {
			case !ok:
				return nil, allocErr(ResultInvalid, "unknown device %s (not a ready chunk of %s)", id, p.o.ResourceName)
			case !d.Healthy:
				return nil, allocErr(ResultRefused, "device %s is unhealthy", id)
			}
		}
		sets[i] = slices.Sorted(slices.Values(ids))
	}

	tokens, err := p.settleAndGrant(ctx, sets)
	if err != nil {
		return nil, err
	}
	resp := &pluginapi.AllocateResponse{}
	for _, token := range tokens {
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{
				contract.EnvSocket: contract.ContainerSocket,
				contract.EnvToken:  token,
			},
			// Read-only is enough: connecting to a Unix socket needs write
			// permission on the socket inode, which a read-only bind mount
			// does not take away, and it stops a pod from replacing the
			// socket that other pods connect to.
			Mounts: []*pluginapi.Mount{{ContainerPath: contract.ContainerSocketDir, HostPath: p.o.SocketDir, ReadOnly: true}},
		})
	}
	return resp, nil
}

// Reclaim triggers: the operation names of the reclaims the plugin reports
// (component "reclaim"; kvpool_plugin_reclaims_total{trigger}).
const (
	ReclaimPodGone    = observe.OpPodGone    // no pod held the allocation for the grace period
	ReclaimReassigned = observe.OpReassigned // kubelet gave its devices to another pod (Allocate)
)

// allocateAttempts bounds how often one Allocate starts over because a
// reconcile changed the allocations between its steps.
const allocateAttempts = 3

// settleAndGrant runs the ledger's steps of an Allocate and the slow work
// between them, without the ledger's lock: ask PodResources who holds the
// devices the sets overlap (only when they overlap an allocation), reclaim
// what kubelet has reassigned, renew those chunks now (kubelet wants them),
// then grant. renewMu is held throughout, so Allocates and renewals do not
// interleave; Authorize does not wait for any of it.
func (p *Plugin) settleAndGrant(ctx context.Context, sets [][]string) ([]string, error) {
	p.renewMu.Lock()
	defer p.renewMu.Unlock()
	for attempt := 1; ; attempt++ {
		needList, err := p.l.conflicts(sets)
		if err != nil {
			return nil, err
		}
		var held map[string]string
		if needList {
			if p.o.Holders == nil {
				return nil, allocErr(ResultRefused, "devices are held by another allocation and there is no PodResources service to check it")
			}
			if held, err = p.o.Holders.Held(ctx, p.o.ResourceName); err != nil {
				return nil, allocErr(ResultUnavailable, "devices are held by another allocation; checking it: %v", err)
			}
		}
		renew, reclaimed, err := p.l.settle(sets, held)
		for _, id := range reclaimed {
			p.report(observe.Op{Component: observe.ComponentReclaim, Name: ReclaimReassigned, Allocation: id})
		}
		if ae := (*AllocateError)(nil); errors.As(err, &ae) && ae.Result == ResultFailed {
			p.report(observe.Op{Component: observe.ComponentReclaim, Name: ReclaimReassigned, Err: ae.Err})
		}
		if err == nil {
			for _, id := range renew {
				if rerr := p.renew(id); rerr != nil {
					p.l.settled()
					return nil, allocErr(ResultRefused, "device %s could not be renewed after its last pod: %v", id, rerr)
				}
			}
			if len(renew) > 0 {
				p.l.settled()
			}
			var tokens []string
			if tokens, _, err = p.l.grant(sets, held); err == nil {
				return tokens, nil
			}
		}
		if !errors.Is(err, errChanged) {
			return nil, err
		}
		if attempt == allocateAttempts {
			return nil, allocErr(ResultUnavailable, "%v %d times; retry", err, attempt)
		}
	}
}

// renew puts fresh memory behind a reclaimed chunk (Options.Renew, slow,
// without the ledger's lock) and records the outcome; a failure is also
// reported as a reclaim error.
func (p *Plugin) renew(id string) error {
	err := p.o.Renew(id)
	if err = p.l.renewed(id, err); err != nil {
		p.report(observe.Op{Component: observe.ComponentReclaim, Name: observe.OpRenew, Err: fmt.Errorf("chunk %s: %w", id, err)})
	}
	return err
}

// renewDirty renews every dirty chunk whose retry is due, each outside the
// ledger's lock, and returns when the earliest remaining retry is due (zero
// when none is left).
func (p *Plugin) renewDirty() time.Time {
	p.renewMu.Lock()
	defer p.renewMu.Unlock()
	for _, id := range p.l.due() {
		// A failure is recorded by renew (retry schedule, metrics, log);
		// the next retry is in settled's answer.
		_ = p.renew(id)
	}
	return p.l.settled()
}

// Dirty lists the chunks waiting for renewal.
func (p *Plugin) Dirty() []string { return p.l.dirtyIDs() }

// Reconcile compares the allocations with what PodResources lists: an
// allocation a pod holds is kept; one that no pod has held for the grace
// period (counted from Allocate, or from the last time a pod held it) is
// reclaimed. A failed listing reclaims nothing.
func (p *Plugin) Reconcile(ctx context.Context) error {
	err := p.reconcile(ctx)
	p.renewDirty()
	return err
}

func (p *Plugin) reconcile(ctx context.Context) error {
	start := time.Now()
	if p.o.Holders == nil {
		return errors.New("reconcile: no PodResources service")
	}
	held, err := p.o.Holders.Held(ctx, p.o.ResourceName)
	if err != nil {
		err = fmt.Errorf("reconcile: %w", err)
		p.report(observe.Op{Name: observe.OpReconcile, Duration: time.Since(start), Err: err})
		return err
	}
	reclaimed, rerr, err := p.l.reconcile(held)
	if rerr != nil {
		p.report(observe.Op{Component: observe.ComponentReclaim, Name: ReclaimPodGone, Err: rerr})
	}
	for _, id := range reclaimed {
		p.report(observe.Op{Component: observe.ComponentReclaim, Name: ReclaimPodGone, Allocation: id})
	}
	p.report(observe.Op{Name: observe.OpReconcile, Duration: time.Since(start), Err: err})
	return err
}
