package config

import (
	"errors"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	"k8s.io/apimachinery/pkg/util/validation/field"

	"github.com/kvpool/kvpool/pkg/contract"
)

func TestParseBytes(t *testing.T) {
	good := []struct {
		in   string
		want Bytes
	}{
		{"0", 0},
		{"4096", 4096},
		{"1Ki", 1024},
		{"512Mi", 512 << 20},
		{"64Gi", 64 << 30},
		{"2Ti", 2 << 40},
		{"1Pi", 1 << 50},
		{"1Ei", 1 << 60},
		{"1.5Gi", 3 << 29},
		{"0.5Ki", 512},
		{"1k", 1000},
		{"1K", 1000},
		{"2M", 2e6},
		{"3G", 3e9},
		{"1T", 1e12},
		{" 8Gi ", 8 << 30},
		{"7Ei", 7 << 60},
		{"9223372036854775807", 1<<63 - 1},
	}
	for _, g := range good {
		got, err := ParseBytes(g.in)
		if err != nil || got != g.want {
			t.Errorf("ParseBytes(%q) = %d, %v; want %d", g.in, got, err, g.want)
		}
	}
	bad := []struct{ in, msg string }{
		{"", "empty"},
		{"   ", "empty"},
		{"-1", "want a non-negative number"},
		{"-1Gi", "want a non-negative number"},
		{"Gi", "want a non-negative number"},
		{".", "want a non-negative number"},
		{"1..2", "want a non-negative number"},
		{"1.2.3Gi", "want a non-negative number"},
		{"1e9", "unknown suffix"},
		{"10GB", "unknown suffix"},
		{"10gi", "unknown suffix"},
		{"10 Gi", "unknown suffix"},
		{"0.3", "not a whole number"},
		{"1.1Ki", "not a whole number"},
		{"8Ei", "too large"},
		{"9223372036854775808", "too large"},
		{"99999999999999999999999Ei", "too large"},
	}
	for _, b := range bad {
		_, err := ParseBytes(b.in)
		if err == nil || !strings.Contains(err.Error(), b.msg) {
			t.Errorf("ParseBytes(%q) error = %v; want one containing %q", b.in, err, b.msg)
		}
	}
}

func TestBytesStringRoundTrip(t *testing.T) {
	for _, b := range []Bytes{0, 1, 1000, 1024, 3 << 29, 512 << 20, 64 << 30, 5 << 40, 1<<63 - 1, 1 << 62} {
		s := b.String()
		got, err := ParseBytes(s)
		if err != nil || got != b {
			t.Errorf("ParseBytes(%d.String() = %q) = %d, %v", b, s, got, err)
		}
	}
	if s := (64 * GiB).String(); s != "64Gi" {
		t.Errorf("64GiB prints as %q", s)
	}
	if s := Bytes(1536 * MiB).String(); s != "1536Mi" {
		t.Errorf("1.5GiB prints as %q", s)
	}
}

func TestDefaultIsValid(t *testing.T) {
	c := Default()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if got := c.SocketPath(); got != "/var/lib/kvpool/sock/kvpool.sock" {
		t.Errorf("SocketPath = %q", got)
	}
	if got := contract.ContainerSocket; got != "/var/run/kvpool/kvpool.sock" {
		t.Errorf("contract.ContainerSocket = %q", got)
	}
}

func TestParseFullFile(t *testing.T) {
	data, err := os.ReadFile("testdata/full.yaml")
	if err != nil {
		t.Fatal(err)
	}
	c, err := Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	want := Config{
		APIVersion: APIVersion, Kind: Kind, Mode: ModeDRA,
		ResourceName: "example.com/kv", SocketDir: "/run/kvp/sock", KubeletDir: "/data/kubelet", StateDir: "/data/kvpool/state",
		TokenBinding: TokenBindingNone, PodLogsDir: "/data/pod-logs", GPUResources: []string{"example.com/gpu", "example.com/slice-*"},
		RestartInPlace: RestartInPlace{Max: 5, Window: Duration{2 * time.Minute}, Spare: true, SpareAfter: Duration{500 * time.Millisecond}},
		DRA:            DRA{DriverName: "kv.example.com", CDIDir: "/etc/cdi"},
		Sizing: Sizing{PoolBytes: 64 * GiB, Fraction: 0.25, ReserveBytes: 16 * GiB, CgroupHeadroomBytes: GiB,
			Split: SplitMemory, MinPerGPU: 4 * GiB, MaxPerGPU: 32 * GiB, ChunkBytes: 2 * GiB, HugePages: HugePagesRequire},
		Reclaim: Reclaim{GracePeriod: Duration{5 * time.Minute}, Interval: Duration{30 * time.Second}},
		Limits: Limits{MaxConns: 2000, MaxConnsPerUID: 1000, MaxConnsPerPID: 100, ProbeConns: 4,
			HelloTimeout: Duration{2 * time.Second}, OpenTimeout: Duration{10 * time.Second},
			MaxSessions: 500, MaxSessionsPerAllocation: 16, MaxStreamsPerSession: 65536,
			MaxNameBytesPerSession: 8 * MiB, MaxStreams: 200000, MaxNameBytes: 24 * MiB, MaxDevicePages: 1 << 20, MaxDevicePagesTotal: 1 << 25, MaxPages: 1 << 21, MaxClientName: 128},
		Metrics:    Metrics{Address: "127.0.0.1:9000"},
		Health:     Health{Address: ":9001"},
		Log:        Log{Level: "debug", Format: "json"},
		Standalone: Standalone{Tokens: []string{"a", "b"}, GPUs: 4, PoolBytes: GiB},
	}
	if !reflect.DeepEqual(*c, want) {
		t.Errorf("Parse(full.yaml) =\n%+v\nwant\n%+v", *c, want)
	}
	// Marshal writes what Parse reads back.
	out, err := Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	c2, err := Parse(out)
	if err != nil {
		t.Fatalf("Parse(Marshal) failed: %v\n%s", err, out)
	}
	if !reflect.DeepEqual(c, c2) {
		t.Errorf("round trip changed the config:\n%s", out)
	}
}

func TestParseMinimalKeepsDefaults(t *testing.T) {
	c, err := Parse([]byte("apiVersion: config.kvpool.io/v1alpha1\nkind: AgentConfig\nsizing:\n  poolBytes: 68719476736\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := Default()
	want.Sizing.PoolBytes = 64 * GiB
	if !reflect.DeepEqual(*c, want) {
		t.Errorf("got %+v, want defaults with poolBytes 64Gi", *c)
	}
}

const head = "apiVersion: config.kvpool.io/v1alpha1\nkind: AgentConfig\n"

func TestParseErrors(t *testing.T) {
	cases := []struct {
		name, yaml, want string
	}{
		{"empty", "", "file is empty"},
		{"not a mapping", "- a\n- b\n", "not a YAML mapping"},
		{"no apiVersion", "kind: AgentConfig\n", `apiVersion is "", want "config.kvpool.io/v1alpha1"`},
		{"wrong apiVersion", "apiVersion: kvpool.io/v2\nkind: AgentConfig\n", `apiVersion is "kvpool.io/v2"`},
		{"wrong kind", "apiVersion: config.kvpool.io/v1alpha1\nkind: Pod\n", `kind is "Pod", want "AgentConfig"`},
		{"unknown field", head + "poolSize: 3\n", `unknown field "poolSize"`},
		{"wrong case", head + "SocketDir: /x\n", `unknown field "SocketDir"`},
		{"unknown nested field", head + "sizing:\n  poolbytes: 3Gi\n", `unknown field "sizing.poolbytes"`},
		{"duplicate field", head + "socketDir: /a\nsocketDir: /b\n", "already set"},
		{"bad quantity", head + "sizing:\n  poolBytes: 64GB\n", `unknown suffix "GB"`},
		{"negative quantity", head + "sizing:\n  reserveBytes: -1\n", "non-negative"},
		{"null quantity", head + "sizing:\n  chunkBytes: null\n", "null"},
		{"bad duration", head + "reclaim:\n  gracePeriod: 2 minutes\n", `duration "2 minutes"`},
		{"numeric duration", head + "reclaim:\n  interval: 10\n", "duration must be a string"},
		{"negative duration", head + "reclaim:\n  gracePeriod: -1s\n", "negative"},
		{"wrong type", head + "standalone:\n  gpus: two\n", "standalone.gpus"},
		{"fraction zero", head + "sizing:\n  fraction: 0\n", "sizing.fraction: Invalid value: 0: must be in (0, 1]"},
		{"fraction above one", head + "sizing:\n  fraction: 1.5\n", "sizing.fraction: Invalid value: 1.5: must be in (0, 1]"},
		{"split", head + "sizing:\n  split: numa\n", `sizing.split: Unsupported value: "numa": supported values: "equal", "memory"`},
		{"huge pages", head + "sizing:\n  hugePages: always\n", `sizing.hugePages: Unsupported value: "always"`},
		{"min above max", head + "sizing:\n  minPerGPU: 8Gi\n  maxPerGPU: 4Gi\n", `sizing.minPerGPU: Invalid value: "8Gi": must not be more than sizing.maxPerGPU 4Gi`},
		{"chunk too small", head + "sizing:\n  chunkBytes: 1Mi\n", `sizing.chunkBytes: Invalid value: "1Mi": must be 2Mi to 64Gi`},
		{"chunk too big", head + "sizing:\n  chunkBytes: 128Gi\n", `sizing.chunkBytes: Invalid value: "128Gi"`},
		{"chunk not 2Mi multiple", head + "sizing:\n  chunkBytes: 3Mi\n", `sizing.chunkBytes: Invalid value: "3Mi": must be a multiple of 2Mi`},
		{"pool below a chunk", head + "sizing:\n  poolBytes: 512Mi\n", `sizing.poolBytes: Invalid value: "512Mi": is less than one chunk`},
		{"relative socketDir", head + "socketDir: run/kvpool\n", `socketDir: Invalid value: "run/kvpool": must be an absolute path`},
		{"relative stateDir", head + "stateDir: state\n", `stateDir: Invalid value: "state": must be an absolute path`},
		{"empty kubeletDir", head + "kubeletDir: \"\"\n", `kubeletDir: Invalid value: "": must be an absolute path`},
		{"state is socket dir", head + "socketDir: /var/lib/kvpool\nstateDir: /var/lib/kvpool/\n", `stateDir: Invalid value: "/var/lib/kvpool/": is also the socket directory`},
		{"state inside socket dir", head + "socketDir: /var/lib/kvpool\nstateDir: /var/lib/kvpool/state\n", `stateDir: Invalid value: "/var/lib/kvpool/state": is inside the socket directory "/var/lib/kvpool", which pods mount`},
		{"state inside socket dir, unclean", head + "socketDir: /run/kv\nstateDir: /run/x/../kv/./s\n", "is inside the socket directory"},
		{"socket dir inside state", head + "socketDir: /var/lib/kvpool/state/sock\nstateDir: /var/lib/kvpool/state\n", `contains the socket directory`},
		{"keeper socket in socket dir", head + "socketDir: /var/lib/kvpool/sock\nkeeperSocket: /var/lib/kvpool/sock/keeper.sock\n", `keeperSocket: Invalid value: "/var/lib/kvpool/sock/keeper.sock": is inside the socket directory "/var/lib/kvpool/sock", which pods mount`},
		{"keeper socket below socket dir, unclean", head + "socketDir: /run/kv\nkeeperSocket: /run/x/../kv/k/./keeper.sock\n", "is inside the socket directory"},
		{"token binding", head + "tokenBinding: uid\n", `tokenBinding: Unsupported value: "uid": supported values: "pod", "none"`},
		{"gpu resource without domain", head + "gpuResources: [gpu]\n", `gpuResources[0]: Invalid value: "gpu": an extended resource name`},
		{"gpu resource star inside", head + "gpuResources: [nvidia.com/gpu, \"nvidia.com/m*g\"]\n", `gpuResources[1]: Invalid value: "nvidia.com/m*g"`},
		{"gpu resource only a star", head + "gpuResources: [\"*\"]\n", `gpuResources[0]: Invalid value: "*"`},
		{"relative podLogsDir", head + "podLogsDir: logs\n", `podLogsDir: Invalid value: "logs": must be an absolute path`},
		{"unknown mode", head + "mode: both\n", `mode: Unsupported value: "both": supported values: "devicePlugin", "dra"`},
		{"mode in the wrong case", head + "mode: DRA\n", `mode: Unsupported value: "DRA"`},
		{"driver name not a DNS subdomain", head + "dra:\n  driverName: Kv_Pool\n", `dra.driverName: Invalid value: "Kv_Pool": a lowercase RFC 1123 subdomain`},
		{"driver name too long", head + "dra:\n  driverName: " + strings.Repeat("a", 61) + ".io\n", "dra.driverName: Invalid value: \"" + strings.Repeat("a", 61) + ".io\": must be at most 63 characters"},
		{"relative cdiDir", head + "dra:\n  cdiDir: cdi\n", `dra.cdiDir: Invalid value: "cdi": must be an absolute path`},
		{"negative pollAfterReply", head + "pollAfterReply: -1ms\n", `duration "-1ms" is negative`},
		{"long pollAfterReply", head + "pollAfterReply: 2ms\n", `pollAfterReply: Invalid value: "2ms": must be between 0s and 1ms`},
		{"negative restarts in place", head + "restartInPlace:\n  max: -1\n", `restartInPlace.max: Invalid value: -1: must be between 0 (off) and 100`},
		{"too many restarts in place", head + "restartInPlace:\n  max: 101\n", `restartInPlace.max: Invalid value: 101`},
		{"spare not a bool", head + "restartInPlace:\n  spare: maybe\n", `spare`},
		{"readAhead not a bool", head + "restartInPlace:\n  readAhead: 1\n", `readAhead`},
		{"negative spareMemory", head + "restartInPlace:\n  spareMemory: -1Mi\n", `quantity "-1Mi": want a non-negative number`},
		{"spareMemory not a size", head + "restartInPlace:\n  spareMemory: lots\n", `quantity "lots"`},
		{"long spareAfter", head + "restartInPlace:\n  spareAfter: 2h\n", `restartInPlace.spareAfter: Invalid value: "2h0m0s": must be between 0s and 1h`},
		{"zero restart window", head + "restartInPlace:\n  window: 0s\n", `restartInPlace.window: Invalid value: "0s": must be a positive duration`},
		{"restart window not a duration", head + "restartInPlace:\n  window: ten\n", `duration "ten": want a value such as 2m`},
		{"long socketDir", head + "socketDir: /" + strings.Repeat("d", 100) + "\n", "longer than a Unix socket address allows"},
		{"resource no slash", head + "resourceName: hostkv\n", "is not of the form domain/name"},
		{"resource empty", head + "resourceName: \"\"\n", "resourceName: Required value"},
		{"resource unqualified", head + "resourceName: kvpool/kv\n", "not fully qualified"},
		{"resource kubernetes.io", head + "resourceName: kubernetes.io/kv\n", "reserved for Kubernetes"},
		{"resource bad name", head + "resourceName: kvpool.io/-kv\n", `name "-kv"`},
		{"resource upper domain", head + "resourceName: KVPool.io/kv\n", "not a DNS subdomain"},
		{"metrics address", head + "metrics:\n  address: 9464\n", `metrics.address: Invalid value: "9464": must be host:port`},
		{"health port", head + "health:\n  address: \":http\"\n", `health.address: Invalid value: ":http": port "http" must be a number`},
		{"health port range", head + "health:\n  address: \":70000\"\n", "port \"70000\""},
		{"log level", head + "log:\n  level: verbose\n", `log.level: Unsupported value: "verbose"`},
		{"log format", head + "log:\n  format: logfmt\n", `log.format: Unsupported value: "logfmt"`},
		{"no tokens", head + "standalone:\n  tokens: []\n", "standalone.tokens: Required value: at least one token"},
		{"empty token", head + "standalone:\n  tokens: [a, \"\"]\n", "standalone.tokens[1]: Required value: a token must not be empty"},
		{"token with space", head + "standalone:\n  tokens: [\"a b\"]\n", "standalone.tokens[0]: Invalid value: \"a b\": must not contain a comma or whitespace"},
		{"duplicate token", head + "standalone:\n  tokens: [a, a]\n", `standalone.tokens[1]: Duplicate value: "a"`},
		{"zero gpus", head + "standalone:\n  gpus: 0\n", "standalone.gpus: Invalid value: 0: must be 1 to 64"},
		{"too many gpus", head + "standalone:\n  gpus: 65\n", "standalone.gpus: Invalid value: 65"},
		{"zero standalone pool", head + "standalone:\n  poolBytes: 0\n", `standalone.poolBytes: Invalid value: "0"`},
		{"zero interval", head + "reclaim:\n  interval: 0s\n", `reclaim.interval: Invalid value: "0s": must be a positive duration`},
		{"zero conns", head + "limits:\n  maxConns: 0\n", "limits.maxConns: Invalid value: 0: must be a positive count"},
		{"per-uid over total", head + "limits:\n  maxConns: 10\n  maxConnsPerUID: 11\n  maxConnsPerPID: 5\n", "limits.maxConnsPerUID: Invalid value: 11: must not be more than limits.maxConns 10"},
		{"per-pid over per-uid", head + "limits:\n  maxConnsPerPID: 600\n", "limits.maxConnsPerPID: Invalid value: 600: must not be more than limits.maxConnsPerUID 512"},
		{"per-allocation over total", head + "limits:\n  maxSessionsPerAllocation: 2000\n", "limits.maxSessionsPerAllocation: Invalid value: 2000: must not be more than limits.maxSessions 1024"},
		{"open before hello", head + "limits:\n  helloTimeout: 20s\n", `limits.openTimeout: Invalid value: "15s": must not be less than limits.helloTimeout 20s`},
		{"zero hello", head + "limits:\n  helloTimeout: 0s\n", `limits.helloTimeout: Invalid value: "0s"`},
		{"tiny name budget", head + "limits:\n  maxNameBytesPerSession: 1Ki\n", `limits.maxNameBytesPerSession: Invalid value: "1Ki": must be at least 2Ki`},
		{"huge device pages", head + "limits:\n  maxDevicePages: 2147483647\n", "limits.maxDevicePages: Invalid value: 2147483647: must be 1 to 134217728"},
		{"device pages total below a layout's", head + "limits:\n  maxDevicePagesTotal: 1000\n", "limits.maxDevicePagesTotal: Invalid value: 1000: must not be less than limits.maxDevicePages 16777216"},
		{"negative max pages", head + "limits:\n  maxPages: -1\n", "limits.maxPages: Invalid value: -1: must be 0 (the pool's bytes / 4Ki) to 68719476736"},
		{"huge max pages", head + "limits:\n  maxPages: 68719476737\n", "limits.maxPages: Invalid value: 68719476737: must be 0"},
		{"streams below a session's", head + "limits:\n  maxStreams: 1000\n", "limits.maxStreams: Invalid value: 1000: must not be less than limits.maxStreamsPerSession 131072"},
		{"name bytes below a session's", head + "limits:\n  maxNameBytes: 1Mi\n", `limits.maxNameBytes: Invalid value: "1Mi": must not be less than limits.maxNameBytesPerSession 16Mi`},
		{"long client name", head + "limits:\n  maxClientName: 4096\n", "limits.maxClientName: Invalid value: 4096: must be 16 to 2048"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := Parse([]byte(c.yaml))
			if err == nil {
				t.Fatalf("Parse accepted it: %+v", got)
			}
			if got != nil {
				t.Errorf("Parse returned a config with the error")
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %q does not contain %q", err, c.want)
			}
		})
	}
}

func TestValidateReportsEveryField(t *testing.T) {
	c := Default()
	c.Sizing.Fraction = 2
	c.Log.Level = "loud"
	c.Standalone.GPUs = -1
	err := c.Validate()
	var agg utilerrors.Aggregate
	if !errors.As(err, &agg) {
		t.Fatalf("Validate() = %v (%T), want a utilerrors.Aggregate", err, err)
	}
	var fields []string
	for _, e := range agg.Errors() {
		var fe *field.Error
		if !errors.As(e, &fe) {
			t.Fatalf("%v is not a *field.Error", e)
		}
		fields = append(fields, fe.Field)
	}
	if want := []string{"sizing.fraction", "log.level", "standalone.gpus"}; !reflect.DeepEqual(fields, want) {
		t.Errorf("fields %v, want %v", fields, want)
	}
	if got := len(c.ValidateFields()); got != 3 {
		t.Errorf("ValidateFields gave %d errors, want 3", got)
	}
	if n := strings.Count(err.Error(), "\n"); n != 2 {
		t.Errorf("error %q is not one field a line", err)
	}
	d := Default()
	if err := d.Validate(); err != nil {
		t.Errorf("Default().Validate() = %v", err)
	}
}

// TestParseReportsAllBadFields: one file with several bad fields gets one
// error naming every one of them with its path, not just the first.
func TestParseReportsAllBadFields(t *testing.T) {
	cases := []struct {
		name, yaml string
		want       []string
	}{
		{"sizing and log", head + "sizing:\n  fraction: 1.5\n  split: numa\nlog:\n  level: loud\n", []string{
			"sizing.fraction: Invalid value: 1.5: must be in (0, 1]",
			`sizing.split: Unsupported value: "numa": supported values: "equal", "memory"`,
			`log.level: Unsupported value: "loud": supported values: "debug", "info", "warn", "error"`,
		}},
		{"paths, limits and tokens", head + "socketDir: sock\nkubeletDir: kubelet\nlimits:\n  maxStreamsPerSession: 0\n  maxClientName: 8\nstandalone:\n  tokens: [a, a, \"\"]\n  gpus: 99\n", []string{
			`socketDir: Invalid value: "sock": must be an absolute path`,
			`kubeletDir: Invalid value: "kubelet": must be an absolute path`,
			"limits.maxStreamsPerSession: Invalid value: 0: must be a positive count",
			"limits.maxClientName: Invalid value: 8: must be 16 to 2048",
			`standalone.tokens[1]: Duplicate value: "a"`,
			"standalone.tokens[2]: Required value: a token must not be empty",
			"standalone.gpus: Invalid value: 99: must be 1 to 64",
		}},
		{"durations and addresses", head + "reclaim:\n  interval: 0s\nmetrics:\n  address: nope\nhealth:\n  address: \":99999\"\n", []string{
			`reclaim.interval: Invalid value: "0s": must be a positive duration such as 10s`,
			`metrics.address: Invalid value: "nope": must be host:port (e.g. :9464)`,
			`health.address: Invalid value: ":99999": port "99999" must be a number from 0 to 65535`,
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := Parse([]byte(c.yaml))
			if err == nil {
				t.Fatalf("Parse accepted it: %+v", got)
			}
			lines := strings.Split(strings.TrimPrefix(err.Error(), "config: "), "\n")
			if !reflect.DeepEqual(lines, c.want) {
				t.Errorf("errors\n%s\nwant\n%s", strings.Join(lines, "\n"), strings.Join(c.want, "\n"))
			}
		})
	}
}

// TestLegacyAPIVersion: a file written for the AgentConfig's old group
// still loads, to the same values, with a deprecation warning; the new
// group has none.
func TestLegacyAPIVersion(t *testing.T) {
	body := "kind: AgentConfig\nsizing:\n  split: memory\n"
	cur, err := Parse([]byte("apiVersion: " + APIVersion + "\n" + body))
	if err != nil {
		t.Fatal(err)
	}
	if w := cur.Warnings(); w != nil {
		t.Errorf("current apiVersion: warnings %q, want none", w)
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "agent.yaml")
	if err := os.WriteFile(path, []byte("apiVersion: "+LegacyAPIVersion+"\n"+body), 0o600); err != nil {
		t.Fatal(err)
	}
	old, src, err := Load(path, nil, nil)
	if err != nil {
		t.Fatalf("Load of a legacy file: %v", err)
	}
	w := old.Warnings()
	if len(w) != 1 || !strings.Contains(w[0], "deprecated") || !strings.Contains(w[0], APIVersion) {
		t.Errorf("legacy apiVersion: warnings %q, want one naming %s as the replacement", w, APIVersion)
	}
	if src.Of("sizing.split") != FromFile {
		t.Errorf("sources %v", src)
	}
	old.APIVersion = APIVersion
	if !reflect.DeepEqual(old, cur) {
		t.Errorf("legacy file loaded to\n%+v\nwant\n%+v", *old, *cur)
	}
}

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func flags(t *testing.T, args ...string) *flag.FlagSet {
	t.Helper()
	fs := flag.NewFlagSet("agent", flag.ContinueOnError)
	RegisterFlags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	return fs
}

func writeFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "agent.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestLoadPrecedence(t *testing.T) {
	file := writeFile(t, head+"sizing:\n  poolBytes: 64Gi\n  split: memory\n  chunkBytes: 2Gi\nlog:\n  level: debug\n  format: json\n")
	e := env(map[string]string{
		"KVPOOL_SPLIT":             "equal", // env over file
		"KVPOOL_LOG_LEVEL":         "warn",  // env over file, flag over env
		"KVPOOL_RESERVE_BYTES":     "4Gi",   // env over default
		"KVPOOL_STANDALONE_TOKENS": "x, y",
		"KVPOOL_UNRELATED":         "ignored",
	})
	fs := flags(t, "--config", file, "--log-level", "error", "--max-per-gpu=16Gi", "--reclaim-interval", "1m")
	c, src, err := Load("", e, fs)
	if err != nil {
		t.Fatal(err)
	}
	// Where each value came from: the strongest source that set it.
	for field, from := range map[string]Source{
		"sizing.poolBytes":    FromFile,
		"sizing.chunkBytes":   FromFile,
		"log.format":          FromFile,
		"sizing.split":        FromEnv,
		"sizing.reserveBytes": FromEnv,
		"standalone.tokens":   FromEnv,
		"log.level":           FromFlag,
		"sizing.maxPerGPU":    FromFlag,
		"reclaim.interval":    FromFlag,
		"sizing.fraction":     FromDefault,
		"socketDir":           FromDefault,
		"metrics.address":     FromDefault,
	} {
		if got := src.Of(field); got != from {
			t.Errorf("%s came from %s, want %s", field, got, from)
		}
		if src.Explicit(field) != (from != FromDefault) {
			t.Errorf("%s: Explicit = %v, source %s", field, src.Explicit(field), from)
		}
	}
	if got, want := (Sources{"sizing.split": FromEnv, "log.level": FromFlag, "sizing": FromFile}).String(), "log.level=flag,sizing=file,sizing.split=env"; got != want {
		t.Errorf("Sources.String = %q, want %q", got, want)
	}
	// Besides those: apiVersion, kind and the sections sizing and log
	// of the file.
	if len(src) != 13 || src["apiVersion"] != FromFile || src["log"] != FromFile {
		t.Errorf("sources %v: want the 9 fields set, the file's apiVersion and kind and its sections", src)
	}
	want := Default()
	want.Sizing.PoolBytes = 64 * GiB   // file
	want.Sizing.ChunkBytes = 2 * GiB   // file
	want.Log.Format = "json"           // file
	want.Sizing.Split = SplitEqual     // env over file
	want.Sizing.ReserveBytes = 4 * GiB // env
	want.Standalone.Tokens = []string{"x", "y"}
	want.Log.Level = "error"         // flag over env over file
	want.Sizing.MaxPerGPU = 16 * GiB // flag
	want.Reclaim.Interval = Duration{time.Minute}
	if !reflect.DeepEqual(*c, want) {
		t.Errorf("Load =\n%+v\nwant\n%+v", *c, want)
	}
}

func TestLoadFindsFile(t *testing.T) {
	a := writeFile(t, head+"sizing:\n  split: memory\n")
	b := writeFile(t, head+"log:\n  format: json\n")
	// Explicit path beats --config beats KVPOOL_CONFIG.
	for _, c := range []struct {
		name  string
		path  string
		env   map[string]string
		args  []string
		split string
		fmt   string
	}{
		{"none", "", nil, nil, "equal", "text"},
		{"env", "", map[string]string{"KVPOOL_CONFIG": a}, nil, "memory", "text"},
		{"flag over env", "", map[string]string{"KVPOOL_CONFIG": a}, []string{"--config=" + b}, "equal", "json"},
		{"path over flag", a, nil, []string{"--config=" + b}, "memory", "text"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, _, err := Load(c.path, env(c.env), flags(t, c.args...))
			if err != nil {
				t.Fatal(err)
			}
			if got.Sizing.Split != c.split || got.Log.Format != c.fmt {
				t.Errorf("split %q format %q, want %q %q", got.Sizing.Split, got.Log.Format, c.split, c.fmt)
			}
		})
	}
	// Nil env and nil flags: defaults.
	got, src, err := Load("", nil, nil)
	if err != nil || !reflect.DeepEqual(*got, Default()) || len(src) != 0 {
		t.Errorf("Load with no sources = %+v, %v, %v", got, src, err)
	}
}

func TestLoadErrors(t *testing.T) {
	good := writeFile(t, head)
	bad := writeFile(t, head+"sizing:\n  split: numa\n")
	cases := []struct {
		name string
		path string
		env  map[string]string
		args []string
		want string
	}{
		{"missing file", filepath.Join(t.TempDir(), "nope.yaml"), nil, nil, "no such file"},
		{"bad file names path and field", bad, nil, nil, "file " + bad + ", environment and flags):\nsizing.split"},
		{"env quantity", good, map[string]string{"KVPOOL_POOL_BYTES": "lots"}, nil, "environment KVPOOL_POOL_BYTES (sizing.poolBytes): quantity \"lots\""},
		{"env fraction", good, map[string]string{"KVPOOL_POOL_FRACTION": "half"}, nil, "environment KVPOOL_POOL_FRACTION (sizing.fraction): \"half\" is not a number"},
		{"env gpus", good, map[string]string{"KVPOOL_STANDALONE_GPUS": "2.5"}, nil, "KVPOOL_STANDALONE_GPUS (standalone.gpus)"},
		{"env invalid value", good, map[string]string{"KVPOOL_LOG_FORMAT": "xml"}, nil, `log.format: Unsupported value: "xml"`},
		{"env duration", good, map[string]string{"KVPOOL_RECLAIM_GRACE_PERIOD": "soon"}, nil, "KVPOOL_RECLAIM_GRACE_PERIOD (reclaim.gracePeriod)"},
		{"flag quantity", good, nil, []string{"--chunk-bytes=1GB"}, "flag --chunk-bytes (sizing.chunkBytes): quantity \"1GB\""},
		{"flag invalid value", good, nil, []string{"--split=numa"}, "sizing.split"},
		{"flag empty token", good, nil, []string{"--standalone-tokens=a,,b"}, "standalone.tokens[1]: Required value: a token must not be empty"},
		{"flag bad over good env", good, map[string]string{"KVPOOL_HUGE_PAGES": "never"}, []string{"--huge-pages=sometimes"}, `sizing.hugePages: Unsupported value: "sometimes"`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, src, err := Load(c.path, env(c.env), flags(t, c.args...))
			if err == nil {
				t.Fatalf("Load accepted it: %+v", got)
			}
			if got != nil || src != nil {
				t.Error("Load returned a config or sources with the error")
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %q does not contain %q", err, c.want)
			}
		})
	}
}

func TestRegisterFlagsCoversEveryField(t *testing.T) {
	// Every leaf field of Config but apiVersion and kind has exactly one
	// setting, so no field is out of reach of flags and the environment.
	var leaves []string
	var walk func(reflect.Type, string)
	walk = func(rt reflect.Type, prefix string) {
		for i := 0; i < rt.NumField(); i++ {
			f := rt.Field(i)
			name := prefix + strings.Split(f.Tag.Get("json"), ",")[0]
			if f.Type.Kind() == reflect.Struct && f.Type != reflect.TypeOf(Duration{}) {
				walk(f.Type, name+".")
				continue
			}
			leaves = append(leaves, name)
		}
	}
	walk(reflect.TypeOf(Config{}), "")
	have := map[string]bool{}
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	RegisterFlags(fs)
	for _, s := range settings {
		have[s.field] = true
		if fs.Lookup(s.flag) == nil {
			t.Errorf("no flag --%s", s.flag)
		}
		if !strings.HasPrefix(s.env, "KVPOOL_") || s.env == contract.EnvSocket || s.env == contract.EnvToken {
			t.Errorf("setting %s has env %s", s.field, s.env)
		}
	}
	for _, l := range leaves {
		if l != "apiVersion" && l != "kind" && !have[l] {
			t.Errorf("field %s has no flag or environment variable", l)
		}
	}
	// Flag defaults print the built-in defaults.
	if got := fs.Lookup("chunk-bytes").DefValue; got != "1Gi" {
		t.Errorf("--chunk-bytes default %q", got)
	}
}

// TestSampleConfig keeps config/agent.yaml, the documented sample,
// equal to the built-in defaults.
func TestSampleConfig(t *testing.T) {
	data, err := os.ReadFile("../../config/agent.yaml")
	if err != nil {
		t.Fatal(err)
	}
	c, err := Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(*c, Default()) {
		t.Errorf("sample differs from Default():\n%+v\n%+v", *c, Default())
	}
}

// TestDocsListEverySetting keeps docs/sizing.md's table in step with the
// flags and environment variables.
func TestDocsListEverySetting(t *testing.T) {
	data, err := os.ReadFile("../../docs/sizing.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(data)
	for _, s := range settings {
		row := "| `" + s.field + "` | `--" + s.flag + "` | `" + s.env + "` |"
		if !strings.Contains(doc, row) {
			t.Errorf("docs/sizing.md lacks the row for %s: %s", s.field, row)
		}
	}
}

func TestCheckDirs(t *testing.T) {
	for _, c := range []struct {
		sock, state string
		ok          bool
	}{
		{"/var/lib/kvpool/sock", "/var/lib/kvpool/state", true},
		{"/run/kvpool", "/run/kvpool-state", true}, // a shared prefix is not nesting
		{"/run/kvpool-state", "/run/kvpool", true},
		{"/run/kvpool", "/run/..kvpool", true},
		{"/", "/x", false},
		{"/x", "/", false},
		{"/run/kvpool", "/run/kvpool", false},
		{"/run/kvpool/", "/run//kvpool", false},
		{"/run/kvpool", "/run/kvpool/a/b", false},
		{"/run/kvpool/a/b", "/run/kvpool", false},
	} {
		err := CheckDirs(c.sock, c.state)
		if (err == nil) != c.ok {
			t.Errorf("CheckDirs(%q, %q) = %v, want ok %v", c.sock, c.state, err, c.ok)
		}
	}
}

// TestLoadReportsBadFieldsFromEverySource: bad values from the file, the
// environment and a flag are reported together, each by its field path.
func TestLoadReportsBadFieldsFromEverySource(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.yaml")
	if err := os.WriteFile(path, []byte(head+"sizing:\n  fraction: 0\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	got, src, err := Load(path, env(map[string]string{"KVPOOL_LOG_FORMAT": "xml"}), flags(t, "--standalone-gpus=0"))
	if err == nil || got != nil || src != nil {
		t.Fatalf("Load = %v, %v, %v; want only an error", got, src, err)
	}
	want := "config: invalid configuration (file " + path + ", environment and flags):\n" +
		"sizing.fraction: Invalid value: 0: must be in (0, 1]\n" +
		`log.format: Unsupported value: "xml": supported values: "text", "json"` + "\n" +
		"standalone.gpus: Invalid value: 0: must be 1 to 64"
	if err.Error() != want {
		t.Errorf("error\n%s\nwant\n%s", err, want)
	}
}

// Where apimachinery's parser and ParseBytes both accept a quantity, they
// read the same number of bytes: a size means here what it means in a pod
// spec.
func TestParseBytesAgreesWithQuantity(t *testing.T) {
	for _, s := range []string{"0", "1", "4096", "1Ki", "512Mi", "64Gi", "2Ti", "3Pi", "1.5Gi", "0.5Ki", "1k", "2M", "3G", "1T", "5P", "1E", "9223372036854775807"} {
		got, err := ParseBytes(s)
		if err != nil {
			t.Errorf("ParseBytes(%q): %v", s, err)
			continue
		}
		q, err := resource.ParseQuantity(s)
		if err != nil {
			t.Fatalf("resource.ParseQuantity(%q): %v", s, err)
		}
		if want := q.Value(); int64(got) != want {
			t.Errorf("ParseBytes(%q) = %d, resource.Quantity says %d", s, got, want)
		}
	}
}
