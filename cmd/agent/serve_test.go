package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/sizing"
	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/plugin/kubelettest"
	"github.com/kvpool/kvpool/pkg/standalone"
	"github.com/kvpool/kvpool/pkg/wire"
)

// logBuf collects a child agent's JSON log lines.
type logBuf struct {
	mu    sync.Mutex
	lines []map[string]any
	raw   bytes.Buffer
}

func (b *logBuf) read(r io.Reader) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var m map[string]any
		b.mu.Lock()
		b.raw.Write(sc.Bytes())
		b.raw.WriteByte('\n')
		if json.Unmarshal(sc.Bytes(), &m) == nil {
			b.lines = append(b.lines, m)
		}
		b.mu.Unlock()
	}
}

// find returns the first record with msg (and every key=value of want).
func (b *logBuf) find(msg string, want map[string]any) map[string]any {
	b.mu.Lock()
	defer b.mu.Unlock()
next:
	for _, l := range b.lines {
		if l["msg"] != msg {
			continue
		}
		for k, v := range want {
			if l[k] != v {
				continue next
			}
		}
		return l
	}
	return nil
}

func (b *logBuf) all(msg string) []map[string]any {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []map[string]any
	for _, l := range b.lines {
		if l["msg"] == msg {
			out = append(out, l)
		}
	}
	return out
}

func (b *logBuf) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.raw.String()
}

// wait polls find until it matches or 20s pass.
func (b *logBuf) wait(t *testing.T, msg string, want map[string]any) map[string]any {
	t.Helper()
	for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if l := b.find(msg, want); l != nil {
			return l
		}
	}
	t.Fatalf("agent never logged %q %v; log:\n%s", msg, want, b.String())
	return nil
}

type child struct {
	cmd  *exec.Cmd
	log  *logBuf
	done chan error
}

// spawnAgent runs the agent (this test binary re-executed) with args and
// env added to a clean environment: no cluster, no config file.
// testNode is a node's directories and its stand-in kubelet: a root
// directory (removed at the test's end), kubelet's directory under it
// with the device-plugin registration and the PodResources sockets served
// by kubelettest, and the agent's socket directory.
type testNode struct {
	root, kubelet, sock string
	k                   *kubelettest.Kubelet
	prs                 *kubelettest.PodResources
}

func newTestNode(t *testing.T) *testNode {
	t.Helper()
	root, err := os.MkdirTemp("", "kvn") // short: the sockets' paths must fit 107 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	n := &testNode{root: root, kubelet: filepath.Join(root, "kubelet"), sock: filepath.Join(root, "sock")}
	for _, d := range []string{"device-plugins", "pod-resources"} {
		if err := os.MkdirAll(filepath.Join(n.kubelet, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	n.k = kubelettest.NewKubelet(t, filepath.Join(n.kubelet, "device-plugins"))
	n.prs = kubelettest.NewPodResources(t, filepath.Join(n.kubelet, "pod-resources", "kubelet.sock"))
	return n
}

func spawnAgent(t *testing.T, env []string, args ...string) *child {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, args...)
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "KVPOOL_") || k == "KUBECONFIG" || k == "KUBERNETES_SERVICE_HOST" || k == "NODE_NAME" {
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	cmd.Env = append(cmd.Env, "KVPOOL_TEST_AGENT=1")
	cmd.Env = append(cmd.Env, env...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, log: &logBuf{}, done: make(chan error, 1)}
	go func() {
		c.log.read(stderr)
		c.done <- cmd.Wait()
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-c.done
		if t.Failed() {
			t.Logf("agent log:\n%s", c.log.String())
		}
	})
	return c
}

// stop sends SIGTERM and wants a clean exit.
func (c *child) stop(t *testing.T) {
	t.Helper()
	c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-c.done:
		c.done <- err // for the cleanup
		if err != nil {
			t.Fatalf("agent exit after SIGTERM: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("agent did not stop within 15s of SIGTERM")
	}
}

// waitReady polls the health server's /readyz until it answers 200.
func waitReady(t *testing.T, c *child) (health, metrics string) {
	t.Helper()
	health = c.log.wait(t, "serving", map[string]any{"server": "health"})["address"].(string)
	if l := c.log.find("serving", map[string]any{"server": "metrics"}); l != nil { // logged before health
		metrics = l["address"].(string)
	}
	var last string
	for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		resp, err := http.Get("http://" + health + "/readyz?verbose")
		if err != nil {
			last = err.Error()
			continue
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == 200 {
			return health, metrics
		}
		last = string(body)
	}
	t.Fatalf("agent never ready; last /readyz:\n%s", last)
	return
}

var kvclientOnce struct {
	sync.Once
	path string
	err  error
}

// kvclientBin builds cmd/kvclient once per test binary.
func kvclientBin(t *testing.T) string {
	t.Helper()
	kvclientOnce.Do(func() {
		dir, err := os.MkdirTemp("", "kvclient")
		if err != nil {
			kvclientOnce.err = err
			return
		}
		kvclientOnce.path = filepath.Join(dir, "kvclient")
		cmd := exec.Command("go", "build", "-o", kvclientOnce.path, "../kvclient")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			kvclientOnce.err = errors.New(string(out))
		}
	})
	if kvclientOnce.err != nil {
		t.Fatalf("building kvclient: %v", kvclientOnce.err)
	}
	return kvclientOnce.path
}

// kvclient runs the real client with exactly the environment a container
// gets (socket path already mapped to the host) and returns its output.
func kvclient(t *testing.T, env []string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(kvclientBin(t), args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	done := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
			cmd.Process.Kill()
		case <-done:
		}
	}()
	out, err := cmd.CombinedOutput()
	close(done)
	return string(out), err
}

// Cluster mode without a GPU library: simulated GPUs through
// --simulate-gpus, registration with the test kubelet, Allocate, and the
// real kvclient using exactly the KVPOOL_SOCKET (mapped to the host) and
// KVPOOL_TOKEN Allocate returned; a wrong token is refused.
func TestClusterModeAllocateAndClient(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	n := newTestNode(t)
	root, kdir, sockDir, k := n.root, n.kubelet, n.sock, n.k

	a := spawnAgent(t, []string{"NODE_NAME=node-a", "KVPOOL_LOG_FORMAT=json"},
		"--simulate-gpus", "2", "--kubelet-dir", kdir, "--socket-dir", sockDir, "--state-dir", filepath.Join(root, "state"),
		"--pool-bytes", "256Mi", "--chunk-bytes", "32Mi", "--reserve-bytes", "64Mi", "--huge-pages", "never",
		"--metrics-address", "127.0.0.1:0", "--health-address", "127.0.0.1:0",
		"--reclaim-interval", "100ms", "--reclaim-grace-period", "1h", "--token-binding", "none")
	reg := k.WaitRegister(20 * time.Second)
	if reg.ResourceName != contract.DefaultResourceName {
		t.Errorf("registered %q", reg.ResourceName)
	}
	k.WaitList(func(l []*pluginapi.Device) bool {
		for _, d := range l {
			if d.Health != pluginapi.Healthy {
				return false
			}
		}
		return len(l) == 8
	})
	_, metricsAddr := waitReady(t, a)
	if a.log.find("pool plan", map[string]any{"mode": "cluster", "chunks": float64(8), "chunk": "32Mi"}) == nil {
		t.Errorf("no cluster-mode plan of 8 chunks of 32Mi logged")
	}
	if l := a.log.find("no API server: not in a pod and no --kubeconfig or $KUBECONFIG; sizing without the Node's allocatable memory, no KVPoolNode status, no Node events", nil); l == nil {
		t.Error("no log line saying the API server parts are off")
	}

	var ids []string
	for _, l := range a.log.all("pool plan gpu") {
		if l["gpu"] == float64(1) {
			g := sizing.GPUPlan{GPU: 1, NUMA: int(l["numa"].(float64)), Chunks: int(l["chunks"].(float64))}
			ids = g.ChunkIDs()[:2]
		}
	}
	if len(ids) != 2 {
		t.Fatalf("no plan for GPU 1 in the log")
	}
	resp, err := allocate(t, k, ids...)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Mounts) != 1 {
		t.Fatalf("allocate mounts %v", resp.Mounts)
	}
	m := resp.Mounts[0]
	cSock := resp.Envs[contract.EnvSocket]
	if m.HostPath != sockDir || !strings.HasPrefix(cSock, m.ContainerPath+"/") {
		t.Fatalf("allocate response: mount %v, %s=%s", m, contract.EnvSocket, cSock)
	}
	hostSock := filepath.Join(m.HostPath, strings.TrimPrefix(cSock, m.ContainerPath))
	token := resp.Envs[contract.EnvToken]

	out, err := kvclient(t, []string{"KVPOOL_SOCKET=" + hostSock, "KVPOOL_TOKEN=" + token, "KVCLIENT_GPU=1"}, "-ops", "300", "-max-pages", "64")
	if err != nil {
		t.Fatalf("kvclient with the allocated token: %v\n%s", err, out)
	}
	if !strings.Contains(out, "kvclient result") {
		t.Errorf("kvclient printed no result:\n%s", out)
	}
	out, err = kvclient(t, []string{"KVPOOL_SOCKET=" + hostSock, "KVPOOL_TOKEN=" + contract.NewToken(), "KVCLIENT_GPU=1"}, "-ops", "10")
	if err == nil || !strings.Contains(out, "unauthorized") {
		t.Errorf("kvclient with a wrong token: %v (want exit 1 saying unauthorized)\n%s", err, out)
	}

	// The server reported the requests to the metrics.
	mresp, err := http.Get("http://" + metricsAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	re := regexp.MustCompile(`(?m)^kvpool_server_op_duration_seconds_count\{op="offload"\} ([1-9][0-9]*)$`)
	if !re.Match(body) {
		t.Errorf("metrics count no offloads:\n%s", grepLines(string(body), "op_duration_seconds_count"))
	}
	// kvclient's offloads ran on GPU 1 and its contract check fills the
	// pool once: pages, bytes and the refusal are attributed to that GPU.
	for _, want := range []string{
		`(?m)^kvpool_offloads_total\{gpu="1"\} [1-9]`,
		`(?m)^kvpool_pages_moved_total\{direction="offload",gpu="1"\} [1-9]`,
		`(?m)^kvpool_pages_moved_total\{direction="reload",gpu="1"\} [1-9]`,
		`(?m)^kvpool_client_copied_bytes_total\{direction="offload",gpu="1"\} [1-9]`,
		`(?m)^kvpool_offload_rejects_total\{gpu="1",reason="full"\} [1-9]`,
		// The start's pinning: every GPU's first chunk, a rate per lane.
		`(?m)^kvpool_pool_first_chunk_seconds\{gpu="1"\} [0-9]`,
		`(?m)^kvpool_pool_pin_bytes_per_second\{numa="-?[0-9]+"\} [1-9]`,
	} {
		if !regexp.MustCompile(want).Match(body) {
			t.Errorf("metrics lack %s:\n%s", want, grepLines(string(body), "kvpool_"))
		}
	}

	a.stop(t)
	if _, err := os.Stat(hostSock); !os.IsNotExist(err) {
		t.Errorf("socket left behind after SIGTERM: %v", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(kdir, "device-plugins")); len(ents) != 1 {
		t.Errorf("device-plugins after stop: %v (want only kubelet.sock)", ents)
	}
	if a.log.find("kvpool agent stopped", nil) == nil {
		t.Error("no stop line logged")
	}
}

// Standalone with a config file, environment and flags: flags beat the
// environment, which beats the file, which beats the defaults; the tokens
// from the file work for a real kvclient.
func TestStandaloneConfigPrecedence(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	dir := t.TempDir()
	file := filepath.Join(dir, "agent.yaml")
	os.WriteFile(file, []byte(`apiVersion: config.kvpool.io/v1alpha1
kind: AgentConfig
log:
  format: text
standalone:
  tokens: [file-a, file-b]
  gpus: 4
  poolBytes: 128Mi
`), 0o644)
	sockDir := filepath.Join(dir, "s")
	a := spawnAgent(t, []string{"KVPOOL_CONFIG=" + file, "KVPOOL_STANDALONE_GPUS=3", "KVPOOL_LOG_FORMAT=json"},
		"--standalone", "--standalone-gpus", "2", "--socket-dir", sockDir)
	waitReady(t, a) // JSON logs: the environment's format beat the file's
	// Flag 2 GPUs beat env 3 beat file 4; the file's 128Mi over 2 GPUs of
	// at least 4 chunks each is 16Mi chunks.
	if l := a.log.find("kvpool agent serving", map[string]any{"mode": "standalone", "gpus": float64(2), "chunks": float64(8), "chunk": "16Mi"}); l == nil {
		t.Errorf("agent did not serve 2 GPUs x 4 chunks of 16Mi")
	}
	sock := filepath.Join(sockDir, contract.SocketFile)
	if a.log.find("kvpool agent serving", map[string]any{"socket": sock}) == nil {
		t.Errorf("socket is not %s", sock)
	}
	if a.log.find("kvpool agent serving", map[string]any{"socketRefusesFiles": wire.CanRefuseFiles()}) == nil {
		t.Errorf("the serving line does not say socketRefusesFiles=%v (this kernel)", wire.CanRefuseFiles())
	}
	try := a.log.wait(t, "standalone tokens granted", nil)["try"].(string)
	if want := "KVPOOL_SOCKET=" + sock + " KVPOOL_TOKEN=file-a go run ./cmd/kvclient"; try != want {
		t.Errorf("try line %q, want %q", try, want)
	}
	for _, tok := range []string{"file-a", "file-b"} {
		l := a.log.find("allocation", map[string]any{"token": tok})
		if l == nil || strings.Count(l["chunks"].(string), ",") != 3 || l["count"] != float64(4) {
			t.Errorf("token %s: %v (want 4 chunks)", tok, l)
		}
	}
	out, err := kvclient(t, []string{"KVPOOL_SOCKET=" + sock, "KVPOOL_TOKEN=file-b", "KVCLIENT_GPU=1"}, "-ops", "100", "-max-pages", "32")
	if err != nil {
		t.Fatalf("kvclient with the file's token: %v\n%s", err, out)
	}
	a.stop(t)
}

// resolveServe: every misuse is an error naming the problem, and the
// standalone defaults differ from the cluster ones only where a field was
// not set.
func TestResolveServe(t *testing.T) {
	flagOutput = io.Discard
	defer func() { flagOutput = os.Stderr }()
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	os.WriteFile(bad, []byte("apiVersion: config.kvpool.io/v1alpha1\nkind: AgentConfig\nsocketDir: relative\n"), 0o644)
	good := filepath.Join(dir, "good.yaml")
	os.WriteFile(good, []byte("apiVersion: config.kvpool.io/v1alpha1\nkind: AgentConfig\nsocketDir: /run/kv\nmetrics:\n  address: 127.0.0.1:9999\n"), 0o644)
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

	for _, c := range []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"unknown flag", []string{"--bogus"}, nil, "flag provided but not defined"},
		{"extra argument", []string{"--standalone", "x"}, nil, `unexpected arguments ["x"]`},
		{"socket in cluster mode", []string{"--socket", "/tmp/a.sock"}, nil, "--socket applies only with --standalone"},
		{"--token is gone", []string{"--standalone", "--token", "t"}, nil, "flag provided but not defined: -token"},
		{"--gpus is gone", []string{"--standalone", "--gpus", "2"}, nil, "flag provided but not defined: -gpus"},
		{"simulated GPUs in standalone mode", []string{"--standalone", "--simulate-gpus", "2"}, nil, "--simulate-gpus applies only in cluster mode; standalone GPUs are standalone.gpus"},
		{"negative simulated GPUs", []string{"--simulate-gpus", "-1"}, nil, "--simulate-gpus -1"},
		{"too many GPUs", []string{"--standalone", "--standalone-gpus", "65"}, nil, "standalone.gpus"},
		{"chunk size out of range", []string{"--standalone", "--chunk-mib", "-4"}, nil, "--chunk-mib -4"},
		{"empty token", []string{"--standalone", "--standalone-tokens", "a,,b"}, nil, "standalone.tokens[1]: Required value: a token must not be empty"},
		{"plugin socket name", []string{"--standalone", "--device-plugin", "--socket", "/tmp/x/other.sock"}, nil, "must be <socketDir>/kvpool.sock"},
		{"missing file", []string{"--config", filepath.Join(dir, "none.yaml")}, nil, "no such file"},
		{"invalid file", []string{"--config", bad}, nil, "socketDir"},
		{"bad environment", nil, map[string]string{"KVPOOL_POOL_BYTES": "lots"}, "KVPOOL_POOL_BYTES"},
		{"bad flag value", []string{"--standalone", "--split", "odd"}, nil, "split"},
		{"state inside socket dir", []string{"--standalone", "--socket", "/run/kq/kvpool.sock", "--state-dir", "/run/kq/state"}, nil, `stateDir: "/run/kq/state" is inside the socket directory "/run/kq"`},
		{"state is socket dir", []string{"--standalone", "--device-plugin", "--socket-dir", "/run/kq", "--state-dir", "/run/kq"}, nil, "is also the socket directory"},
		{"cluster state inside socket dir", []string{"--socket-dir", "/run/kq", "--state-dir", "/run/kq/s"}, nil, "inside the socket directory"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := resolveServe(c.args, env(c.env))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("err %v, want it to mention %q", err, c.want)
			}
		})
	}

	s, err := resolveServe([]string{"--standalone"}, env(nil))
	if err != nil {
		t.Fatal(err)
	}
	if !s.randomToken || s.socket != standalone.DefaultSocket() || s.cfg.Metrics.Address != "127.0.0.1:0" ||
		s.cfg.Health.Address != "127.0.0.1:0" || s.cfg.StateDir != filepath.Dir(standalone.DefaultSocket())+"-state" {
		t.Errorf("standalone defaults: random %v socket %s metrics %s health %s state %s", s.randomToken, s.socket,
			s.cfg.Metrics.Address, s.cfg.Health.Address, s.cfg.StateDir)
	}
	s, err = resolveServe([]string{"--standalone", "--config", good}, env(map[string]string{"KVPOOL_STANDALONE_TOKENS": "a,b"}))
	if err != nil {
		t.Fatal(err)
	}
	if s.randomToken || strings.Join(s.cfg.Standalone.Tokens, ",") != "a,b" || s.socket != "/run/kv/kvpool.sock" ||
		s.cfg.Metrics.Address != "127.0.0.1:9999" || s.cfg.Health.Address != "127.0.0.1:0" {
		t.Errorf("standalone over a file: random %v tokens %v socket %s metrics %s health %s", s.randomToken,
			s.cfg.Standalone.Tokens, s.socket, s.cfg.Metrics.Address, s.cfg.Health.Address)
	}
	s, err = resolveServe([]string{"--standalone", "--socket", "/tmp/q/x.sock", "--standalone-tokens", "t1,t2", "--chunk-mib", "4"}, env(nil))
	if err != nil {
		t.Fatal(err)
	}
	if s.socket != "/tmp/q/x.sock" || s.cfg.SocketDir != "/tmp/q" || strings.Join(s.cfg.Standalone.Tokens, ",") != "t1,t2" ||
		s.flags.chunkMiB != 4 || s.flags.chunksPerGPU != 4 {
		t.Errorf("socket path and fixed layout: socket %s dir %s tokens %v layout %d x %d MiB", s.socket, s.cfg.SocketDir,
			s.cfg.Standalone.Tokens, s.flags.chunksPerGPU, s.flags.chunkMiB)
	}
	s, err = resolveServe([]string{"--standalone", "--pool-bytes", "64Mi", "--chunk-bytes", "8Mi"}, env(nil))
	if err != nil {
		t.Fatal(err)
	}
	if s.cfg.Standalone.PoolBytes != 64*config.MiB {
		t.Errorf("standalone with --pool-bytes 64Mi: pool %v, %v", s.cfg.Standalone.PoolBytes, err)
	}
	s, err = resolveServe([]string{"--standalone", "--pool-bytes", "64Mi", "--chunk-bytes", "8Mi"}, env(map[string]string{"KVPOOL_STANDALONE_POOL_BYTES": "32Mi"}))
	if err != nil {
		t.Fatal(err)
	}
	if s.cfg.Standalone.PoolBytes != 32*config.MiB {
		t.Errorf("standalone.poolBytes beside --pool-bytes: pool %v, %v", s.cfg.Standalone.PoolBytes, err)
	}
	s, err = resolveServe(nil, env(nil))
	if err != nil {
		t.Fatal(err)
	}
	if s.socket != "/var/lib/kvpool/sock/kvpool.sock" || s.cfg.Metrics.Address != ":9464" || s.cfg.Health.Address != ":8081" {
		t.Errorf("cluster defaults: socket %s metrics %s health %s", s.socket, s.cfg.Metrics.Address, s.cfg.Health.Address)
	}
}

// Cluster mode with --kubeconfig against a fake API server: the Node's
// allocatable memory bounds the plan, the finished pool is posted as a
// KVPoolReady Node event, and the KVPoolNode status is written. The server
// serves no discovery: the agent's clients know their paths.
func TestClusterModeWithKubeconfig(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	var mu sync.Mutex
	var seen []string // "METHOD path body"
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		seen = append(seen, r.Method+" "+r.URL.Path+" "+string(body))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		switch {
		case r.Method == "GET" && r.URL.Path == "/api/v1/nodes/node-k":
			io.WriteString(w, `{"kind":"Node","apiVersion":"v1","metadata":{"name":"node-k","uid":"u-1"},
				"status":{"capacity":{"memory":"64Gi"},"allocatable":{"memory":"96Mi"}}}`)
		case r.Method == "POST" || r.Method == "PUT" || r.Method == "PATCH":
			w.WriteHeader(http.StatusCreated)
			w.Write(body)
		default:
			w.WriteHeader(http.StatusNotFound)
			io.WriteString(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}`)
		}
	}))
	defer api.Close()
	root := t.TempDir()
	kubeconfig := filepath.Join(root, "kubeconfig")
	os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: fake, cluster: {server: "`+api.URL+`"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: fake, user: u}}]
current-context: c
`), 0o600)
	n := newTestNode(t)
	k := n.k

	a := spawnAgent(t, []string{"NODE_NAME=node-k", "KVPOOL_LOG_FORMAT=json"},
		"--kubeconfig", kubeconfig, "--simulate-gpus", "2", "--kubelet-dir", n.kubelet,
		"--socket-dir", n.sock, "--state-dir", filepath.Join(n.root, "state"),
		"--pool-bytes", "256Mi", "--chunk-bytes", "32Mi", "--reserve-bytes", "64Mi", "--huge-pages", "never",
		"--metrics-address", "", "--health-address", "127.0.0.1:0")
	k.WaitRegister(20 * time.Second)
	waitReady(t, a)
	// 96Mi allocatable over 2 GPUs: 48Mi each, one 32Mi chunk each.
	if a.log.find("pool plan", map[string]any{"boundBy": "node allocatable memory", "chunks": float64(2)}) == nil {
		t.Errorf("plan not bound by the Node's allocatable memory")
	}
	if a.log.find("server off (empty address)", map[string]any{"server": "metrics"}) == nil {
		t.Errorf("an empty metrics.address did not turn metrics off")
	}
	want := map[string]func(string) bool{
		"KVPoolReady event": func(s string) bool {
			return strings.HasPrefix(s, "POST /api/v1/namespaces/") && strings.Contains(s, "/events ") && strings.Contains(s, "KVPoolReady") && strings.Contains(s, "node-k")
		},
		"KVPoolNode written": func(s string) bool {
			return strings.Contains(s, "/apis/kvpool.io/v1alpha1/kvpoolnodes") && s[0] != 'G'
		},
		"KVPoolNode status written": func(s string) bool {
			return strings.HasPrefix(s, "PUT /apis/kvpool.io/v1alpha1/kvpoolnodes/node-k/status ")
		},
	}
	for end := time.Now().Add(20 * time.Second); len(want) > 0 && time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		mu.Lock()
		for name, ok := range want {
			for _, s := range seen {
				if ok(s) {
					delete(want, name)
					break
				}
			}
		}
		mu.Unlock()
	}
	mu.Lock()
	if len(want) > 0 {
		t.Errorf("the API server never saw %v; it saw:\n%s", want, strings.Join(seen, "\n"))
	}
	for _, s := range seen {
		method, path, _ := strings.Cut(s, " ")
		path, _, _ = strings.Cut(path, " ")
		if method == "GET" && (path == "/api" || path == "/apis" || path == "/api/v1" || strings.HasPrefix(path, "/openapi") ||
			strings.HasPrefix(path, "/apis/") && strings.Count(path, "/") == 3) {
			t.Errorf("the agent asked for discovery: %s", path)
		}
	}
	mu.Unlock()
	a.stop(t)
}
