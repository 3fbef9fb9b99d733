// Package agent assembles the kvpool node agent from the core packages:
// the node and its GPUs, the sizing plan, the pinned chunks, the pool, the
// copy API server, the device plugin, the API server's status and events,
// the keeper, and the observability endpoints. Cluster and standalone are
// two configurations of the same assembly (Options.Standalone).
//
// One file per concern: agent.go start-up and shutdown, chunks.go the plan
// and the pinned chunks, tokens.go who may use which chunks, cluster.go the
// device plugin, kube.go the API server, observability.go and probes.go the
// metrics and health endpoints, restore.go the keeper.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/kvpool/kvpool/internal/bytesize"
	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/events"
	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/internal/node"
	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/internal/sizing"
	"github.com/kvpool/kvpool/pkg/pool"
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

// Wait serves until ctx ends, then shuts down: the server stops accepting
// and closes its connections, the plugin unregisters, the allocation stops,
// and the chunks are freed.
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
// the device plugin and the observability endpoints.
type agent struct {
	log    *slog.Logger
	cfg    *config.Config
	opts   Options
	mode   string // "cluster" or "standalone"
	node   string
	socket string
	plan   *sizing.Plan
	specs  []hostmem.Spec

	pool *pool.Pool
	srv  *server.Server
	mu   sync.RWMutex
	hmem map[string]*hostmem.Chunk

	obs    *observability
	plug   *pluginRun
	kube   *kubeParts
	events events.Events
	// static maps standalone tokens to their allocation; tokenChunks the
	// chunks each token is granted once they are ready.
	static      map[string]string
	tokenChunks map[string][]string
	granted     atomic.Bool
	// refused counts pod-binding refusals since the last logged one.
	refused, refusedLogged atomic.Int64

	// restart is what the agent took over from the keeper; nil without one.
	restart *restart

	ln         *net.UnixListener
	serveDone  chan error
	background sync.WaitGroup
	// cancel ends the context every goroutine of the agent runs under:
	// on a signal, a fatal error of the socket server, or a failed start.
	cancel context.CancelFunc
}

// Boot brings the agent up in start-up order: node and GPUs, the
// sizing plan, the socket server, observability, the device plugin, then
// the chunks in the background. It returns once the socket is listening.
//
// Every goroutine it starts runs under a context of its own, which a failed
// start cancels before releasing what it got to: a failed start returns its
// error at once instead of waiting on loops nothing would stop.
func Boot(parent context.Context, o Options) (_ *Agent, err error) {
	if o.Config == nil {
		return nil, errors.New("agent: no configuration")
	}
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
	cfg, log := o.Config, o.Logger
	ctx, cancel := context.WithCancel(parent)
	a := &agent{log: log, cfg: cfg, opts: o, mode: "cluster", socket: o.Socket, pool: pool.New(),
		hmem: map[string]*hostmem.Chunk{}, events: events.Nop, cancel: cancel}
	if o.Standalone {
		a.mode = "standalone"
	}
	a.node = os.Getenv("NODE_NAME")
	if a.node == "" {
		a.node, _ = os.Hostname()
	}
	defer func() {
		if err != nil {
			cancel()
			a.abort()
		}
	}()

	info, err := node.Read(o.Root)
	if err != nil {
		return nil, err
	}
	var allocatable int64
	if !o.Standalone {
		if a.kube, err = connectKube(ctx, o.Kubeconfig, log); err != nil {
			return nil, err
		}
		if a.kube != nil {
			a.node = a.kube.node
			allocatable = a.kube.allocatable
			a.events = a.kube.events
		}
	}
	devs, source, err := a.gpus(info)
	if err != nil {
		return nil, err
	}
	if err := a.makePlan(info, devs, allocatable); err != nil {
		return nil, err
	}
	a.logPlan(source)
	if cfg.KeeperSocket != "" {
		if err := a.restore(); err != nil {
			return nil, err
		}
	}
	if o.Standalone || cfg.Sizing.HugePages == config.HugePagesPrefer {
		for _, w := range a.plan.Warnings {
			if strings.Contains(w, "huge pages") {
				a.events.HugePagesFallback(w)
			}
		}
	}
	if err := a.prepareTokens(); err != nil {
		return nil, err
	}

	// Observability first, so start-up failures after this are counted.
	a.obs = newObservability(a.pool, obsOptions{Node: a.node, Mode: a.mode, Version: o.Version,
		Targets: func() map[int]int64 {
			m := map[int]int64{}
			for _, g := range a.plan.GPUs {
				m[g.GPU] = g.Bytes
			}
			return m
		}})
	for _, g := range a.plan.GPUs {
		a.obs.Metrics.InitGPU(g.GPU)
	}
	a.obs.Report.Restart = a.restartStatus
	a.obs.Metrics.Restart(a.restartStatus)

	// The device plugin is built (not yet registered) before the server,
	// whose Authorize resolves the tokens it hands out.
	pcfg := pluginConfig{
		Enabled:      !o.Standalone || o.DevicePlugin,
		ResourceName: cfg.ResourceName, KubeletDir: cfg.KubeletDir, SocketDir: cfg.SocketDir, StateDir: cfg.StateDir,
		GracePeriod: cfg.Reclaim.GracePeriod.Duration, Interval: cfg.Reclaim.Interval.Duration,
		BindPods: cfg.TokenBinding == config.TokenBindingPod, PodLogsDir: cfg.PodLogsDir,
		Observer: a.obs.Observer,
	}
	if a.plug, err = newPlugin(pcfg, a.pool, a.renew, a.events, log); err != nil {
		return nil, err
	}
	if a.plug != nil {
		a.obs.Metrics.InitPlugin()
	}
	a.settleRestored()

	// Standalone tokens name their chunks up front: allocate before the
	// socket appears, so a client that finds the socket finds its chunks.
	if a.static != nil {
		a.allocate(ctx)
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}

	uuids := make(map[string]int, len(a.plan.GPUs))
	for _, g := range a.plan.GPUs {
		uuids[g.UUID] = g.GPU
	}
	a.srv, err = server.New(server.Options{
		GPUs:      uuids,
		Pool:      a.pool,
		Chunks:    a.chunk,
		Authorize: a.authorizer(ctx),
		Logger:    log,
		Hooks:     chainHooks(serverHooks(a.obs.Observer, a.obs.limitRejects), o.Hooks),
		Journal:   a.journal(),
		Name:      "kvpool-agent " + o.Version + " (" + a.mode + ")",
		Limits:    serverLimits(cfg.Limits),
		ProbePID:  os.Getpid(),

		PollAfterReply: cfg.PollAfterReply.Duration,
	})
	if err != nil {
		return nil, err
	}
	if o.Standalone {
		if err := CheckSocketDir(filepath.Dir(a.socket)); err != nil {
			return nil, err
		}
	}
	if a.restart != nil {
		if err := a.srv.Restore(a.restart.sessions); err != nil {
			return nil, err
		}
	}
	if a.ln, err = server.Listen(a.socket); err != nil {
		return nil, err
	}
	if r := a.restart; r != nil {
		if !r.lastAlive.IsZero() {
			r.gap = time.Since(r.lastAlive)
			a.log.Info("serving again after a restart", "gap", r.gap.Round(time.Millisecond),
				"adoptedChunks", len(r.adopted), "sessions", len(r.sessions), "streams", r.streams)
		}
		a.background.Add(1)
		go func() {
			defer a.background.Done()
			a.heartbeat(ctx)
		}()
	}
	a.serveDone = make(chan error, 1)
	go func() { a.serveDone <- a.srv.Serve(ctx, a.ln) }()

	a.addHealthChecks(ctx)
	if cfg.Metrics.Address == "" && cfg.Health.Address == "" {
		log.Info("metrics and health servers off (empty addresses)")
	} else if err := a.obs.start(ctx, cfg.Metrics.Address, cfg.Health.Address); err != nil {
		return nil, err
	}
	if a.plug != nil {
		a.plug.start(ctx)
	}
	if a.kube != nil {
		a.kube.startStatus(ctx, a, &a.background)
	}
	if a.static == nil {
		a.background.Add(1)
		go func() {
			defer a.background.Done()
			a.allocate(ctx)
		}()
	}
	a.logServing()
	return &Agent{a}, nil
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
	return out
}

func (a *agent) logServing() {
	attrs := []any{"mode", a.mode, "node", a.node, "socket", a.socket, "gpus", len(a.plan.GPUs),
		"chunks", len(a.specs), bytesize.Attr("chunk", a.plan.ChunkBytes)}
	if a.obs.metricsAddr != nil {
		attrs = append(attrs, "metrics", a.obs.metricsAddr.String())
	}
	if a.obs.healthAddr != nil {
		attrs = append(attrs, "health", a.obs.healthAddr.String())
	}
	if a.plug != nil {
		attrs = append(attrs, "devicePlugin", a.cfg.ResourceName)
	}
	a.log.Info("kvpool agent serving", attrs...)
}

// wait is Agent.Wait.
func (a *agent) wait(ctx context.Context) error {
	var err error
	select {
	case err = <-a.serveDone:
		if ctx.Err() == nil {
			if err == nil {
				err = errors.New("stopped without an error")
			}
			err = fmt.Errorf("socket server stopped: %w", err)
			a.log.Error("fatal: shutting down", "err", err)
		}
	case <-ctx.Done():
		err = <-a.serveDone
	}
	a.cancel()
	a.abort()
	return err
}

// serverLimits turns the configured limits into the server's.
func serverLimits(l config.Limits) server.Limits {
	return server.Limits{
		MaxConns: l.MaxConns, MaxConnsPerUID: l.MaxConnsPerUID, MaxConnsPerPID: l.MaxConnsPerPID,
		ProbeConns: l.ProbeConns, HelloTimeout: l.HelloTimeout.Duration, OpenTimeout: l.OpenTimeout.Duration,
		MaxSessions: l.MaxSessions, MaxSessionsPerAllocation: l.MaxSessionsPerAllocation,
		MaxStreamsPerSession: l.MaxStreamsPerSession, MaxNameBytesPerSession: int64(l.MaxNameBytesPerSession),
		MaxDevicePages: l.MaxDevicePages, MaxClientName: l.MaxClientName,
	}
}

// abort releases whatever start-up got to. The caller's ctx must be done
// (or start-up failed before any goroutine started).
func (a *agent) abort() {
	if a.ln != nil {
		a.ln.Close()
		os.Remove(a.socket)
	}
	if a.plug != nil {
		a.plug.Wait()
	}
	a.background.Wait()
	if a.kube != nil {
		a.kube.stopped()
		a.kube.close()
	}
	if r := a.restart; r != nil {
		// The keeper keeps the memory and the books for the next agent.
		if r.books != nil {
			r.books.Close()
		}
		r.keeper.Close()
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for id, c := range a.hmem {
		if err := c.Close(); err != nil {
			a.log.Warn("freeing chunk", "chunk", id, "err", err)
		}
		delete(a.hmem, id)
	}
}

// journal is the server's journal: the books, when there is a keeper.
func (a *agent) journal() server.Journal {
	if a.restart == nil {
		return nil
	}
	return a.restart.books
}
