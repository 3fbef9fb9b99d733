package config

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"

	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// setting is one field that the environment and flags can set.
type setting struct {
	field string // YAML path, used in messages
	flag  string // flag name without dashes
	env   string // environment variable
	usage string
	get   func(*Config) string
	set   func(*Config, string) error
}

// accessor reads a field as text and parses text into it.
type accessor struct {
	get func(*Config) string
	set func(*Config, string) error
}

func str(p func(*Config) *string) accessor {
	return accessor{func(c *Config) string { return *p(c) },
		func(c *Config, s string) error { *p(c) = s; return nil }}
}

func qty(p func(*Config) *Bytes) accessor {
	return accessor{func(c *Config) string { return p(c).String() },
		func(c *Config, s string) error {
			v, err := ParseBytes(s)
			if err != nil {
				return err
			}
			*p(c) = v
			return nil
		}}
}

func boolean(p func(*Config) *bool) accessor {
	return accessor{func(c *Config) string { return strconv.FormatBool(*p(c)) },
		func(c *Config, s string) error {
			v, err := strconv.ParseBool(strings.TrimSpace(s))
			if err != nil {
				return fmt.Errorf("%q is not true or false", s)
			}
			*p(c) = v
			return nil
		}}
}

func integer(p func(*Config) *int) accessor {
	return accessor{func(c *Config) string { return strconv.Itoa(*p(c)) },
		func(c *Config, s string) error {
			v, err := strconv.Atoi(strings.TrimSpace(s))
			if err != nil {
				return fmt.Errorf("%q is not an integer", s)
			}
			*p(c) = v
			return nil
		}}
}

func dur(p func(*Config) *Duration) accessor {
	return accessor{func(c *Config) string { return p(c).String() },
		func(c *Config, s string) error {
			v, err := ParseDuration(s)
			if err != nil {
				return err
			}
			*p(c) = v
			return nil
		}}
}

// settings lists every field reachable from flags and the environment.
var settings = func() []setting {
	var l []setting
	add := func(field, flagName, env, usage string, a accessor) {
		l = append(l, setting{field: field, flag: flagName, env: env, usage: usage, get: a.get, set: a.set})
	}
	add("mode", "mode", "KVPOOL_MODE", "front door: devicePlugin (kubelet device plugin) or dra (DRA driver, ResourceSlices)", str(func(c *Config) *string { return &c.Mode }))
	add("resourceName", "resource-name", "KVPOOL_RESOURCE_NAME", "extended resource advertised to kubelet, one unit per chunk", str(func(c *Config) *string { return &c.ResourceName }))
	add("socketDir", "socket-dir", "KVPOOL_SOCKET_DIR", "host directory of the agent socket (mounted into pods)", str(func(c *Config) *string { return &c.SocketDir }))
	add("kubeletDir", "kubelet-dir", "KVPOOL_KUBELET_DIR", "kubelet root directory", str(func(c *Config) *string { return &c.KubeletDir }))
	add("tokenBinding", "token-binding", "KVPOOL_TOKEN_BINDING", "where a token works: pod (only from the pod it was allocated to) or none", str(func(c *Config) *string { return &c.TokenBinding }))
	add("podLogsDir", "pod-logs-dir", "KVPOOL_POD_LOGS_DIR", "kubelet's pod log directory (ties pod names to UIDs for --token-binding pod)", str(func(c *Config) *string { return &c.PodLogsDir }))
	add("gpuResources", "gpu-resources", "KVPOOL_GPU_RESOURCES", "comma-separated resources whose devices are a container's GPUs (a trailing * matches any suffix)", accessor{func(c *Config) string { return strings.Join(c.GPUResources, ",") },
		func(c *Config, s string) error {
			c.GPUResources = nil
			for _, r := range strings.Split(s, ",") {
				if r = strings.TrimSpace(r); r != "" {
					c.GPUResources = append(c.GPUResources, r)
				}
			}
			return nil
		}})
	add("pollAfterReply", "poll-after-reply", "KVPOOL_POLL_AFTER_REPLY", "how long a connection polls for the next request after a reply (0: off, at most 1ms)", dur(func(c *Config) *Duration { return &c.PollAfterReply }))
	add("keeperSocket", "keeper-socket", "KVPOOL_KEEPER_SOCKET", "the keeper's socket, which keeps the pool across agent restarts (empty: none)", str(func(c *Config) *string { return &c.KeeperSocket }))
	add("restartInPlace.max", "restart-in-place-max", "KVPOOL_RESTART_IN_PLACE_MAX", "restarts of a dead agent by its own supervisor within the window, before kubelet's (0: off)", integer(func(c *Config) *int { return &c.RestartInPlace.Max }))
	add("restartInPlace.window", "restart-in-place-window", "KVPOOL_RESTART_IN_PLACE_WINDOW", "how far back restarts in place count", dur(func(c *Config) *Duration { return &c.RestartInPlace.Window }))
	add("restartInPlace.spare", "restart-in-place-spare", "KVPOOL_RESTART_IN_PLACE_SPARE", "keep a spare agent process, already started, to take over at a restart in place (true or false)", boolean(func(c *Config) *bool { return &c.RestartInPlace.Spare }))
	add("restartInPlace.readAhead", "restart-in-place-read-ahead", "KVPOOL_RESTART_IN_PLACE_READ_AHEAD", "the spare replays the kept books ahead of its turn and keeps the restore's heap warm (true or false)", boolean(func(c *Config) *bool { return &c.RestartInPlace.ReadAhead }))
	add("restartInPlace.spareMemory", "restart-in-place-spare-memory", "KVPOOL_RESTART_IN_PLACE_SPARE_MEMORY", "the most memory the spare's read ahead may hold (0: no bound)", qty(func(c *Config) *Bytes { return &c.RestartInPlace.SpareMemory }))
	add("restartInPlace.spareAfter", "restart-in-place-spare-after", "KVPOOL_RESTART_IN_PLACE_SPARE_AFTER", "how long after a start or a restart in place the next spare starts", dur(func(c *Config) *Duration { return &c.RestartInPlace.SpareAfter }))
	add("stateDir", "state-dir", "KVPOOL_STATE_DIR", "directory for the agent checkpoint", str(func(c *Config) *string { return &c.StateDir }))
	add("dra.driverName", "dra-driver-name", "KVPOOL_DRA_DRIVER_NAME", "the DRA driver's name (mode dra)", str(func(c *Config) *string { return &c.DRA.DriverName }))
	add("dra.cdiDir", "cdi-dir", "KVPOOL_CDI_DIR", "the container runtime's CDI spec directory (mode dra)", str(func(c *Config) *string { return &c.DRA.CDIDir }))
	add("sizing.poolBytes", "pool-bytes", "KVPOOL_POOL_BYTES", "whole pool size, e.g. 64Gi (0: use --pool-fraction)", qty(func(c *Config) *Bytes { return &c.Sizing.PoolBytes }))
	add("sizing.fraction", "pool-fraction", "KVPOOL_POOL_FRACTION", "share of usable memory for the pool, in (0, 1]", accessor{func(c *Config) string { return strconv.FormatFloat(c.Sizing.Fraction, 'g', -1, 64) },
		func(c *Config, s string) error {
			v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
			if err != nil {
				return fmt.Errorf("%q is not a number", s)
			}
			c.Sizing.Fraction = v
			return nil
		}})
	add("sizing.reserveBytes", "reserve-bytes", "KVPOOL_RESERVE_BYTES", "memory kept for the system below MemAvailable", qty(func(c *Config) *Bytes { return &c.Sizing.ReserveBytes }))
	add("sizing.cgroupHeadroomBytes", "cgroup-headroom-bytes", "KVPOOL_CGROUP_HEADROOM_BYTES", "memory kept free below the agent's cgroup limit", qty(func(c *Config) *Bytes { return &c.Sizing.CgroupHeadroomBytes }))
	add("sizing.split", "split", "KVPOOL_SPLIT", "per-GPU split: equal or memory", str(func(c *Config) *string { return &c.Sizing.Split }))
	add("sizing.minPerGPU", "min-per-gpu", "KVPOOL_MIN_PER_GPU", "least pool per GPU (0: none)", qty(func(c *Config) *Bytes { return &c.Sizing.MinPerGPU }))
	add("sizing.maxPerGPU", "max-per-gpu", "KVPOOL_MAX_PER_GPU", "most pool per GPU (0: no cap)", qty(func(c *Config) *Bytes { return &c.Sizing.MaxPerGPU }))
	add("sizing.chunkBytes", "chunk-bytes", "KVPOOL_CHUNK_BYTES", "chunk size, a multiple of 2Mi", qty(func(c *Config) *Bytes { return &c.Sizing.ChunkBytes }))
	add("sizing.hugePages", "huge-pages", "KVPOOL_HUGE_PAGES", "huge page policy: never, prefer or require", str(func(c *Config) *string { return &c.Sizing.HugePages }))
	add("reclaim.gracePeriod", "reclaim-grace-period", "KVPOOL_RECLAIM_GRACE_PERIOD", "how long an allocation may lack a pod before its chunks return", dur(func(c *Config) *Duration { return &c.Reclaim.GracePeriod }))
	add("reclaim.interval", "reclaim-interval", "KVPOOL_RECLAIM_INTERVAL", "how often PodResources is polled", dur(func(c *Config) *Duration { return &c.Reclaim.Interval }))
	lim := func(c *Config) *Limits { return &c.Limits }
	add("limits.maxConns", "max-conns", "KVPOOL_MAX_CONNS", "tenants' socket connections in all", integer(func(c *Config) *int { return &lim(c).MaxConns }))
	add("limits.maxConnsPerUID", "max-conns-per-uid", "KVPOOL_MAX_CONNS_PER_UID", "socket connections of one peer user", integer(func(c *Config) *int { return &lim(c).MaxConnsPerUID }))
	add("limits.maxConnsPerPID", "max-conns-per-pid", "KVPOOL_MAX_CONNS_PER_PID", "socket connections of one peer process", integer(func(c *Config) *int { return &lim(c).MaxConnsPerPID }))
	add("limits.probeConns", "probe-conns", "KVPOOL_PROBE_CONNS", "socket connections kept for the agent's own probes", integer(func(c *Config) *int { return &lim(c).ProbeConns }))
	add("limits.helloTimeout", "hello-timeout", "KVPOOL_HELLO_TIMEOUT", "time from connecting to hello", dur(func(c *Config) *Duration { return &lim(c).HelloTimeout }))
	add("limits.openTimeout", "open-timeout", "KVPOOL_OPEN_TIMEOUT", "time from connecting to an open session", dur(func(c *Config) *Duration { return &lim(c).OpenTimeout }))
	add("limits.maxSessions", "max-sessions", "KVPOOL_MAX_SESSIONS", "sessions in all", integer(func(c *Config) *int { return &lim(c).MaxSessions }))
	add("limits.maxSessionsPerAllocation", "max-sessions-per-allocation", "KVPOOL_MAX_SESSIONS_PER_ALLOCATION", "sessions of one allocation", integer(func(c *Config) *int { return &lim(c).MaxSessionsPerAllocation }))
	add("limits.maxStreamsPerSession", "max-streams-per-session", "KVPOOL_MAX_STREAMS_PER_SESSION", "streams one session may hold", integer(func(c *Config) *int { return &lim(c).MaxStreamsPerSession }))
	add("limits.maxNameBytesPerSession", "max-name-bytes-per-session", "KVPOOL_MAX_NAME_BYTES_PER_SESSION", "bytes of request IDs and labels one session may hold", qty(func(c *Config) *Bytes { return &lim(c).MaxNameBytesPerSession }))
	add("limits.maxStreams", "max-streams", "KVPOOL_MAX_STREAMS", "streams every session together may hold", integer(func(c *Config) *int { return &lim(c).MaxStreams }))
	add("limits.maxNameBytes", "max-name-bytes", "KVPOOL_MAX_NAME_BYTES", "bytes of request IDs and labels every session together may hold", qty(func(c *Config) *Bytes { return &lim(c).MaxNameBytes }))
	add("limits.maxDevicePages", "max-device-pages", "KVPOOL_MAX_DEVICE_PAGES", "device pages a session's layout may name", integer(func(c *Config) *int { return &lim(c).MaxDevicePages }))
	add("limits.maxDevicePagesTotal", "max-device-pages-total", "KVPOOL_MAX_DEVICE_PAGES_TOTAL", "device pages the layouts of every session together may name", integer(func(c *Config) *int { return &lim(c).MaxDevicePagesTotal }))
	add("limits.maxPages", "max-pages", "KVPOOL_MAX_PAGES", "host pages of every open session together (0: the pool's bytes / 4Ki, at least 4Mi pages)", integer(func(c *Config) *int { return &lim(c).MaxPages }))
	add("limits.maxClientName", "max-client-name", "KVPOOL_MAX_CLIENT_NAME", "bytes of a client's name in its hello", integer(func(c *Config) *int { return &lim(c).MaxClientName }))
	add("metrics.address", "metrics-address", "KVPOOL_METRICS_ADDRESS", "host:port for /metrics (empty: off)", str(func(c *Config) *string { return &c.Metrics.Address }))
	add("health.address", "health-address", "KVPOOL_HEALTH_ADDRESS", "host:port for /livez, /readyz and /status (empty: off)", str(func(c *Config) *string { return &c.Health.Address }))
	add("log.level", "log-level", "KVPOOL_LOG_LEVEL", "debug, info, warn or error", str(func(c *Config) *string { return &c.Log.Level }))
	add("log.format", "log-format", "KVPOOL_LOG_FORMAT", "text or json", str(func(c *Config) *string { return &c.Log.Format }))
	add("standalone.tokens", "standalone-tokens", "KVPOOL_STANDALONE_TOKENS", "comma-separated allocation tokens for --standalone", accessor{func(c *Config) string { return strings.Join(c.Standalone.Tokens, ",") },
		func(c *Config, s string) error {
			var toks []string
			for _, t := range strings.Split(s, ",") {
				toks = append(toks, strings.TrimSpace(t))
			}
			c.Standalone.Tokens = toks
			return nil
		}})
	add("standalone.gpus", "standalone-gpus", "KVPOOL_STANDALONE_GPUS", "the simulated GPUs of --standalone (it never uses real ones)", accessor{func(c *Config) string { return strconv.Itoa(c.Standalone.GPUs) },
		func(c *Config, s string) error {
			v, err := strconv.Atoi(strings.TrimSpace(s))
			if err != nil {
				return fmt.Errorf("%q is not an integer", s)
			}
			c.Standalone.GPUs = v
			return nil
		}})
	add("standalone.poolBytes", "standalone-pool-bytes", "KVPOOL_STANDALONE_POOL_BYTES", "whole pool in --standalone, e.g. 512Mi", qty(func(c *Config) *Bytes { return &c.Standalone.PoolBytes }))
	return l
}()

// flagValue holds a flag's text until Load applies it.
type flagValue struct{ s string }

func (v *flagValue) String() string     { return v.s }
func (v *flagValue) Set(s string) error { v.s = s; return nil }

// RegisterFlags defines --config and one flag per setting on fs (for
// example --pool-bytes, --split, --log-level). Pass fs to Load after
// fs.Parse; only flags given on the command line override.
func RegisterFlags(fs *flag.FlagSet) {
	def := Default()
	fs.Var(&flagValue{}, "config", "agent config file (YAML, kind AgentConfig); env "+EnvConfig)
	for _, s := range settings {
		fs.Var(&flagValue{s: s.get(&def)}, s.flag, fmt.Sprintf("%s (%s; env %s)", s.usage, s.field, s.env))
	}
}

// Source is where a configuration value came from.
type Source string

// The sources, from the weakest to the strongest.
const (
	FromDefault Source = "default"
	FromFile    Source = "file"
	FromEnv     Source = "env"
	FromFlag    Source = "flag"
)

// Sources says where each field's value came from, by YAML path
// ("sizing.poolBytes"); a field it does not list has its default. The file
// lists every key it sets, sections included ("sizing").
type Sources map[string]Source

// Of is where field's value came from.
func (s Sources) Of(field string) Source {
	if v, ok := s[field]; ok {
		return v
	}
	return FromDefault
}

// String lists the fields not left at their default, sorted, as
// "field=source" separated by commas ("log.level=flag,sizing.split=env").
func (s Sources) String() string {
	fields := make([]string, 0, len(s))
	for f := range s {
		fields = append(fields, f)
	}
	sort.Strings(fields)
	for i, f := range fields {
		fields[i] = f + "=" + string(s[f])
	}
	return strings.Join(fields, ",")
}

// Explicit reports whether field was set by the file, the environment or a
// flag rather than left at its default.
func (s Sources) Explicit(field string) bool { return s.Of(field) != FromDefault }

// Load builds the configuration: defaults, then the file at path (if path
// is non-empty), then KVPOOL_* variables read through env (if non-nil),
// then the flags set on fs (if non-nil; defined by RegisterFlags). The
// result is validated. Errors name the source and the field. Sources says
// where each value came from; the config's Warnings say what still works
// but should change (a deprecated apiVersion).
//
// When path is empty, the file is taken from --config on fs, else from
// KVPOOL_CONFIG; when none names a file, there is none.
func Load(path string, env func(string) string, fs *flag.FlagSet) (*Config, Sources, error) {
	set := map[string]string{}
	if fs != nil {
		fs.Visit(func(f *flag.Flag) { set[f.Name] = f.Value.String() })
	}
	if path == "" {
		path = set["config"]
	}
	if path == "" && env != nil {
		path = env(EnvConfig)
	}
	c := Default()
	src := Sources{}
	if path != "" {
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, nil, fmt.Errorf("config: %w", err)
		}
		keys, err := decode(data, &c)
		if err != nil {
			return nil, nil, fmt.Errorf("config: %s: %w", path, err)
		}
		for _, k := range keys {
			src[k] = FromFile
		}
	}
	if env != nil {
		for _, s := range settings {
			if v := env(s.env); v != "" {
				if err := s.set(&c, v); err != nil {
					return nil, nil, fmt.Errorf("config: environment %s (%s): %w", s.env, s.field, err)
				}
				src[s.field] = FromEnv
			}
		}
	}
	for _, s := range settings {
		if v, ok := set[s.flag]; ok {
			if err := s.set(&c, v); err != nil {
				return nil, nil, fmt.Errorf("config: flag --%s (%s): %w", s.flag, s.field, err)
			}
			src[s.field] = FromFlag
		}
	}
	if err := c.Validate(); err != nil {
		from := "defaults"
		if path != "" {
			from = path
		}
		return nil, nil, fmt.Errorf("config: invalid configuration (file %s, environment and flags):\n%w", from, err)
	}
	return &c, src, nil
}

// Parse decodes a config file's bytes over the defaults and validates the
// result; unknown fields, a wrong apiVersion or kind, and bad values are
// errors. LegacyAPIVersion is read, and reported by the config's Warnings.
func Parse(data []byte) (*Config, error) {
	c := Default()
	if _, err := decode(data, &c); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return &c, nil
}

// decode reads YAML over c, strictly: unknown and duplicate fields are
// errors, and the file must say its apiVersion and kind. It returns the keys
// the file sets, by YAML path, sections included.
func decode(data []byte, c *Config) ([]string, error) {
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, errors.New("file is empty; want at least apiVersion: " + APIVersion + " and kind: " + Kind)
	}
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := yaml.Unmarshal(data, &head); err != nil {
		return nil, fmt.Errorf("not a YAML mapping: %w", err)
	}
	if head.APIVersion != APIVersion && head.APIVersion != LegacyAPIVersion {
		return nil, fmt.Errorf("apiVersion is %q, want %q", head.APIVersion, APIVersion)
	}
	if head.Kind != Kind {
		return nil, fmt.Errorf("kind is %q, want %q", head.Kind, Kind)
	}
	// Strictness first, with Kubernetes' own decoders: YAML to JSON
	// refuses a key set twice in one mapping, and sigs.k8s.io/json (unlike
	// encoding/json) matches field names with their exact case and names
	// every unknown field by its path. Its value errors are left to the
	// decode below, which converts YAML scalars to the field's type ("9464"
	// into a string field), as the YAML to JSON step alone does not.
	js, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		// yaml.v2 lists its errors one per line ("line 4: key "x" already
		// set in map"); keep the message on one line.
		return nil, errors.New(strings.ReplaceAll(err.Error(), "\n  ", " "))
	}
	var scratch Config
	if strict, _ := kjson.UnmarshalStrict(js, &scratch); len(strict) > 0 {
		msgs := make([]string, len(strict))
		for i, e := range strict {
			msgs[i] = e.Error()
		}
		return nil, errors.New(strings.Join(msgs, "; "))
	}
	if err := yaml.Unmarshal(data, c); err != nil {
		return nil, err
	}
	var tree map[string]any
	if err := yaml.Unmarshal(data, &tree); err != nil {
		return nil, fmt.Errorf("not a YAML mapping: %w", err)
	}
	return keyPaths(tree, ""), nil
}

// keyPaths lists the keys of m and of its sub-mappings by YAML path.
func keyPaths(m map[string]any, prefix string) []string {
	var out []string
	for k, v := range m {
		out = append(out, prefix+k)
		if sub, ok := v.(map[string]any); ok {
			out = append(out, keyPaths(sub, prefix+k+".")...)
		}
	}
	sort.Strings(out)
	return out
}

// Marshal writes c as a YAML config file that Parse reads back.
func Marshal(c *Config) ([]byte, error) { return yaml.Marshal(c) }
