package plugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/plugin/kubelettest"
	"github.com/kvpool/kvpool/pkg/pool"
)

type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// shortDir is a temporary directory with a short path: Unix socket paths
// are limited to 107 bytes, which t.TempDir() can exceed.
func shortDir(t *testing.T) string {
	d, err := os.MkdirTemp("", "kvp")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

const testGrace = time.Minute

// env is a plugin served over a real Unix socket, registered with a test
// kubelet, with a test PodResources server, a real pool and a fake clock.
type env struct {
	t       *testing.T
	root    string
	pool    *pool.Pool
	feed    *Feed
	clock   *fakeClock
	kubelet *kubelettest.Kubelet
	prs     *kubelettest.PodResources
	p       *Plugin

	mu     sync.Mutex
	zeroed map[string]int
	zeroFn func(id string) error
	hooks  []string // what Reclaimed and ChunkHealth were told, in order
	obs    observe.Recorder
}

func (e *env) hook(format string, args ...any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.hooks = append(e.hooks, fmt.Sprintf(format, args...))
}

func (e *env) hookLog() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.hooks)
}

// testChunks: gpu0 on NUMA 0 and gpu1 on NUMA 1, four chunks each.
func testChunks() []pool.Chunk {
	var out []pool.Chunk
	for g := range 2 {
		for i := range 4 {
			out = append(out, pool.Chunk{ID: contract.ChunkID(g, g, i), GPU: g, NUMA: g, Size: 1 << 20})
		}
	}
	return out
}

func newPool(t *testing.T) *pool.Pool {
	p := pool.New()
	for _, c := range testChunks() {
		if err := p.AddChunk(c); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func newEnv(t *testing.T) *env {
	root := shortDir(t)
	for _, d := range []string{"kubelet/device-plugins", "kubelet/pod-resources", "sock", "state"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	e := &env{
		t:      t,
		root:   root,
		pool:   newPool(t),
		feed:   NewFeed(),
		clock:  &fakeClock{now: time.Date(2026, 11, 29, 8, 0, 0, 0, time.UTC)},
		zeroed: make(map[string]int),
	}
	if err := e.feed.Set(PoolDevices(e.pool.Chunks())); err != nil {
		t.Fatal(err)
	}
	e.prs = kubelettest.NewPodResources(t, filepath.Join(root, "kubelet/pod-resources/kubelet.sock"))
	e.kubelet = kubelettest.NewKubelet(t, filepath.Join(root, "kubelet/device-plugins"))
	e.p = e.newPlugin(e.pool)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	e.kubelet.WaitRegister(5 * time.Second)
	return e
}

// newPlugin builds a plugin on the env's directories (as a restarted agent
// would), without serving it.
func (e *env) newPlugin(p Pool) *Plugin {
	e.t.Helper()
	pl, err := New(e.options(p))
	if err != nil {
		e.t.Fatal(err)
	}
	return pl
}

func (e *env) options(p Pool) Options {
	return Options{
		KubeletDir:  filepath.Join(e.root, "kubelet"),
		SocketDir:   filepath.Join(e.root, "sock"),
		StateDir:    filepath.Join(e.root, "state"),
		Pool:        p,
		Devices:     e.feed,
		Renew:       e.zero,
		Reclaimed:   func(pod string, devices []string) { e.hook("reclaimed %q %v", pod, devices) },
		ChunkHealth: func(id string, healthy bool, reason string) { e.hook("%s healthy=%v %s", id, healthy, reason) },
		GracePeriod: testGrace,
		Interval:    time.Hour, // tests call Reconcile themselves
		Watch:       20 * time.Millisecond,
		Now:         e.clock.Now,
		Logger:      quietLogger(),
		Observer:    &e.obs,

		GPUResources: []string{"nvidia.com/gpu", "nvidia.com/mig-*"},
	}
}

// ops lists what the plugin reported, as "component/op kind allocation"
// (kind "ok" for a success).
func (e *env) ops() []string {
	var out []string
	for _, op := range e.obs.Ops() {
		kind := "ok"
		if op.Err != nil {
			kind = "error"
			if k, ok := op.Err.(interface{ Kind() string }); ok {
				kind = k.Kind()
			}
		}
		out = append(out, strings.TrimSpace(op.Component+"/"+op.Name+" "+kind+" "+op.Allocation))
	}
	return out
}

func (e *env) zero(id string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.zeroFn != nil {
		if err := e.zeroFn(id); err != nil {
			return err
		}
	}
	e.zeroed[id]++
	return nil
}

func (e *env) zeroCount(id string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.zeroed[id]
}

// allocate calls Allocate through kubelet's gRPC client.
func (e *env) allocate(sets ...[]string) (*pluginapi.AllocateResponse, error) {
	req := &pluginapi.AllocateRequest{}
	for _, ids := range sets {
		req.ContainerRequests = append(req.ContainerRequests, &pluginapi.ContainerAllocateRequest{DevicesIds: ids})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return e.kubelet.Client().Allocate(ctx, req)
}

func (e *env) mustAllocate(ids ...string) string {
	e.t.Helper()
	resp, err := e.allocate(ids)
	if err != nil {
		e.t.Fatalf("allocate %v: %v", ids, err)
	}
	return resp.ContainerResponses[0].Envs[contract.EnvToken]
}

// open starts a session as the copy server does: token to allocation by
// Authorize, then the pool.
func (e *env) open(token string, spec pool.Spec) (*pool.Session, error) {
	alloc, err := e.p.Authorize(token)
	if err != nil {
		return nil, err
	}
	return e.pool.Open(alloc, spec)
}

func (e *env) reconcile() {
	e.t.Helper()
	if err := e.p.Reconcile(context.Background()); err != nil {
		e.t.Fatal(err)
	}
}

// chunkStates maps chunk ID to "state/allocation".
func chunkStates(p *pool.Pool) map[string]string {
	out := make(map[string]string)
	for _, c := range p.Chunks() {
		out[c.ID] = fmt.Sprintf("%s/%s", c.State, c.Allocation)
	}
	return out
}

// healthOf finds a device's health in a list.
func healthOf(list []*pluginapi.Device, id string) string {
	for _, d := range list {
		if d.ID == id {
			return d.Health
		}
	}
	return "absent"
}

var errBoom = errors.New("boom")
