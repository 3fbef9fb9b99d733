// Package config loads the kvpool agent's configuration: a versioned YAML
// file (apiVersion config.kvpool.io/v1alpha1, kind AgentConfig), overridden by
// KVPOOL_* environment variables, overridden in turn by command-line flags,
// over built-in defaults. Every field is validated; an error names the field
// and the source it came from.
//
// A minimal file:
//
//	apiVersion: config.kvpool.io/v1alpha1
//	kind: AgentConfig
//	sizing:
//	  poolBytes: 64Gi
//	  split: memory
package config

import (
	"fmt"
	"path/filepath"
	"reflect"
	"time"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/contract"
)

// Version identifiers of the file format. The AgentConfig has its own API
// group, apart from the KVPoolNode CRD's kvpool.io (as kubelet's
// configuration is kubelet.config.k8s.io).
const (
	APIVersion = "config.kvpool.io/v1alpha1"
	Kind       = "AgentConfig"
)

// LegacyAPIVersion is the apiVersion the AgentConfig had before it got its
// own group. Files that still say it are read as APIVersion, and Warnings
// reports it as deprecated.
const LegacyAPIVersion = "kvpool.io/v1alpha1"

// EnvConfig names the config file when --config is not given. The names a
// pod sees (socket, environment, resource) are in pkg/contract.
const EnvConfig = "KVPOOL_CONFIG"

// Split policies: how the pool is divided between GPUs.
const (
	SplitEqual  = "equal"  // the same bytes for every GPU
	SplitMemory = "memory" // in proportion to each GPU's device memory
)

// Huge page policies.
const (
	HugePagesNever   = "never"   // always 4 KiB pages
	HugePagesPrefer  = "prefer"  // huge pages where reserved, else 4 KiB pages with a warning
	HugePagesRequire = "require" // huge pages or fail
)

// Config is the agent's whole configuration. The zero value is not valid;
// start from Default or Load.
type Config struct {
	// APIVersion must be "config.kvpool.io/v1alpha1" (APIVersion);
	// "kvpool.io/v1alpha1" (LegacyAPIVersion) is still read, with a warning.
	APIVersion string `json:"apiVersion"`
	// Kind must be "AgentConfig".
	Kind string `json:"kind"`

	// Mode is the front door pods get host KV through: "devicePlugin" (the
	// default: a kubelet device plugin of ResourceName, one device per
	// chunk) or "dra" (a DRA driver publishing ResourceSlices, DRA section;
	// the chart's DeviceClass maps ResourceName to it). One at a time: a
	// node whose allocatable lists ResourceName is served by the device
	// plugin, whatever DeviceClass names it (docs/dra.md). Cluster mode
	// only for "dra".
	Mode string `json:"mode"`
	// ResourceName is the extended resource advertised to kubelet, one unit
	// per chunk. Default "kvpool.io/host-kv". Must be a fully qualified
	// name (domain/name) outside the kubernetes.io domain.
	ResourceName string `json:"resourceName"`
	// SocketDir is the host directory holding the agent's socket
	// (SocketFile inside it); Allocate mounts the directory into
	// containers at ContainerSocketDir. Default "/var/lib/kvpool/sock".
	// Absolute; the socket path must fit a Unix socket address (107 bytes).
	SocketDir string `json:"socketDir"`
	// KubeletDir is kubelet's root directory; the device plugin socket
	// directory and the PodResources socket are found under it. Default
	// "/var/lib/kubelet". Absolute.
	KubeletDir string `json:"kubeletDir"`
	// StateDir holds the agent's checkpoint across restarts. Default
	// "/var/lib/kvpool/state". Absolute.
	StateDir string `json:"stateDir"`
	// TokenBinding says from where an allocation token works: "pod" (the
	// default) accepts it only from a process in the pod kubelet assigned
	// the allocation to (the agent needs the host's PID namespace and
	// PodLogsDir; see docs/security.md); "none" from any process that can
	// reach the socket. Standalone mode, which has no pods, uses "none"
	// unless set.
	TokenBinding string `json:"tokenBinding"`
	// PodLogsDir is kubelet's pod log directory (its podLogsDir setting),
	// where <namespace>_<name>_<uid> directories tie pod names to UIDs for
	// TokenBinding "pod". Default "/var/log/pods". Absolute.
	PodLogsDir string `json:"podLogsDir"`
	// GPUResources are the extended resources whose devices are a
	// container's GPUs, as kubelet's PodResources lists them: a container
	// holding an allocation's chunks and N of these devices runs N ranks
	// that share the allocation fairly (docs/device-plugin.md). A trailing
	// "*" matches any suffix. Default the NVIDIA device plugin's:
	// nvidia.com/gpu, nvidia.com/gpu.shared (shared GPUs renamed) and
	// nvidia.com/mig-* (MIG devices, mixed strategy). Empty: the agent does
	// not ask, and a container's clients declare their ranks themselves.
	GPUResources []string `json:"gpuResources"`
	// KeeperSocket is the Unix socket of the keeper (`agent keeper`), the
	// small process that holds the pool's memory and books while the agent
	// restarts, so that a restart or upgrade loses no session or stream.
	// Empty (the default): no keeper; a restart then drops every session
	// and stream. Absolute when set.
	KeeperSocket string `json:"keeperSocket"`
	// PollAfterReply is how long a connection keeps polling for its
	// client's next request after each reply before its thread sleeps, at
	// most 1ms. A request within it finds the agent awake: on a VM,
	// where waking an idle CPU costs tens of µs, that halves a round trip
	// (docs/benchmarks.md). The price is up to this much of one CPU per
	// request, and all of one CPU while a client sends back to back.
	// Default "0s": off.
	PollAfterReply Duration `json:"pollAfterReply"`

	// RestartInPlace says how often the container's first process restarts
	// a dead agent itself instead of leaving it to kubelet.
	RestartInPlace RestartInPlace `json:"restartInPlace"`

	// DRA configures the DRA driver (Mode "dra").
	DRA DRA `json:"dra"`
	// Sizing decides how much host memory the pool takes and how it is
	// split into per-GPU pools and chunks.
	Sizing Sizing `json:"sizing"`
	// Reclaim says when chunks of pods that are gone return to the pool.
	Reclaim Reclaim `json:"reclaim"`
	// Limits bound what one tenant can make the agent hold
	// (docs/security.md).
	Limits Limits `json:"limits"`
	// Metrics is the Prometheus endpoint.
	Metrics Metrics `json:"metrics"`
	// Health is the liveness and readiness endpoint.
	Health Health `json:"health"`
	// Log configures the agent's log/slog logger.
	Log Log `json:"log"`
	// Standalone configures --standalone mode (no kubelet).
	Standalone Standalone `json:"standalone"`
}

// RestartInPlace configures `agent serve` as a supervisor of itself
// (internal/supervise): the process kubelet starts runs the agent as its
// child and starts it again at once when it dies abnormally, instead of
// leaving the restart to kubelet (its next relist and, after a first
// crash, a back-off of 10 s and more). A crash loop still reaches kubelet:
// past Max restarts within Window the supervisor exits with the agent's
// status.
type RestartInPlace struct {
	// Max is how many restarts in place Window may hold, 0 to 100.
	// Default 0: off (the agent is the process kubelet started). The
	// chart sets 3.
	Max int `json:"max"`
	// Window is how far back restarts in place count against Max.
	// Default "10m". Positive.
	Window Duration `json:"window"`
	// Spare keeps a second agent process waiting, past its own start (Go's
	// initialisation, 30-45 ms on a small VM), to take over at a restart
	// in place. It costs the node one process (about 5 MiB of its own
	// memory, more with ReadAhead). Default false; the chart sets true.
	Spare bool `json:"spare"`
	// SpareAfter is how long after a start or a restart in place the next
	// spare is started: not at once, so that its own start and first read
	// of the books take no CPU from the restore of the agent it stands
	// behind (at most about 300 ms at the agent's bound), and soon, since
	// a crash before the spare has read the books replays them whole.
	// Default "500ms", at most "1h"; "0s": at once.
	SpareAfter Duration `json:"spareAfter"`
	// ReadAhead makes the spare, while it waits, replay the books the
	// keeper holds as the agent appends to them and keep warm the heap
	// the rest of a restore takes, so that a restart in place replays
	// only the last records (at the agent's bound of 524,288 streams:
	// serving again 40-70 ms after a SIGKILL against 105-375 without).
	// It costs the spare about the memory a restore takes (about 150 MiB
	// at that bound, a few MiB with few streams) and a CPU's fraction
	// while the books grow. Default true; off: the spare waits idle.
	ReadAhead bool `json:"readAhead"`
	// SpareMemory bounds what the spare's read ahead holds (the state it
	// followed and the heap it keeps warm): it warms no more than fits,
	// and where the state alone does not fit it drops it and stops reading
	// ahead, with a warning (the next restart then replays the books
	// whole), so that the spare never takes memory the container's limit
	// leaves the agent.
	// Default 0: no bound. The chart sets what it reserves for the spare,
	// half of pool.headroom.
	SpareMemory Bytes `json:"spareMemory"`
}

// DRA configures the DRA driver. Its sockets go where kubelet looks for
// them, under KubeletDir: plugins/<DriverName>/dra.sock and
// plugins_registry/<DriverName>-reg.sock.
type DRA struct {
	// DriverName is the DRA driver's name, the domain of its device
	// attributes, and what the DeviceClasses select. A DNS subdomain of at
	// most 63 characters. Default "kvpool.io".
	DriverName string `json:"driverName"`
	// CDIDir is the container runtime's CDI spec directory, where the
	// driver writes one spec per prepared claim. Default "/var/run/cdi".
	// Absolute.
	CDIDir string `json:"cdiDir"`
}

// Sizing is the pool sizing policy. The planned pool never exceeds the
// agent's cgroup memory limit less CgroupHeadroomBytes, nor MemAvailable
// less ReserveBytes.
type Sizing struct {
	// PoolBytes is the whole pool across all GPUs as a quantity ("64Gi").
	// When set (non-zero) it wins over Fraction. Default 0 (use Fraction).
	PoolBytes Bytes `json:"poolBytes"`
	// Fraction is the share of usable memory (MemAvailable less
	// ReserveBytes, and at most the node's allocatable memory) given to the
	// pool when PoolBytes is 0. In (0, 1]. Default 0.5.
	Fraction float64 `json:"fraction"`
	// ReserveBytes is memory kept for the system and other pods: the pool
	// never takes MemAvailable less this. Default "8Gi".
	ReserveBytes Bytes `json:"reserveBytes"`
	// CgroupHeadroomBytes is kept free below the agent's own cgroup memory
	// limit for the agent's heap and stacks. Default "512Mi".
	CgroupHeadroomBytes Bytes `json:"cgroupHeadroomBytes"`
	// Split divides the pool between GPUs: "equal" or "memory"
	// (proportional to each GPU's device memory). Default "equal".
	Split string `json:"split"`
	// MinPerGPU is the least a GPU's pool may have; if the bounds leave
	// less, planning fails naming the bound. Default 0 (no minimum).
	MinPerGPU Bytes `json:"minPerGPU"`
	// MaxPerGPU caps each GPU's pool. Default 0 (no cap). When both are
	// set, MinPerGPU <= MaxPerGPU.
	MaxPerGPU Bytes `json:"maxPerGPU"`
	// ChunkBytes is the size of one chunk, the unit a pod requests and one
	// device-plugin device. A multiple of 2Mi, from 2Mi to 64Gi.
	// Default "1Gi".
	ChunkBytes Bytes `json:"chunkBytes"`
	// HugePages is the huge page policy: "never", "prefer" (use reserved
	// huge pages where there are enough, else 4 KiB pages with a warning)
	// or "require" (fail without them). Default "prefer".
	HugePages string `json:"hugePages"`
}

// Reclaim configures the reconciliation against kubelet's PodResources.
type Reclaim struct {
	// GracePeriod is how long a chunk may stay allocated without a pod
	// holding it before it returns to the pool (Allocate precedes the pod
	// showing up in PodResources). Default "2m". Non-negative.
	GracePeriod Duration `json:"gracePeriod"`
	// Interval is how often PodResources is polled. Default "10s".
	// Positive.
	Interval Duration `json:"interval"`
}

// Limits bound every per-tenant resource of the socket server. A request
// over a bound is refused with status "limit" and a message naming the
// bound; docs/security.md derives the memory they bound.
type Limits struct {
	// MaxConns bounds the tenants' connections together (the agent's own
	// probes have ProbeConns apart). Default 1024.
	MaxConns int `json:"maxConns"`
	// MaxConnsPerUID bounds one peer user's connections. Default 512.
	MaxConnsPerUID int `json:"maxConnsPerUID"`
	// MaxConnsPerPID bounds one peer process's connections (a peer whose
	// PID the agent cannot see counts against its UID only). Default 64.
	MaxConnsPerPID int `json:"maxConnsPerPID"`
	// ProbeConns are connections only the agent's own process may use:
	// its health probes never compete with tenants. Default 8.
	ProbeConns int `json:"probeConns"`
	// HelloTimeout is how long a new connection may take to say hello.
	// Default "5s".
	HelloTimeout Duration `json:"helloTimeout"`
	// OpenTimeout is how long, from connecting, a connection may take to
	// open a session. At least HelloTimeout. Default "15s".
	OpenTimeout Duration `json:"openTimeout"`
	// MaxSessions bounds the agent's sessions. Default 1024.
	MaxSessions int `json:"maxSessions"`
	// MaxSessionsPerAllocation bounds one allocation's sessions. At most
	// MaxSessions. Default 64.
	MaxSessionsPerAllocation int `json:"maxSessionsPerAllocation"`
	// MaxStreamsPerSession bounds one session's streams. Default 131072.
	MaxStreamsPerSession int `json:"maxStreamsPerSession"`
	// MaxNameBytesPerSession bounds the bytes of request IDs and labels
	// one session holds, counted once per stream. At least 2Ki (one stream
	// of the longest names). Default "16Mi".
	MaxNameBytesPerSession Bytes `json:"maxNameBytesPerSession"`
	// MaxStreams and MaxNameBytes bound the same over every session
	// together: what the agent's heap, its books and its restart time
	// grow with (docs/sizing.md, "Agent memory"). At least the
	// per-session bounds. The chart derives both from pool.headroom.
	// Defaults 524288 and "32Mi" (for the default 512Mi headroom).
	MaxStreams   int   `json:"maxStreams"`
	MaxNameBytes Bytes `json:"maxNameBytes"`
	// MaxDevicePages bounds the device pages of a session's layout; the
	// agent keeps one bit per device page per session, and a change's
	// record in the books holds up to 5 bytes per page. 1 to 134217728.
	// Default 16777216 (a 2 MiB bitmap).
	MaxDevicePages int `json:"maxDevicePages"`
	// MaxDevicePagesTotal bounds the device pages of every session's
	// layout together: a bit each in the agent's heap. At least
	// MaxDevicePages. Default 536870912 (64 MiB of bitmaps).
	MaxDevicePagesTotal int `json:"maxDevicePagesTotal"`
	// MaxPages bounds the host pages of every open session together (a
	// session's pages: its chunks' bytes over its page size, or the pages
	// it asked for): each costs the agent 4 bytes of memory once used, and
	// the page size is the tenant's choice. 0 (the default): the pool's
	// bytes / 4Ki, at least 4194304, which the chart's memory limit and
	// the sizing's cgroup bound reserve (docs/sizing.md, "Agent memory").
	MaxPages int `json:"maxPages"`
	// MaxClientName bounds the client name of a hello, in bytes. 16 to
	// 2048. Default 256.
	MaxClientName int `json:"maxClientName"`
}

// Metrics configures the Prometheus endpoint.
type Metrics struct {
	// Address is the host:port to serve /metrics on; empty disables it.
	// Default ":9464".
	Address string `json:"address"`
}

// Health configures the probe endpoint.
type Health struct {
	// Address is the host:port to serve /livez, /readyz and /status on; empty
	// disables it. Default ":8081".
	Address string `json:"address"`
}

// Log configures logging.
type Log struct {
	// Level is "debug", "info", "warn" or "error". Default "info".
	Level string `json:"level"`
	// Format is "text" or "json". Default "text".
	Format string `json:"format"`
}

// Standalone configures --standalone mode: no kubelet, simulated GPUs
// (whatever GPUs the machine has), and allocations named by fixed tokens.
type Standalone struct {
	// Tokens are the allocation tokens clients may open sessions with
	// (each one owns an equal share of the chunks). Each is non-empty,
	// without whitespace or commas, and unique. In the environment and on
	// the command line: a comma-separated list. Default: one token, "dev".
	Tokens []string `json:"tokens"`
	// GPUs is the number of simulated GPUs standalone mode serves (it
	// never uses real ones). 1 to 64. Default 2.
	GPUs int `json:"gpus"`
	// PoolBytes is the whole pool in standalone mode, replacing the sizing
	// policy's total so a laptop does not pin half its memory. Default
	// "512Mi". Positive.
	PoolBytes Bytes `json:"poolBytes"`
}

// DefaultDRADriverName is the DRA driver's default name (internal/dra
// says the same; config imports no Kubernetes code).
const DefaultDRADriverName = "kvpool.io"

// Mode values.
const (
	ModeDevicePlugin = "devicePlugin"
	ModeDRA          = "dra"
)

// TokenBinding values.
const (
	TokenBindingPod  = "pod"
	TokenBindingNone = "none"
)

// Default returns the built-in configuration.
//
// Each default is written once. The socket server's limits are the
// server's own (server.DefaultLimits, read here): the server is also run
// without a configuration (its tests, the client's), where a zero limit
// takes the same value. The device plugin has no defaults for what it is
// given here (directories, reclaim periods): the agent always passes the
// configured values, so this is their one place. config imports the
// server, never the other way round; pkg/plugin imports no internal
// package.
func Default() Config {
	return Config{
		APIVersion:     APIVersion,
		Kind:           Kind,
		Mode:           ModeDevicePlugin,
		ResourceName:   contract.DefaultResourceName,
		SocketDir:      "/var/lib/kvpool/sock",
		KubeletDir:     "/var/lib/kubelet",
		StateDir:       "/var/lib/kvpool/state",
		TokenBinding:   TokenBindingPod,
		PodLogsDir:     "/var/log/pods",
		DRA:            DRA{DriverName: DefaultDRADriverName, CDIDir: "/var/run/cdi"},
		RestartInPlace: RestartInPlace{Window: Duration{10 * time.Minute}, SpareAfter: Duration{500 * time.Millisecond}, ReadAhead: true},
		GPUResources:   []string{"nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*"},
		Sizing: Sizing{
			Fraction:            0.5,
			ReserveBytes:        8 * GiB,
			CgroupHeadroomBytes: 512 * MiB,
			Split:               SplitEqual,
			ChunkBytes:          1 * GiB,
			HugePages:           HugePagesPrefer,
		},
		Reclaim: Reclaim{
			GracePeriod: Duration{2 * time.Minute},
			Interval:    Duration{10 * time.Second},
		},
		Limits:     limitsOf(server.DefaultLimits),
		Metrics:    Metrics{Address: ":9464"},
		Health:     Health{Address: ":8081"},
		Log:        Log{Level: "info", Format: "text"},
		Standalone: Standalone{Tokens: []string{"dev"}, GPUs: 2, PoolBytes: 512 * MiB},
	}
}

// LimitsFrom is the configuration of the server's limits l, every zero
// field of l taking server.DefaultLimits' (for embedders: pkg/standalone).
func LimitsFrom(l server.Limits) Limits {
	d := limitsOf(server.DefaultLimits)
	c := limitsOf(l)
	dv, cv := reflect.ValueOf(&d).Elem(), reflect.ValueOf(&c).Elem()
	for i := range cv.NumField() {
		if cv.Field(i).IsZero() {
			cv.Field(i).Set(dv.Field(i))
		}
	}
	return c
}

// limitsOf is the configuration of the server's limits l; Server is the
// way back.
func limitsOf(l server.Limits) Limits {
	return Limits{
		MaxConns: l.MaxConns, MaxConnsPerUID: l.MaxConnsPerUID, MaxConnsPerPID: l.MaxConnsPerPID,
		ProbeConns: l.ProbeConns, HelloTimeout: Duration{l.HelloTimeout}, OpenTimeout: Duration{l.OpenTimeout},
		MaxSessions: l.MaxSessions, MaxSessionsPerAllocation: l.MaxSessionsPerAllocation,
		MaxStreamsPerSession: l.MaxStreamsPerSession, MaxNameBytesPerSession: Bytes(l.MaxNameBytesPerSession),
		MaxStreams: l.MaxStreams, MaxNameBytes: Bytes(l.MaxNameBytes),
		MaxDevicePages: l.MaxDevicePages, MaxDevicePagesTotal: l.MaxDevicePagesTotal, MaxClientName: l.MaxClientName,
	}
}

// Server is the socket server's limits as configured. MaxPages is not one
// of them: the agent sets it on the pool (pool.Pool.SetMaxPages).
func (l Limits) Server() server.Limits {
	return server.Limits{
		MaxConns: l.MaxConns, MaxConnsPerUID: l.MaxConnsPerUID, MaxConnsPerPID: l.MaxConnsPerPID,
		ProbeConns: l.ProbeConns, HelloTimeout: l.HelloTimeout.Duration, OpenTimeout: l.OpenTimeout.Duration,
		MaxSessions: l.MaxSessions, MaxSessionsPerAllocation: l.MaxSessionsPerAllocation,
		MaxStreamsPerSession: l.MaxStreamsPerSession, MaxNameBytesPerSession: int64(l.MaxNameBytesPerSession),
		MaxStreams: l.MaxStreams, MaxNameBytes: int64(l.MaxNameBytes),
		MaxDevicePages: l.MaxDevicePages, MaxDevicePagesTotal: l.MaxDevicePagesTotal, MaxClientName: l.MaxClientName,
	}
}

// SocketPath is the agent's socket on the host: SocketDir/contract.SocketFile.
func (c *Config) SocketPath() string { return filepath.Join(c.SocketDir, contract.SocketFile) }

// Warnings lists what in c still works but should change, such as the
// deprecated LegacyAPIVersion; nil when nothing. Load and Parse succeed
// with these; the agent logs them at start.
func (c *Config) Warnings() []string {
	var w []string
	if c.APIVersion == LegacyAPIVersion {
		w = append(w, fmt.Sprintf("apiVersion %q is deprecated: it is the KVPoolNode CRD's group; write %q (the old one is still read)", LegacyAPIVersion, APIVersion))
	}
	return w
}
