package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"

	"github.com/kvpool/kvpool/internal/agent"
	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/logging"
	"github.com/kvpool/kvpool/internal/supervise"
	"github.com/kvpool/kvpool/pkg/contract"
)

// serveFlags are the flags of `agent [serve]` that are not configuration
// fields: the mode, where to find the API server and the node's files, and
// two standalone conveniences (a full socket path and a fixed layout).
type serveFlags struct {
	standalone   bool
	devicePlugin bool
	simulateGPUs int
	kubeconfig   string
	root         string

	socket       string // a full socket path (standalone)
	chunksPerGPU int    // --chunks-per-gpu: a fixed standalone layout
	chunkMiB     int    // --chunk-mib: a fixed standalone layout
}

// serveSetup is everything runServe resolved before starting the agent.
type serveSetup struct {
	flags serveFlags
	cfg   *config.Config
	// src says where each configuration value came from.
	src config.Sources
	// randomToken: no token was configured; the standalone agent makes one.
	randomToken bool
	socket      string
}

// flagOutput receives usage and flag errors; tests quiet it.
var flagOutput io.Writer = os.Stderr

func newServeFlagSet(f *serveFlags) *flag.FlagSet {
	fs := flag.NewFlagSet("agent", flag.ContinueOnError)
	fs.SetOutput(flagOutput)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), `usage: agent [serve] [flags]

Serves the host KV page pool. In a cluster (the default) it discovers the
GPUs with NVML, sizes the pool from the node, registers with kubelet as a
device plugin and serves the copy API on <socketDir>/kvpool.sock. With
--standalone it needs no cluster: simulated GPUs, a small memfd pool and
fixed allocation tokens on a local socket.

Configuration: defaults < file (--config or $KVPOOL_CONFIG) < KVPOOL_*
environment < flags. See docs/architecture.md and docs/sizing.md.

`)
		fs.PrintDefaults()
	}
	fs.BoolVar(&f.standalone, "standalone", false, "run without kubelet: simulated GPUs and a memfd pool on a local socket")
	fs.BoolVar(&f.devicePlugin, "device-plugin", false, "standalone: also register with kubelet as a device plugin (always on in a cluster)")
	fs.IntVar(&f.simulateGPUs, "simulate-gpus", 0, "cluster mode: use N simulated GPUs instead of NVML (nodes without GPUs, tests); standalone GPUs are --standalone-gpus")
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig for the API server when not running in a pod (default $KUBECONFIG)")
	fs.StringVar(&f.root, "root", "/", "root of the /proc and /sys trees to read (for tests)")
	fs.StringVar(&f.socket, "socket", "", "standalone: socket path (default "+agent.DefaultSocket()+")")
	fs.IntVar(&f.chunksPerGPU, "chunks-per-gpu", 0, "standalone: fixed chunks per GPU instead of the sizing plan (with --chunk-mib)")
	fs.IntVar(&f.chunkMiB, "chunk-mib", 0, "standalone: fixed chunk size in MiB instead of the sizing plan")
	config.RegisterFlags(fs)
	return fs
}

// resolveServe parses args and loads the configuration. It changes nothing
// on the machine.
func resolveServe(args []string, getenv func(string) string) (*serveSetup, error) {
	var f serveFlags
	fs := newServeFlagSet(&f)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	visited := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { visited[fl.Name] = true })
	cfg, src, err := config.Load("", getenv, fs)
	if err != nil {
		return nil, err
	}
	s := &serveSetup{flags: f, cfg: cfg, src: src}

	switch {
	case f.simulateGPUs < 0 || f.simulateGPUs > 64:
		return nil, fmt.Errorf("--simulate-gpus %d: want 1 to 64 (0: use NVML)", f.simulateGPUs)
	case f.chunksPerGPU < 0 || f.chunksPerGPU > 4096:
		return nil, fmt.Errorf("--chunks-per-gpu %d: want 1 to 4096", f.chunksPerGPU)
	case f.chunkMiB < 0 || f.chunkMiB > 1<<16:
		return nil, fmt.Errorf("--chunk-mib %d out of range (1 to 65536)", f.chunkMiB)
	}
	if !f.standalone {
		for _, n := range []string{"socket", "chunks-per-gpu", "chunk-mib"} {
			if visited[n] {
				return nil, fmt.Errorf("--%s applies only with --standalone", n)
			}
		}
		s.socket = cfg.SocketPath()
		return s, nil
	}

	if visited["simulate-gpus"] {
		return nil, errors.New("--simulate-gpus applies only in cluster mode; standalone GPUs are standalone.gpus (--standalone-gpus, KVPOOL_STANDALONE_GPUS)")
	}
	if err := s.standaloneDefaults(); err != nil {
		return nil, err
	}
	return s, nil
}

// standaloneDefaults gives a standalone agent the same configuration with
// defaults fit for a laptop and for several agents on one machine: each
// applies only to a field whose source is the default.
func (s *serveSetup) standaloneDefaults() error {
	cfg, src, f := s.cfg, s.src, s.flags
	if !src.Explicit("standalone.tokens") {
		s.randomToken = true
	}
	base := filepath.Dir(agent.DefaultSocket())
	switch {
	case f.socket != "":
		s.socket = f.socket
		if !src.Explicit("socketDir") {
			cfg.SocketDir = filepath.Dir(f.socket)
		}
	case src.Explicit("socketDir"):
		s.socket = cfg.SocketPath()
	default:
		cfg.SocketDir = base
		s.socket = cfg.SocketPath()
	}
	if f.devicePlugin && s.socket != cfg.SocketPath() {
		return fmt.Errorf("--socket %s: with --device-plugin the socket must be <socketDir>/%s (pods mount socketDir); use --socket-dir", s.socket, contract.SocketFile)
	}
	// A pool size asked for in sizing.poolBytes holds in standalone mode
	// too, unless standalone.poolBytes is given as well.
	if src.Explicit("sizing.poolBytes") && !src.Explicit("standalone.poolBytes") && cfg.Sizing.PoolBytes > 0 {
		cfg.Standalone.PoolBytes = cfg.Sizing.PoolBytes
	}
	if !src.Explicit("stateDir") {
		cfg.StateDir = agent.DefaultStateDir()
	}
	if !src.Explicit("tokenBinding") {
		cfg.TokenBinding = config.TokenBindingNone // no pods to bind to
	}
	if err := config.CheckDirs(cfg.SocketDir, cfg.StateDir); err != nil {
		return fmt.Errorf("stateDir: %w", err)
	}
	if !src.Explicit("metrics.address") {
		cfg.Metrics.Address = "127.0.0.1:0"
	}
	if !src.Explicit("health.address") {
		cfg.Health.Address = "127.0.0.1:0"
	}
	// The old fixed layout: either flag alone keeps the other's old default.
	if f.chunksPerGPU > 0 && f.chunkMiB == 0 {
		s.flags.chunkMiB = 64
	}
	if f.chunkMiB > 0 && f.chunksPerGPU == 0 {
		s.flags.chunksPerGPU = 4
	}
	return nil
}

// runServe is `agent [serve]`.
func runServe(ctx context.Context, args []string) error {
	var ahead *agent.ReadAhead
	if os.Getenv(supervise.EnvSpare) != "" {
		// A spare: started ahead by the supervisor, it waits here, past
		// Go's initialisation, and reads the configuration when it
		// serves. Meanwhile it reads ahead the books the keeper holds
		// (agent.ReadAhead).
		if s, err := resolveServe(args, os.Getenv); err == nil && s.cfg.KeeperSocket != "" && s.cfg.RestartInPlace.ReadAhead {
			// Its logger is the agent's (it was configured already).
			log, _, _ := logging.New(logging.Options{Level: s.cfg.Log.Level, Format: s.cfg.Log.Format})
			ahead = agent.StartReadAhead(s.cfg.KeeperSocket, agent.ReadAheadEvery, int64(s.cfg.RestartInPlace.SpareMemory), log)
		}
		turn, err := supervise.AwaitTurn()
		if ahead != nil {
			ahead.Stop()
		}
		if !turn {
			return err
		}
	}
	s, err := resolveServe(args, os.Getenv)
	if err != nil {
		return err
	}
	log, _, err := logging.Setup(logging.Options{Level: s.cfg.Log.Level, Format: s.cfg.Log.Format})
	if err != nil {
		return err
	}
	if s.cfg.RestartInPlace.Max > 0 && os.Getenv(supervise.EnvChild) == "" {
		return superviseServe(s, log)
	}
	log.Info("configuration", "setFrom", s.src.String())
	for _, w := range s.cfg.Warnings() {
		log.Warn("configuration", "warning", w)
	}
	o := s.options(log)
	o.RestartsInPlace, o.LastExit = restartedInPlace(os.Getenv)
	o.ReadAhead = ahead
	err = agent.Run(ctx, o)
	if ahead != nil {
		ahead.Close() // what a start that ended before its restore left
	}
	return err
}

// superviseServe runs `agent serve` again as its own child, restarting it
// in place when it dies (restartInPlace, internal/supervise). It returns
// the child's end as an exitCode.
func superviseServe(s *serveSetup, log *slog.Logger) error {
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("restart in place: find this program: %w", err)
	}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT)
	defer signal.Stop(sigs)
	rp := s.cfg.RestartInPlace
	log.Info("supervising the agent: a dead agent is restarted in place", "max", rp.Max, "window", rp.Window.Duration, "spare", rp.Spare)
	end, err := supervise.Run(supervise.Options{Path: exe, Args: os.Args, Env: os.Environ(),
		Max: rp.Max, Window: rp.Window.Duration, Spare: rp.Spare, SpareAfter: rp.SpareAfter.Duration, Signals: sigs, Log: log})
	if err != nil {
		return err
	}
	if end.Code != 0 {
		return exitCode(end.Code)
	}
	return nil
}

// restartedInPlace reads what a supervisor told its child: how many times
// the agent was restarted in place before it, and how the last one ended.
func restartedInPlace(getenv func(string) string) (int, string) {
	if getenv(supervise.EnvChild) == "" {
		return 0, ""
	}
	n, err := strconv.Atoi(getenv(supervise.EnvRestarts))
	if err != nil || n < 0 {
		return 0, ""
	}
	return n, getenv(supervise.EnvLastExit)
}

// options is the agent's configuration.
func (s *serveSetup) options(log *slog.Logger) agent.Options {
	f := s.flags
	return agent.Options{
		Config: s.cfg, Standalone: f.standalone, DevicePlugin: f.devicePlugin, SimulateGPUs: f.simulateGPUs,
		Kubeconfig: f.kubeconfig, Root: f.root, Socket: s.socket, RandomToken: s.randomToken,
		ChunksPerGPU: f.chunksPerGPU, ChunkBytes: int64(f.chunkMiB) << 20,
		Version: version, Logger: log, NVML: nvmlLib,
	}
}
