package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"sigs.k8s.io/yaml"

	"github.com/kvpool/kvpool/internal/agent"
	"github.com/kvpool/kvpool/pkg/config"
	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/logging"
)

// tokenList is a repeatable --token flag.
type tokenList []string

func (t *tokenList) String() string { return strings.Join(*t, ",") }
func (t *tokenList) Set(v string) error {
	if strings.TrimSpace(v) == "" {
		return errors.New("empty token")
	}
	*t = append(*t, v)
	return nil
}

// serveFlags are the flags of `agent [serve]` that are not configuration
// fields: the mode, and the older standalone spellings kept for the tests
// and scripts that use them.
type serveFlags struct {
	standalone   bool
	devicePlugin bool
	simulateGPUs int
	kubeconfig   string
	root         string

	socket       string    // a full socket path (standalone)
	tokens       tokenList // --token, repeatable: standalone.tokens
	gpus         int       // --gpus: standalone.gpus
	chunksPerGPU int       // --chunks-per-gpu: a fixed standalone layout
	chunkMiB     int       // --chunk-mib: a fixed standalone layout
}

// serveSetup is everything runServe resolved before starting the agent.
type serveSetup struct {
	flags serveFlags
	cfg   *config.Config
	// explicit reports whether a config field (by its YAML path) was set
	// by the file, the environment or a flag rather than defaulted.
	explicit func(field string) bool
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
	fs.IntVar(&f.simulateGPUs, "simulate-gpus", 0, "use N simulated GPUs instead of NVML (nodes without GPUs, tests); standalone: same as --gpus")
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig for the API server when not running in a pod (default $KUBECONFIG)")
	fs.StringVar(&f.root, "root", "/", "root of the /proc and /sys trees to read (for tests)")
	fs.StringVar(&f.socket, "socket", "", "standalone: socket path (default "+agent.DefaultSocket()+")")
	fs.Var(&f.tokens, "token", "standalone: allocation token (repeatable; default one random token)")
	fs.IntVar(&f.gpus, "gpus", 0, "standalone: simulated GPUs (same as --standalone-gpus)")
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
	cfg, err := config.Load("", getenv, fs)
	if err != nil {
		return nil, err
	}
	path := ""
	if v := fs.Lookup("config").Value.String(); v != "" {
		path = v
	} else {
		path = getenv(config.EnvConfig)
	}
	fileKeys, err := fileFields(path)
	if err != nil {
		return nil, err
	}
	// The fields whose standalone default differs from the cluster one.
	sources := map[string][2]string{ // field: flag, environment variable
		"socketDir":            {"socket-dir", "KVPOOL_SOCKET_DIR"},
		"stateDir":             {"state-dir", "KVPOOL_STATE_DIR"},
		"tokenBinding":         {"token-binding", "KVPOOL_TOKEN_BINDING"},
		"metrics.address":      {"metrics-address", "KVPOOL_METRICS_ADDRESS"},
		"health.address":       {"health-address", "KVPOOL_HEALTH_ADDRESS"},
		"standalone.tokens":    {"standalone-tokens", "KVPOOL_STANDALONE_TOKENS"},
		"sizing.poolBytes":     {"pool-bytes", "KVPOOL_POOL_BYTES"},
		"standalone.poolBytes": {"standalone-pool-bytes", "KVPOOL_STANDALONE_POOL_BYTES"},
	}
	s := &serveSetup{flags: f, cfg: cfg}
	s.explicit = func(field string) bool {
		src, ok := sources[field]
		if !ok {
			panic("explicit: unknown field " + field)
		}
		return fileKeys[field] || getenv(src[1]) != "" || visited[src[0]]
	}

	switch {
	case f.simulateGPUs < 0 || f.simulateGPUs > 64:
		return nil, fmt.Errorf("--simulate-gpus %d: want 1 to 64 (0: use NVML)", f.simulateGPUs)
	case f.gpus < 0 || f.gpus > 64:
		return nil, fmt.Errorf("--gpus %d: want 1 to 64", f.gpus)
	case f.chunksPerGPU < 0 || f.chunksPerGPU > 4096:
		return nil, fmt.Errorf("--chunks-per-gpu %d: want 1 to 4096", f.chunksPerGPU)
	case f.chunkMiB < 0 || f.chunkMiB > 1<<16:
		return nil, fmt.Errorf("--chunk-mib %d out of range (1 to 65536)", f.chunkMiB)
	}
	if !f.standalone {
		for _, n := range []string{"socket", "token", "gpus", "chunks-per-gpu", "chunk-mib"} {
			if visited[n] {
				return nil, fmt.Errorf("--%s applies only with --standalone", n)
			}
		}
		s.socket = cfg.SocketPath()
		return s, nil
	}

	// Standalone: the same configuration, with defaults fit for a laptop
	// and for several agents on one machine.
	if f.gpus > 0 {
		cfg.Standalone.GPUs = f.gpus
	}
	if f.simulateGPUs > 0 {
		cfg.Standalone.GPUs = f.simulateGPUs
	}
	if len(f.tokens) > 0 {
		cfg.Standalone.Tokens = f.tokens
	} else if !s.explicit("standalone.tokens") {
		s.randomToken = true
	}
	base := filepath.Dir(agent.DefaultSocket())
	switch {
	case f.socket != "":
		s.socket = f.socket
		if !s.explicit("socketDir") {
			cfg.SocketDir = filepath.Dir(f.socket)
		}
	case s.explicit("socketDir"):
		s.socket = cfg.SocketPath()
	default:
		cfg.SocketDir = base
		s.socket = cfg.SocketPath()
	}
	if f.devicePlugin && s.socket != cfg.SocketPath() {
		return nil, fmt.Errorf("--socket %s: with --device-plugin the socket must be <socketDir>/%s (pods mount socketDir); use --socket-dir", s.socket, contract.SocketFile)
	}
	// A pool size asked for in sizing.poolBytes holds in standalone mode
	// too, unless standalone.poolBytes is given as well.
	if s.explicit("sizing.poolBytes") && !s.explicit("standalone.poolBytes") && cfg.Sizing.PoolBytes > 0 {
		cfg.Standalone.PoolBytes = cfg.Sizing.PoolBytes
	}
	if !s.explicit("stateDir") {
		cfg.StateDir = agent.DefaultStateDir()
	}
	if !s.explicit("tokenBinding") {
		cfg.TokenBinding = config.TokenBindingNone // no pods to bind to
	}
	if err := config.CheckDirs(cfg.SocketDir, cfg.StateDir); err != nil {
		return nil, fmt.Errorf("stateDir: %w", err)
	}
	if !s.explicit("metrics.address") {
		cfg.Metrics.Address = "127.0.0.1:0"
	}
	if !s.explicit("health.address") {
		cfg.Health.Address = "127.0.0.1:0"
	}
	// The old fixed layout: either flag alone keeps the other's old default.
	if f.chunksPerGPU > 0 && f.chunkMiB == 0 {
		s.flags.chunkMiB = 64
	}
	if f.chunkMiB > 0 && f.chunksPerGPU == 0 {
		s.flags.chunksPerGPU = 4
	}
	return s, nil
}

// fileFields lists the fields a config file sets, by YAML path
// ("sizing.poolBytes"); empty without a file. config.Load has already
// validated the file.
func fileFields(path string) (map[string]bool, error) {
	out := map[string]bool{}
	if path == "" {
		return out, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	var tree map[string]any
	if err := yaml.Unmarshal(data, &tree); err != nil {
		return nil, fmt.Errorf("config: %s: %w", path, err)
	}
	var walk func(prefix string, m map[string]any)
	walk = func(prefix string, m map[string]any) {
		for k, v := range m {
			out[prefix+k] = true
			if sub, ok := v.(map[string]any); ok {
				walk(prefix+k+".", sub)
			}
		}
	}
	walk("", tree)
	return out, nil
}

// runServe is `agent [serve]`.
func runServe(ctx context.Context, args []string) error {
	s, err := resolveServe(args, os.Getenv)
	if err != nil {
		return err
	}
	log, _, err := logging.Setup(logging.Options{Level: s.cfg.Log.Level, Format: s.cfg.Log.Format})
	if err != nil {
		return err
	}
	return agent.Run(ctx, s.options(log))
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
