// Package agent assembles the kvpool node agent from the core packages:
// the node and its GPUs, the sizing plan, the pinned chunks, the pool, the
// copy API server, the device plugin, the API server's status and events,
// the keeper, and the observability endpoints. Cluster and standalone are
// two configurations of the same assembly (Options.Standalone).
//
// Start-up is a list of named steps, each with its start and its undo,
// built once per mode (steps.go); Boot runs them, and a failed start or
// Wait undoes them in reverse.
//
// One file per concern: agent.go Boot and Wait, steps.go the steps per
// mode, chunks.go the plan and the pinned chunks, tokens.go who may use
// which chunks, cluster.go the device plugin, kube.go the API server,
// observability.go and probes.go the metrics and health endpoints,
// restore.go the keeper.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/kvpool/kvpool/internal/bytesize"
	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/dra"
	"github.com/kvpool/kvpool/internal/events"
	"github.com/kvpool/kvpool/internal/gpu"
	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/internal/node"
	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/internal/sizing"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/wire"
)

// Options configure an agent. Config is required; the rest are what the
// command line adds to the configuration.
type Options struct {
	// Config is the loaded and validated configuration.
	Config *config.Config
	// Standalone: no kubelet, simulated GPUs (Config.Standalone.GPUs), a
	// small memfd pool and fixed tokens on a local socket.
	Standalone bool
	// DevicePlugin registers with kubelet in standalone mode too (always on
	// in a cluster).
	DevicePlugin bool
	// SimulateGPUs > 0 serves that many simulated GPUs instead of NVML's
	// (cluster mode on nodes without GPUs, tests).
	SimulateGPUs int
	// GPUUUIDs, in standalone mode, names the simulated GPUs (one each,
	// in order) instead of the simulator's names: for a standalone agent
	// whose clients open sessions on real devices (hack/gpu/check.sh).
	GPUUUIDs []string
	// Kubeconfig is the API server's kubeconfig when not in a pod
	// (default $KUBECONFIG).
	Kubeconfig string
	// Root is the root of the /proc and /sys trees to read (default "/").
	Root string
	// Socket is the socket path; default Config.SocketPath().
	Socket string
	// RandomToken: no standalone token was configured; the agent makes one.
	RandomToken bool
	// ChunksPerGPU and ChunkBytes, both > 0, replace the sizing plan by a
	// fixed standalone layout: ChunksPerGPU chunks of ChunkBytes per GPU,
	// 4 KiB pages.
	ChunksPerGPU int
	ChunkBytes   int64
	// Version is the agent's version (logs, /status, the hello reply).
	Version string
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// NVML is the binding GPU discovery uses; default nvml.New.
	NVML func() nvml.Interface
	// Hooks are called besides the agent's own metrics hooks.
	Hooks server.Hooks
	// RestartsInPlace counts the times a supervisor restarted the agent in
	// its container before this one (restartInPlace); LastExit says how the
	// last of them ended ("signal: killed").
	RestartsInPlace int
	LastExit        string
	// ReadAhead, from a spare (StartReadAhead, then Stop), is what it did
	// ahead of its turn: the restore finishes the books it read when the
	// keeper hands over the very memfd they were read from (and replays
	// the books whole otherwise), and starts from its warm heap. The agent
	// takes it (and closes it).
	ReadAhead *ReadAhead
}

// Agent is a running node agent.
type Agent struct{ a *agent }

// Pool is the agent's page pool.
func (x *Agent) Pool() *pool.Pool { return x.a.pool }

// Server is the agent's copy API server.
func (x *Agent) Server() *server.Server { return x.a.srv }

// Socket is the path the agent serves on.
func (x *Agent) Socket() string { return x.a.socket }

// Tokens maps each standalone token to its chunk IDs (nil with the device
// plugin handing out tokens).
func (x *Agent) Tokens() map[string][]string { return x.a.tokenChunks }

// MetricsAddr is the bound metrics address; nil when off.
func (x *Agent) MetricsAddr() net.Addr { return x.a.obs.metricsAddr }

// HealthAddr is the bound health address (/livez, /readyz, /status); nil
// when off.
func (x *Agent) HealthAddr() net.Addr { return x.a.obs.healthAddr }

// Wait serves until ctx ends, then shuts down: it stops the start-up
// steps in reverse (the allocation stops, the plugin unregisters, the
// server stops accepting and closes its connections, the chunks are
// freed) and returns their errors joined.
//
// When the socket server stops on its own (a fatal accept error), Wait
// logs why, stops everything else and returns the error, so that the
// process exits non-zero and kubelet restarts it.
func (x *Agent) Wait(ctx context.Context) error { return x.a.wait(ctx) }

// Run boots the agent and serves until ctx ends.
func Run(ctx context.Context, o Options) error {
	x, err := Boot(ctx, o)
	if err != nil {
		return err
	}
	err = x.Wait(ctx)
	x.a.log.Info("kvpool agent stopped", "err", err)
	return err
}

// agent is the running node agent: the pool, its chunks, the copy server,
// the device plugin and the observability endpoints. Each field is set by
// the start-up step that makes it (steps.go) and read by the later ones.
type agent struct {
	log    *slog.Logger
	cfg    *config.Config
	opts   Options
	mode   string // "cluster" or "standalone"
	node   string
	socket string
	life   lifecycle

	info        *node.Info     // step node
	allocatable int64          // step kube: the Node's allocatable memory, 0 when unknown
	devs        []gpu.Device   // step gpus
	gpuSource   string         // where the GPUs came from, for the plan's log line
	gpuNames    *gpu.Resolver  // what clients and kubelet name the GPUs by
	plan        *sizing.Plan   // step plan
	policy      *config.Sizing // step plan: the sizing policy of a sized plan (nil for a fixed layout)
	specs       []hostmem.Spec

	pool *pool.Pool
	srv  *server.Server
	mu   sync.RWMutex
	hmem map[string]*hostmem.Chunk

	obs  *observability
	plug *pluginRun
	// draDriver is the DRA driver (step "dra", mode dra); nil otherwise.
	draDriver *dra.Driver
	kube      *kubeParts
	events    events.Events
	// static maps standalone tokens to their allocation; tokenChunks the
	// chunks each token is granted once they are ready.
	static      map[string]string
	tokenChunks map[string][]string
	granted     atomic.Bool
	// refused counts pod-binding refusals since the last logged one.
	refused, refusedLogged atomic.Int64

	// restart is what the agent took over from the keeper; nil without one.
	restart *restart

	ln *net.UnixListener
	// serveDone is closed when the socket server's Serve has returned
	// serveErr.
	serveDone chan struct{}
	serveErr  error
	// cancel ends the context every goroutine of the agent runs under:
	// on a signal, a fatal error of the socket server, or a failed start.
	cancel context.CancelFunc
}

// Boot brings the agent up: it runs the start-up steps of the agent's
// mode in order (steps.go, listed per mode in docs/architecture.md) and
// returns once the socket is listening, the chunks still being allocated
// in the background in most modes.
//
// Every goroutine a step starts runs under a context of its own. A failed
// step cancels it and stops the steps started, in reverse, before Boot
// returns its error: a failed start returns at once instead of waiting on
// loops nothing would stop.
func Boot(parent context.Context, o Options) (*Agent, error) {
	if o.Config == nil {
		return nil, errors.New("agent: no configuration")
	}
	t := time.Now()
	o = o.withDefaults()
	if err := checkDRAMode(o); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(parent)
	a := &agent{log: o.Logger, cfg: o.Config, opts: o, mode: "cluster", socket: o.Socket, pool: pool.New(),
		hmem: map[string]*hostmem.Chunk{}, events: events.Nop, cancel: cancel, life: lifecycle{log: o.Logger}}
	if o.Standalone {
		a.mode = "standalone"
	}
	a.pool.SetMaxPages(int64(o.Config.Limits.MaxPages))
	a.node = os.Getenv("NODE_NAME")
	if a.node == "" {
		a.node, _ = os.Hostname()
	}
	m := modeOf(o)
	steps := a.steps(m)
	a.log.Debug("start-up steps", "mode", m.String(), "steps", stepNames(steps))
	if err := a.life.start(ctx, steps); err != nil {
		cancel()
		return nil, errors.Join(err, a.life.stop())
	}
	a.logServing(time.Since(t))
	return &Agent{a}, nil
}

// withDefaults fills the options the command line may leave out.
func (o Options) withDefaults() Options {
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Root == "" {
		o.Root = "/"
	}
	if o.Socket == "" {
		o.Socket = o.Config.SocketPath()
	}
	if o.NVML == nil {
		o.NVML = func() nvml.Interface { return nvml.New() }
	}
	if o.Version == "" {
		o.Version = "dev"
	}
	return o
}

// readNode is the step "node": what the node offers (memory, NUMA nodes,
// huge pages, the cgroup limit).
func (a *agent) readNode(context.Context) error {
	info, err := node.Read(a.opts.Root)
	a.info = info
	return err
}

// newServer is the step "server": the copy API server over the pool, the
// chunk files and the agent's authorize (tokens.go). Clients name their GPU
// by any UUID of it or of its MIG instances (gpu.Resolver); a session binds
// the chunks nearest its GPU's NUMA node, shared among its container's
// ranks (ranks.go).
func (a *agent) newServer(ctx context.Context) error {
	a.gpuNames = gpu.NewResolver(a.devs)
	numa := make(map[int]int, len(a.plan.GPUs))
	for _, g := range a.plan.GPUs {
		numa[g.GPU] = g.NUMA
	}
	srv, err := server.New(server.Options{
		GPUs:      a.gpuNames.Names(),
		GPUNUMA:   numa,
		Ranks:     a.ranks(ctx),
		Pool:      a.pool,
		Chunks:    a.chunk,
		Authorize: a.authorizer(ctx),
		Logger:    a.log,
		Hooks:     chainHooks(serverHooks(a.obs.Observer, a.obs.Metrics), a.opts.Hooks),
		Journal:   a.journal(),
		Durable:   a.durableCheck(),
		Name:      "kvpool-agent " + a.opts.Version + " (" + a.mode + ")",
		Limits:    a.cfg.Limits.Server(),
		ProbePID:  os.Getpid(),

		PollAfterReply: a.cfg.PollAfterReply.Duration,
	})
	a.srv = srv
	return err
}

// checkSocketDir is the step "socket-dir" (standalone): the socket's
// directory must be the agent user's alone (CheckSocketDir).
func (a *agent) checkSocketDir(context.Context) error {
	return CheckSocketDir(filepath.Dir(a.socket))
}

// listen is the step "listen": the socket file appears; unlisten removes
// it.
func (a *agent) listen(context.Context) error {
	ln, err := server.Listen(a.socket)
	if err != nil {
		return err
	}
	a.ln = ln
	return nil
}

func (a *agent) unlisten() error {
	if a.ln == nil {
		return nil
	}
	var errs []error
	if err := a.ln.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
		errs = append(errs, err)
	}
	if err := os.Remove(a.socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// serve is the step "serve": the socket server serves until the agent's
// context ends (or fails on its own: Wait then stops the agent); served
// waits for it to end.
func (a *agent) serve(ctx context.Context) error {
	a.serveDone = make(chan struct{})
	go func() {
		defer close(a.serveDone)
		a.serveErr = a.srv.Serve(ctx, a.ln)
	}()
	return nil
}

func (a *agent) served() error {
	if a.serveDone != nil {
		<-a.serveDone
	}
	return nil
}

// startEndpoints is the step "endpoints": the metrics and health servers
// (each off when its address is empty).
func (a *agent) startEndpoints(ctx context.Context) error {
	if a.cfg.Metrics.Address == "" && a.cfg.Health.Address == "" {
		a.log.Info("metrics and health servers off (empty addresses)")
		return nil
	}
	return a.obs.start(ctx, a.cfg.Metrics.Address, a.cfg.Health.Address)
}

// chainHooks calls the hooks of a, then those of b.
func chainHooks(a, b server.Hooks) server.Hooks {
	out := a
	if b.Refused != nil {
		out.Refused = func(reason string) {
			if a.Refused != nil {
				a.Refused(reason)
			}
			b.Refused(reason)
		}
	}
	if b.Request != nil {
		out.Request = func(r server.Request) {
			if a.Request != nil {
				a.Request(r)
			}
			b.Request(r)
		}
	}
	if b.Session != nil {
		out.Session = func(ev server.SessionEvent, info server.SessionInfo) {
			if a.Session != nil {
				a.Session(ev, info)
			}
			b.Session(ev, info)
		}
	}
	return out
}

func (a *agent) logServing(took time.Duration) {
	attrs := []any{"mode", a.mode, "node", a.node, "socket", a.socket, "gpus", len(a.plan.GPUs),
		"chunks", len(a.specs), bytesize.Attr("chunk", a.plan.ChunkBytes), "startup", took.Round(time.Millisecond),
		// Whether the kernel lets the socket refuse files a pod would pass
		// (SO_PASSRIGHTS, Linux 6.16): one line says where the node stands.
		"socketRefusesFiles", wire.CanRefuseFiles(), "pid", os.Getpid()}
	// The sessions' pages together: limits.maxPages, or the pool's default,
	// which grows as chunks are allocated in the background.
	if n := a.cfg.Limits.MaxPages; n > 0 {
		attrs = append(attrs, "maxPages", n)
	} else {
		attrs = append(attrs, "maxPages", "the pool's bytes / 4Ki, at least 4Mi")
	}
	if a.obs.metricsAddr != nil {
		attrs = append(attrs, "metrics", a.obs.metricsAddr.String())
	}
	if a.obs.healthAddr != nil {
		attrs = append(attrs, "health", a.obs.healthAddr.String())
	}
	switch {
	case a.draDriver != nil:
		attrs = append(attrs, "draDriver", a.cfg.DRA.DriverName)
	case a.plug != nil:
		attrs = append(attrs, "devicePlugin", a.cfg.ResourceName)
	}
	a.log.Info("kvpool agent serving", attrs...)
}

// wait is Agent.Wait: it waits for the context to end or the socket
// server to fail, then cancels the agent's context and stops the started
// steps in reverse. It returns the server's error (wrapped when it was
// fatal) joined with the steps' errors.
func (a *agent) wait(ctx context.Context) error {
	var fatal error
	select {
	case <-a.serveDone:
		if ctx.Err() == nil {
			fatal = a.serveErr
			if fatal == nil {
				fatal = errors.New("stopped without an error")
			}
			fatal = fmt.Errorf("socket server stopped: %w", fatal)
			a.log.Error("fatal: shutting down", "err", fatal)
		}
	case <-ctx.Done():
	}
	a.cancel()
	stopErr := a.life.stop() // waits for Serve to return
	if fatal != nil {
		return errors.Join(fatal, stopErr)
	}
	return errors.Join(a.serveErr, stopErr)
}

// durableCheck is the server's Options.Durable: with a keeper, whether it
// holds the pool (keeperwatch.go); nil without one.
func (a *agent) durableCheck() func() error {
	if a.restart == nil {
		return nil
	}
	return a.durable
}

// journal is the server's journal: the books, when there is a keeper.
func (a *agent) journal() server.Journal {
	if a.restart == nil {
		return nil
	}
	return a.restart.books
}
