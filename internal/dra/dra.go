// Package dra is kvpool's DRA kubelet plugin: the second front door to the
// pool, beside the device plugin (pkg/plugin). It publishes the node's
// ready chunks as ResourceSlices (resourceslice, through the kubeletplugin
// helper), so that the scheduler can place host KV next to a GPU and size
// it in bytes, and it prepares the ResourceClaims kubelet gives it: the
// chunks go to a fresh token in the device plugin's own ledger
// (plugin.PrepareClaim, exactly as an Allocate), and the container gets the
// socket directory and KVPOOL_SOCKET / KVPOOL_TOKEN through a CDI spec
// named by the claim's UID. Unprepare ends the allocation; the chunks are
// renewed before they are offered again.
//
// The device model is in slices.go and docs/dra.md.
package dra

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"

	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/plugin"
)

// DefaultDriverName is the driver's default name: the domain of its device
// attributes and the DeviceClasses' driver.
const DefaultDriverName = "kvpool.io"

// Source is the pool's ready chunks: a snapshot and a channel closed at
// the next change.
type Source interface {
	Chunks() ([]Chunk, <-chan struct{})
}

// Ledger is the part of the device plugin's ledger the driver uses
// (*plugin.Plugin).
type Ledger interface {
	PrepareClaim(ctx context.Context, c plugin.Claim) ([]plugin.ClaimGrant, error)
	UnprepareClaim(uid string) (int, error)
	ChunkHolders() (map[string]plugin.Holder, <-chan struct{})
	Claims() []plugin.Record
}

// Options configure a Driver. DriverName, NodeName, KubeletDir, CDIDir,
// SocketDir, Ledger and Chunks are required; KubeClient is, to Start.
type Options struct {
	DriverName string
	NodeName   string
	// KubeClient reads ResourceClaims and writes the node's ResourceSlices.
	KubeClient kubernetes.Interface
	// KubeletDir is kubelet's root: the driver's socket goes in
	// plugins/<driver>/, its registration in plugins_registry/.
	KubeletDir string
	// CDIDir is where the CDI specs go, one per claim (the container
	// runtime's CDI spec directory).
	CDIDir string
	// SocketDir is the host directory of the agent's socket, which each
	// container gets read-only at contract.ContainerSocketDir.
	SocketDir string
	GPUs      []GPU
	Ledger    Ledger
	Chunks    Source
	// Observer is told of every Prepare and Unprepare (one claim each)
	// and of publishing errors (component "dra"); default observe.Nop.
	Observer observe.Observer
	Logger   *slog.Logger
	// Fatal is called with an error the helper says the driver cannot
	// recover from; the agent stops. Default: logged only.
	Fatal func(error)
}

func (o *Options) check() error {
	switch {
	case o.DriverName == "" || o.NodeName == "":
		return errors.New("dra: Options need DriverName and NodeName")
	case !filepath.IsAbs(o.KubeletDir) || !filepath.IsAbs(o.CDIDir) || !filepath.IsAbs(o.SocketDir):
		return fmt.Errorf("dra: kubelet directory %q, CDI directory %q and socket directory %q must be absolute", o.KubeletDir, o.CDIDir, o.SocketDir)
	case o.Ledger == nil || o.Chunks == nil:
		return errors.New("dra: Options need Ledger and Chunks")
	}
	if o.Observer == nil {
		o.Observer = observe.Nop
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return nil
}

// Driver is the DRA kubelet plugin. New builds it (the Prepare and
// Unprepare calls work without kubelet, for tests); Start registers it with
// kubelet and publishes the slices.
type Driver struct {
	o      Options
	log    *slog.Logger
	cdi    cdiSpecs
	helper *kubeletplugin.Helper
	wg     sync.WaitGroup
	cancel context.CancelFunc

	mu        sync.Mutex
	published resourceslice.DriverResources
	publishes int
	// chunksOnly: the API server dropped the counters or the shares'
	// fields (their features are off), so only chunk devices are
	// published (Resources). kick wakes the publish loop for it.
	chunksOnly bool
	kick       chan struct{}
}

// New builds a Driver and removes the CDI specs of claims the ledger no
// longer holds (left by an agent that died between the two).
func New(o Options) (*Driver, error) {
	if err := o.check(); err != nil {
		return nil, err
	}
	d := &Driver{o: o, log: o.Logger.With("component", "dra", "driver", o.DriverName),
		cdi: cdiSpecs{dir: o.CDIDir, driver: o.DriverName, socketDir: o.SocketDir}, kick: make(chan struct{}, 1)}
	keep := map[string]bool{}
	for _, r := range o.Ledger.Claims() {
		keep[r.Claim.UID] = true
	}
	removed, err := d.cdi.prune(keep)
	if len(removed) > 0 {
		d.log.Info("removed the CDI specs of claims no longer prepared", "claims", removed)
	}
	if err != nil {
		return nil, err
	}
	return d, nil
}

// PluginDir is the driver's directory under kubelet's plugins/ (its
// dra.sock).
func (d *Driver) PluginDir() string {
	return filepath.Join(d.o.KubeletDir, "plugins", d.o.DriverName)
}

// RegistryDir is kubelet's plugin registration directory.
func (d *Driver) RegistryDir() string { return filepath.Join(d.o.KubeletDir, "plugins_registry") }

// Start registers the driver with kubelet (the helper's registration and
// DRA gRPC sockets) and publishes the node's slices until ctx ends or Stop.
func (d *Driver) Start(ctx context.Context) error {
	if d.o.KubeClient == nil {
		return errors.New("dra: Start needs a KubeClient")
	}
	// kubelet's plugins/ is there; the driver's own directory in it may not be.
	if err := os.MkdirAll(d.PluginDir(), 0o750); err != nil {
		return fmt.Errorf("dra: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	d.cancel = cancel
	// The helper and the ResourceSlice controller log through klog's
	// contextual logger: the agent's slog logger, below its debug level
	// for their chatter (verbosity 6 and up logs every gRPC call).
	ctx = klog.NewContext(ctx, logr.FromSlogHandler(d.log.Handler()))
	h, err := kubeletplugin.Start(ctx, d,
		kubeletplugin.DriverName(d.o.DriverName),
		kubeletplugin.NodeName(d.o.NodeName),
		kubeletplugin.KubeClient(d.o.KubeClient),
		kubeletplugin.PluginDataDirectoryPath(d.PluginDir()),
		kubeletplugin.RegistrarDirectoryPath(d.RegistryDir()),
		kubeletplugin.HealthService(false),
	)
	if err != nil {
		cancel()
		return fmt.Errorf("dra: start the kubelet plugin: %w", err)
	}
	d.helper = h
	d.wg.Go(func() { d.publishLoop(ctx) })
	d.log.Info("DRA driver started", "pluginDir", d.PluginDir(), "registryDir", d.RegistryDir(), "cdiDir", d.o.CDIDir)
	return nil
}

// Stop unregisters the driver (its sockets go; kubelet removes the node's
// slices of the driver once it has been gone a while) and stops
// publishing. The slices stay for the next agent.
func (d *Driver) Stop() {
	if d.cancel == nil {
		return
	}
	d.cancel()
	d.wg.Wait()
	d.helper.Stop()
}

// Registered says whether kubelet has registered the driver (readiness).
func (d *Driver) Registered() bool {
	if d.helper == nil {
		return false
	}
	s := d.helper.RegistrationStatus()
	return s != nil && s.PluginRegistered
}

// Publishes counts the slice updates handed to the helper.
func (d *Driver) Publishes() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.publishes
}

// Resources is what the driver publishes now.
func (d *Driver) Resources() resourceslice.DriverResources {
	chunks, _ := d.o.Chunks.Chunks()
	held, _ := d.o.Ledger.ChunkHolders()
	return Resources(d.o.NodeName, d.o.GPUs, chunks, held, d.ChunksOnly())
}

// ChunksOnly says whether the driver publishes chunk devices only (the
// API server dropped the fields of partitionable devices or consumable
// capacity).
func (d *Driver) ChunksOnly() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.chunksOnly
}

// publishLoop publishes the slices now and again at every change of the
// chunks or of the ledger, until ctx ends.
func (d *Driver) publishLoop(ctx context.Context) {
	for {
		chunks, chunksCh := d.o.Chunks.Chunks()
		held, heldCh := d.o.Ledger.ChunkHolders()
		res := Resources(d.o.NodeName, d.o.GPUs, chunks, held, d.ChunksOnly())
		d.mu.Lock()
		same := d.publishes > 0 && reflect.DeepEqual(res, d.published)
		d.mu.Unlock()
		if !same {
			if err := d.helper.PublishResources(ctx, res); err != nil {
				d.report(observe.Op{Name: observe.OpPublish, Err: err})
				d.log.Error("publish ResourceSlices", "err", err)
			} else {
				d.mu.Lock()
				d.published, d.publishes = res, d.publishes+1
				d.mu.Unlock()
				d.log.Debug("ResourceSlices published", "slices", len(res.Pools[d.o.NodeName].Slices))
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-chunksCh:
		case <-heldCh:
		case <-d.kick:
		case <-time.After(time.Minute): // a publish that failed is retried
		}
	}
}

// HandleError implements kubeletplugin.DRAPlugin: errors of the helper's
// background work (publishing slices, its gRPC servers). Recoverable ones
// are logged and counted; others stop the agent.
func (d *Driver) HandleError(ctx context.Context, err error, msg string) {
	d.report(observe.Op{Name: observe.OpPublish, Err: fmt.Errorf("%s: %w", msg, err)})
	var dropped *resourceslice.DroppedFieldsError
	if errors.As(err, &dropped) && d.fallBack(dropped.DisabledFeatures()) {
		return
	}
	if errors.Is(err, kubeletplugin.ErrRecoverable) {
		d.log.Warn("DRA driver: "+msg, "err", err)
		return
	}
	d.log.Error("DRA driver: fatal: "+msg, "err", err)
	if d.o.Fatal != nil {
		d.o.Fatal(fmt.Errorf("dra: %s: %w", msg, err))
	}
}

// fallBack switches to chunk devices only when the API server dropped the
// fields of partitionable devices or consumable capacity: published
// without their counters, a chunk and a share could book the same memory.
// It says whether it did (now or before).
func (d *Driver) fallBack(disabled []string) bool {
	off := slices.ContainsFunc(disabled, func(f string) bool {
		return f == "DRAPartitionableDevices" || f == "DRAConsumableCapacity"
	})
	if !off {
		return false
	}
	d.mu.Lock()
	was := d.chunksOnly
	d.chunksOnly = true
	d.mu.Unlock()
	if !was {
		d.log.Warn("the API server drops the fields of partitionable devices or consumable capacity (features off): publishing chunk devices only; "+
			"claims in bytes cannot be served, claims for a number of chunks and the extended resource (where its DeviceClass is served) can", "disabled", disabled)
		select {
		case d.kick <- struct{}{}:
		default:
		}
	}
	return true
}

// WatchHealthStatus implements kubeletplugin.DRAPlugin; the health service
// is off (a chunk that cannot be renewed is not offered).
func (d *Driver) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}

func (d *Driver) report(op observe.Op) {
	op.Component = observe.ComponentDRA
	op.GPU = -1
	d.o.Observer.Op(op)
}
