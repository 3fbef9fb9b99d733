package client_test

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	stdsync "sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/poolerr"
	"github.com/kvpool/kvpool/pkg/standalone"
	"github.com/kvpool/kvpool/pkg/wire"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// startAgent runs a standalone agent for the test: 2 GPUs, 2 chunks of 1 MiB
// each, one token.
func startAgent(t testing.TB, chunkBytes int64) *standalone.Agent {
	t.Helper()
	a, err := standalone.Start(standalone.Config{GPUs: 2, ChunksPerGPU: 2, ChunkBytes: chunkBytes,
		Tokens: []string{"tok"}, Socket: filepath.Join(t.TempDir(), "kv.sock"), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
		a.Close()
	})
	return a
}

// kv is a simulated device KV cache: K and V regions of pages pages.
type kv struct {
	dev     cudart.Device
	k, v    cudart.DevicePtr
	pages   int
	bpp     uint64
	regions []cudart.Region
}

func newKV(t testing.TB, dev cudart.Device, pages int, bpp uint64) *kv {
	t.Helper()
	k, err := dev.MemAlloc(uint64(pages) * bpp)
	if err != nil {
		t.Fatal(err)
	}
	v, err := dev.MemAlloc(uint64(pages) * bpp)
	if err != nil {
		t.Fatal(err)
	}
	return &kv{dev: dev, k: k, v: v, pages: pages, bpp: bpp, regions: []cudart.Region{
		{Base: k, Stride: bpp, PageBytes: bpp, Pages: pages},
		{Base: v, Stride: bpp, PageBytes: bpp, Pages: pages},
	}}
}

// fill writes random bytes to device page p of both regions and returns them.
func (c *kv) fill(t testing.TB, rng *rand.Rand, p int32) []byte {
	t.Helper()
	b := make([]byte, 2*c.bpp)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	c.write(t, p, b)
	return b
}

func (c *kv) write(t testing.TB, p int32, b []byte) {
	t.Helper()
	if err := c.dev.MemcpyHtoD(c.k+cudart.DevicePtr(uint64(p)*c.bpp), b[:c.bpp]); err != nil {
		t.Fatal(err)
	}
	if err := c.dev.MemcpyHtoD(c.v+cudart.DevicePtr(uint64(p)*c.bpp), b[c.bpp:]); err != nil {
		t.Fatal(err)
	}
}

func (c *kv) read(t testing.TB, p int32) []byte {
	t.Helper()
	b := make([]byte, 2*c.bpp)
	if err := c.dev.MemcpyDtoH(b[:c.bpp], c.k+cudart.DevicePtr(uint64(p)*c.bpp)); err != nil {
		t.Fatal(err)
	}
	if err := c.dev.MemcpyDtoH(b[c.bpp:], c.v+cudart.DevicePtr(uint64(p)*c.bpp)); err != nil {
		t.Fatal(err)
	}
	return b
}

func (c *kv) poison(t testing.TB, p int32) {
	c.write(t, p, bytes.Repeat([]byte{0xEE}, int(2*c.bpp)))
}

func openPool(t testing.TB, a *standalone.Agent, dev cudart.Device, c *kv, inst []byte, maxPages int) *client.CPUPagePool {
	t.Helper()
	p, err := client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev,
		Regions: c.regions, InstanceID: inst, MaxPages: maxPages, Logger: quiet, RetryFor: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// sync waits for the pool's copies from the engine's side.
func sync(t testing.TB, p *client.CPUPagePool, dev cudart.Device) {
	t.Helper()
	if err := p.Sync(0); err != nil {
		t.Fatal(err)
	}
	if err := dev.StreamSynchronize(0); err != nil {
		t.Fatal(err)
	}
}

func mustFree(t testing.TB, p *client.CPUPagePool) int {
	t.Helper()
	n, err := p.NumFreePages()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestOffloadReloadBytes(t *testing.T) {
	a := startAgent(t, 1<<20)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1, CopyDelay: time.Millisecond})
	dev, _ := sim.Open(0)
	c := newKV(t, dev, 64, 8192)
	p := openPool(t, a, dev, c, []byte("instance-A"), 0)
	rng := rand.New(rand.NewPCG(1, 2))

	_, capacity, pageSize := p.Session()
	if pageSize != 16384 {
		t.Fatalf("page size %d, want 16384", pageSize)
	}
	if capacity != 2*(1<<20)/16384 { // the two chunks of GPU 0
		t.Fatalf("capacity %d", capacity)
	}
	src := []int32{3, 4, 5, 9, 20}
	want := map[int32][]byte{}
	for _, pg := range src {
		want[pg] = c.fill(t, rng, pg)
	}
	ok, err := p.OffloadStream("r1", "attn", src, 77, 80, 1)
	if err != nil || !ok {
		t.Fatalf("offload: %v %v", ok, err)
	}
	sync(t, p, dev)
	for _, pg := range src {
		c.poison(t, pg)
	}
	if n, err := p.NumPages("r1", "attn"); err != nil || n != len(src) {
		t.Fatalf("num_pages %d %v", n, err)
	}
	dst := []int32{40, 41, 42, 60, 2}
	st, err := p.ReloadStream("r1", "attn", dst)
	if err != nil {
		t.Fatal(err)
	}
	if st.StoredLen != 77 || st.Position != 80 || st.Released != 1 || len(st.CPUPageIndices) != len(src) {
		t.Fatalf("reloaded %+v", st)
	}
	sync(t, p, dev)
	for i, pg := range dst {
		if got := c.read(t, pg); !bytes.Equal(got, want[src[i]]) {
			t.Fatalf("device page %d (from %d) differs after the round trip", pg, src[i])
		}
	}
	if off, _ := p.IsOffloaded("r1"); off {
		t.Fatal("r1 still offloaded after reload")
	}
	if err := p.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if u, _ := p.Usage(); u.Pending != 0 || u.Used != 0 {
		t.Fatalf("after fence: %+v", u)
	}
}

func TestFullDiscardRemove(t *testing.T) {
	a := startAgent(t, 1<<20)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
	dev, _ := sim.Open(0)
	c := newKV(t, dev, 64, 8192)
	p := openPool(t, a, dev, c, []byte("instance-F"), 10)

	if ok, err := p.OffloadStream("a", "x", []int32{0, 1, 2, 3, 4, 5}, 1, 1, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	if ok, err := p.OffloadStream("a", "y", []int32{6, 7}, 1, 1, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	before := mustFree(t, p)
	if before != 2 {
		t.Fatalf("free %d, want 2", before)
	}
	ok, err := p.OffloadStream("b", "x", []int32{10, 11, 12}, 1, 1, 0)
	if ok || err != nil {
		t.Fatalf("offload into a full pool: ok %v err %v, want false, nil", ok, err)
	}
	if off, _ := p.IsOffloaded("b"); off || mustFree(t, p) != before {
		t.Fatal("a refused offload changed state")
	}
	if l, _ := p.Labels("a"); len(l) != 2 || l[0] != "x" || l[1] != "y" {
		t.Fatalf("labels %q", l)
	}
	if err := p.Discard("a", "y"); err != nil {
		t.Fatal(err)
	}
	if mustFree(t, p) != 4 {
		t.Fatal("discard did not return pages")
	}
	if err := p.RemoveRequest("a"); err != nil {
		t.Fatal(err)
	}
	if mustFree(t, p) != 10 {
		t.Fatal("remove_request did not return pages")
	}
	if err := p.RemoveRequest("never"); err != nil {
		t.Fatalf("remove_request of an unknown request: %v", err)
	}
}

func TestMisuse(t *testing.T) {
	a := startAgent(t, 1<<20)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
	dev, _ := sim.Open(0)
	c := newKV(t, dev, 16, 4096)
	p := openPool(t, a, dev, c, []byte("instance-M"), 0)
	if ok, err := p.OffloadStream("r", "l", []int32{1, 2}, 0, 0, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	free := mustFree(t, p)
	cases := []struct {
		name string
		call func() error
		want error
	}{
		{"duplicate stream", func() error { _, err := p.OffloadStream("r", "l", []int32{3}, 0, 0, 0); return err }, poolerr.ErrDuplicateStream},
		{"out of range", func() error { _, err := p.OffloadStream("q", "l", []int32{16}, 0, 0, 0); return err }, poolerr.ErrOutOfRange},
		{"negative index", func() error { _, err := p.OffloadStream("q", "l", []int32{-1}, 0, 0, 0); return err }, poolerr.ErrOutOfRange},
		{"duplicate index", func() error { _, err := p.OffloadStream("q", "l", []int32{4, 4}, 0, 0, 0); return err }, poolerr.ErrDuplicateIndex},
		{"negative meta", func() error { _, err := p.OffloadStream("q", "l", []int32{4}, -1, 0, 0); return err }, poolerr.ErrBadSize},
		{"empty rid", func() error { _, err := p.OffloadStream("", "l", []int32{4}, 0, 0, 0); return err }, poolerr.ErrBadName},
		{"unknown reload", func() error { _, err := p.ReloadStream("zz", "l", []int32{4}); return err }, poolerr.ErrUnknownStream},
		{"wrong count", func() error { _, err := p.ReloadStream("r", "l", []int32{4}); return err }, poolerr.ErrPageCount},
		{"reload dup index", func() error { _, err := p.ReloadStream("r", "l", []int32{4, 4}); return err }, poolerr.ErrDuplicateIndex},
		{"offload duplicate stream of zero pages", func() error { _, err := p.OffloadStream("r", "l", nil, 0, 0, 0); return err }, poolerr.ErrDuplicateStream},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			if !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
			var ce *client.Error
			if !errors.As(err, &ce) || ce.Message == "" {
				t.Fatalf("error %v is not a *client.Error with a message", err)
			}
			if mustFree(t, p) != free {
				t.Fatal("a refused call changed the free page count")
			}
			if n, err := p.NumPages("r", "l"); n != 2 || err != nil {
				t.Fatalf("stream r/l changed: %d %v", n, err)
			}
		})
	}
}

// TestNamesNotUTF8 sends request IDs and labels that are not UTF-8 (the
// wire's strings must be) through every call that names a request or a
// stream: the agent refuses each as a bad request, says why, and nothing
// changes.
func TestNamesNotUTF8(t *testing.T) {
	a := startAgent(t, 1<<20)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
	dev, _ := sim.Open(0)
	c := newKV(t, dev, 16, 4096)
	p := openPool(t, a, dev, c, []byte("instance-U"), 0)
	if ok, err := p.OffloadStream("r", "l", []int32{1, 2}, 0, 0, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	free := mustFree(t, p)
	bad := "r\xff"
	cases := []struct {
		name string
		call func() error
	}{
		{"offload", func() error { _, err := p.OffloadStream(bad, "l", []int32{3}, 0, 0, 0); return err }},
		{"reload", func() error { _, err := p.ReloadStream("r", bad, []int32{3, 4}); return err }},
		{"is_offloaded", func() error { _, err := p.IsOffloaded(bad); return err }},
		{"num_pages", func() error { _, err := p.NumPages("r", bad); return err }},
		{"labels", func() error { _, err := p.Labels(bad); return err }},
		{"discard", func() error { return p.Discard(bad, "l") }},
		{"remove_request", func() error { return p.RemoveRequest(bad) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			var ce *client.Error
			if !errors.As(err, &ce) || ce.Status != wire.StatusBadRequest || !strings.Contains(ce.Message, "UTF-8") {
				t.Fatalf("got %v, want the agent's bad request naming UTF-8", err)
			}
			if mustFree(t, p) != free {
				t.Fatal("a refused call changed the free page count")
			}
			if ok, err := p.IsOffloaded("r"); !ok || err != nil {
				t.Fatalf("request r after the refusal: %v %v", ok, err)
			}
			if n, err := p.NumPages("r", "l"); n != 2 || err != nil {
				t.Fatalf("stream r/l changed: %d %v", n, err)
			}
		})
	}
}

// fullPool opens a pool of 8 host pages and fills them all with stream r/l,
// offloaded from device pages 0-7 (of 32).
func fullPool(t *testing.T, delay time.Duration, inst string) (cudart.Device, *kv, *client.CPUPagePool, *rand.Rand) {
	t.Helper()
	a := startAgent(t, 1<<20)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1, CopyDelay: delay})
	dev, _ := sim.Open(0)
	c := newKV(t, dev, 32, 8192)
	p := openPool(t, a, dev, c, []byte(inst), 8)
	rng := rand.New(rand.NewPCG(3, 4))
	for pg := int32(0); pg < 8; pg++ {
		c.fill(t, rng, pg)
	}
	if ok, err := p.OffloadStream("r", "l", []int32{0, 1, 2, 3, 4, 5, 6, 7}, 0, 0, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	sync(t, p, dev)
	return dev, c, p, rng
}

func TestPendingFenceWaitsForCopy(t *testing.T) {
	dev, c, p, rng := fullPool(t, 20*time.Millisecond, "instance-P")
	want := c.read(t, 5)
	if _, err := p.ReloadStream("r", "l", []int32{10, 11, 12, 13, 14, 15, 16, 17}); err != nil {
		t.Fatal(err)
	}
	// The reload's copy is still running (20 ms delay): its pages are
	// pending, so this offload must wait for the copy, fence and retry.
	for pg := int32(20); pg < 28; pg++ {
		c.fill(t, rng, pg)
	}
	ok, err := p.OffloadStream("s", "l", []int32{20, 21, 22, 23, 24, 25, 26, 27}, 0, 0, 0)
	if !ok || err != nil {
		t.Fatalf("offload behind a pending reload: %v %v", ok, err)
	}
	sync(t, p, dev)
	if got := c.read(t, 15); !bytes.Equal(got, want) {
		t.Fatal("the reload's bytes were overwritten by the next offload")
	}
}

// TestPendingFenceHoldsOffload holds a reload's copy behind a blocked
// engine stream: an offload that needs its host pages must not return (nor
// enqueue a copy over them) until that copy has run.
func TestPendingFenceHoldsOffload(t *testing.T) {
	dev, c, p, rng := fullPool(t, 0, "instance-hold")
	want := c.read(t, 3)
	release := make(chan struct{})
	if err := dev.LaunchHostFunc(0, func() { <-release }); err != nil {
		t.Fatal(err)
	}
	if _, err := p.ReloadStream("r", "l", []int32{10, 11, 12, 13, 14, 15, 16, 17}); err != nil {
		close(release)
		t.Fatal(err)
	}
	for pg := int32(20); pg < 28; pg++ {
		c.fill(t, rng, pg)
	}
	done := make(chan error, 1)
	go func() {
		ok, err := p.OffloadStream("s", "l", []int32{20, 21, 22, 23, 24, 25, 26, 27}, 0, 0, 0)
		if err == nil && !ok {
			err = errors.New("offload refused")
		}
		done <- err
	}()
	select {
	case err := <-done:
		close(release)
		t.Fatalf("the offload returned (%v) while the reload reading its host pages was held", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	sync(t, p, dev)
	if got := c.read(t, 13); !bytes.Equal(got, want) {
		t.Fatal("the reload's bytes were overwritten by the next offload")
	}
}

func TestResumeAndReplace(t *testing.T) {
	a := startAgent(t, 1<<20)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 2})
	dev0, _ := sim.Open(0)
	dev1, _ := sim.Open(1)
	c0 := newKV(t, dev0, 16, 4096)
	c1 := newKV(t, dev1, 16, 4096)
	p0 := openPool(t, a, dev0, c0, []byte("process-1"), 0)
	p1 := openPool(t, a, dev1, c1, []byte("process-1"), 0)
	for _, p := range []*client.CPUPagePool{p0, p1} {
		if ok, err := p.OffloadStream("r", "l", []int32{1, 2, 3}, 5, 6, 0); !ok || err != nil {
			t.Fatal(ok, err)
		}
	}
	// Same instance reconnects: the session and its streams are found.
	p0.Disconnect()
	if n, err := p0.NumPages("r", "l"); err != nil || n != 3 {
		t.Fatalf("after reconnect: %d %v", n, err)
	}
	// A new process on GPU 0 while the owner is connected: refused.
	_, err := client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev0,
		Regions: c0.regions, InstanceID: []byte("process-2"), Logger: quiet})
	var ce *client.Error
	if !errors.As(err, &ce) || ce.Status != wire.StatusBusy {
		t.Fatalf("open over a live session: %v, want busy", err)
	}
	// The owner dies (disconnects for good): the new process takes over
	// GPU 0 with a clean session; GPU 1's session is untouched.
	p0.Disconnect()
	waitDisconnected(t, a, 2)
	p2 := openPool(t, a, dev0, c0, []byte("process-2"), 0)
	if off, err := p2.IsOffloaded("r"); off || err != nil {
		t.Fatalf("new instance sees old streams: %v %v", off, err)
	}
	if u, _ := p2.Usage(); u.Used != 0 || u.Free != u.Capacity {
		t.Fatalf("new session not clean: %+v", u)
	}
	if n, err := p1.NumPages("r", "l"); err != nil || n != 3 {
		t.Fatalf("GPU 1 session disturbed: %d %v", n, err)
	}
	if len(a.Server.Sessions()) != 2 {
		t.Fatalf("sessions %+v", a.Server.Sessions())
	}
}

// waitDisconnected waits until the server has seen n sessions' connections
// drop or fewer connected.
func waitDisconnected(t *testing.T, a *standalone.Agent, total int) {
	t.Helper()
	for range 200 {
		connected := 0
		for _, s := range a.Server.Sessions() {
			if s.Connected {
				connected++
			}
		}
		if connected < total {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatal("server did not notice the disconnect")
}

// TestAgentRestart: the agent goes away and a new one takes the socket. The
// client's next call reconnects, gets a fresh session on new memory (its
// streams are gone, as documented) and moves bytes correctly again.
func TestAgentRestart(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "kv.sock")
	run := func() (*standalone.Agent, func()) {
		a, err := standalone.Start(standalone.Config{GPUs: 1, ChunksPerGPU: 1, ChunkBytes: 1 << 20,
			Tokens: []string{"tok"}, Socket: sock, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- a.Serve(ctx) }()
		return a, func() { cancel(); <-done; a.Close() }
	}
	a1, stop1 := run()
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
	dev, _ := sim.Open(0)
	c := newKV(t, dev, 16, 4096)
	p := openPool(t, a1, dev, c, []byte("restart-instance"), 0)
	if ok, err := p.OffloadStream("r", "l", []int32{1, 2}, 0, 0, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	sync(t, p, dev)
	stop1()
	// Past Options.RetryFor: calls fail with ErrUnavailable, offloads
	// return false (the engine keeps its pages).
	if _, err := p.IsOffloaded("r"); !errors.Is(err, client.ErrUnavailable) {
		t.Fatalf("call to a stopped agent: %v, want ErrUnavailable", err)
	}
	if ok, err := p.OffloadStream("g", "l", []int32{4}, 0, 0, 0); ok || err != nil {
		t.Fatalf("offload to a stopped agent: %v, %v; want false, nil", ok, err)
	}
	// Within the bound a call waits for the agent to come back.
	stop2 := make(chan func(), 1)
	go func() {
		time.Sleep(200 * time.Millisecond)
		_, stop := run()
		stop2 <- stop
	}()
	defer func() { (<-stop2)() }()
	if off, err := p.IsOffloaded("r"); err != nil || off {
		t.Fatalf("after the restart: offloaded %v, %v; want a fresh session", off, err)
	}
	rng := rand.New(rand.NewPCG(5, 6))
	want := c.fill(t, rng, 3)
	if ok, err := p.OffloadStream("s", "l", []int32{3}, 0, 0, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	sync(t, p, dev)
	c.poison(t, 3)
	if _, err := p.ReloadStream("s", "l", []int32{9}); err != nil {
		t.Fatal(err)
	}
	sync(t, p, dev)
	if !bytes.Equal(c.read(t, 9), want) {
		t.Fatal("bytes differ after reconnecting to a new agent")
	}
}

// TestBackToBackOrdering reloads a stream right after offloading it, with
// no sync in between, on a simulator whose copies lag: the reload's
// host-to-device copy must wait for the offload's device-to-host copy, and
// the offload's copy must wait for the engine's stream that wrote the pages.
func TestBackToBackOrdering(t *testing.T) {
	a := startAgent(t, 1<<20)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1, CopyDelay: 5 * time.Millisecond})
	dev, _ := sim.Open(0)
	c := newKV(t, dev, 32, 4096)
	p := openPool(t, a, dev, c, []byte("instance-B2B"), 0)
	rng := rand.New(rand.NewPCG(7, 8))
	src := []int32{0, 1, 2, 3, 8, 9}
	var want [][]byte
	for _, pg := range src {
		want = append(want, c.fill(t, rng, pg))
	}
	for round := range 3 {
		rid := fmt.Sprint("r", round)
		// An earlier offload queues ahead on the device-to-host stream, so
		// that the one reloaded below completes well after a reload copy
		// that did not wait for it would have run.
		if ok, err := p.OffloadStream(rid+"-before", "l", []int32{30, 31}, 0, 0, 0); !ok || err != nil {
			t.Fatal(ok, err)
		}
		if ok, err := p.OffloadStream(rid, "l", src, 0, 0, 0); !ok || err != nil {
			t.Fatal(ok, err)
		}
		dst := []int32{20, 21, 22, 23, 24, 25}
		if _, err := p.ReloadStream(rid, "l", dst); err != nil {
			t.Fatal(err)
		}
		sync(t, p, dev)
		for i, pg := range dst {
			if !bytes.Equal(c.read(t, pg), want[i]) {
				t.Fatalf("round %d: device page %d has stale bytes: the reload did not wait for the offload", round, pg)
			}
			c.poison(t, pg)
		}
		if err := p.RemoveRequest(rid + "-before"); err != nil {
			t.Fatal(err)
		}
	}
}

// TestFenceRidesAlong checks that a completed reload is reported on the next
// request, with no fence request of its own.
func TestFenceRidesAlong(t *testing.T) {
	var mu stdsync.Mutex
	ops := map[wire.Op]int{}
	a, err := standalone.Start(standalone.Config{GPUs: 1, ChunksPerGPU: 1, ChunkBytes: 1 << 20, Tokens: []string{"tok"},
		Socket: filepath.Join(t.TempDir(), "kv.sock"), Logger: quiet,
		Hooks: server.Hooks{Request: func(r server.Request) { mu.Lock(); ops[r.Op]++; mu.Unlock() }}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	defer func() { cancel(); <-done; a.Close() }()
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
	dev, _ := sim.Open(0)
	c := newKV(t, dev, 16, 4096)
	p := openPool(t, a, dev, c, []byte("instance-fence"), 0)
	if ok, err := p.OffloadStream("r", "l", []int32{1, 2, 3}, 0, 0, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	if _, err := p.ReloadStream("r", "l", []int32{4, 5, 6}); err != nil {
		t.Fatal(err)
	}
	sync(t, p, dev) // the copy is complete; the agent does not know yet
	u, err := p.Usage()
	if err != nil {
		t.Fatal(err)
	}
	// This usage request carried the fence, and the agent applied it
	// before answering.
	if u.Pending != 0 {
		t.Fatalf("pending %d after a request that should carry the fence", u.Pending)
	}
	// The hook runs just after the reply is sent.
	for range 200 {
		mu.Lock()
		n := ops[wire.OpUsage]
		mu.Unlock()
		if n > 0 {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	if ops[wire.OpFence] != 0 {
		t.Fatalf("a separate fence request was sent: %v", ops)
	}
	if ops[wire.OpOffload] != 1 || ops[wire.OpReload] != 1 || ops[wire.OpUsage] != 1 {
		t.Fatalf("requests %v, want one offload, one reload, one usage", ops)
	}
}

// TestConcurrentCalls runs the seed API from several goroutines on one
// pool, for the race detector and for the bytes.
func TestConcurrentCalls(t *testing.T) {
	a := startAgent(t, 1<<20)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
	dev, _ := sim.Open(0)
	c := newKV(t, dev, 64, 4096)
	p := openPool(t, a, dev, c, []byte("instance-conc"), 0)
	var wg stdsync.WaitGroup
	errs := make(chan error, 4)
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			mine := []int32{int32(g * 16), int32(g*16 + 1), int32(g*16 + 2)}
			for i := range 50 {
				rid := fmt.Sprintf("g%d-%d", g, i)
				if ok, err := p.OffloadStream(rid, "l", mine, int64(i), 0, 0); !ok || err != nil {
					errs <- fmt.Errorf("offload %s: %v %v", rid, ok, err)
					return
				}
				st, err := p.ReloadStream(rid, "l", mine)
				if err != nil || st.StoredLen != int64(i) {
					errs <- fmt.Errorf("reload %s: %+v %v", rid, st, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if err := p.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if u, _ := p.Usage(); u.Used != 0 || u.Pending != 0 {
		t.Fatalf("usage after: %+v", u)
	}
}

// TestOffloadFollowsEngineStream: the engine writes pages with async work on
// its stream and offloads at once; the offload's copy must wait for that
// work (Options.Order), not read the pages before it lands.
func TestOffloadFollowsEngineStream(t *testing.T) {
	a := startAgent(t, 1<<20)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1, CopyDelay: 5 * time.Millisecond})
	dev, _ := sim.Open(0)
	c := newKV(t, dev, 16, 4096)
	p := openPool(t, a, dev, c, []byte("instance-order"), 0)
	// p was opened with Order 0: the default stream is the engine's.
	src := make([]byte, 2*4096)
	for i := range src {
		src[i] = byte(i*7 + 1)
	}
	if err := dev.HostRegister(src); err != nil {
		t.Fatal(err)
	}
	defer dev.HostUnregister(src)
	hostAddr := uintptr(unsafe.Pointer(&src[0]))
	err := dev.MemcpyBatchAsync([]cudart.Copy{
		{Dst: uintptr(c.k) + 5*4096, Src: hostAddr, Bytes: 4096},
		{Dst: uintptr(c.v) + 5*4096, Src: hostAddr + 4096, Bytes: 4096},
	}, cudart.HostToDevice, 0)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := p.OffloadStream("r", "l", []int32{5}, 0, 0, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	sync(t, p, dev)
	c.poison(t, 5)
	if _, err := p.ReloadStream("r", "l", []int32{6}); err != nil {
		t.Fatal(err)
	}
	sync(t, p, dev)
	if !bytes.Equal(c.read(t, 6), src) {
		t.Fatal("the offload copied the page before the engine's write to it completed")
	}
}

// countingDevice records the batches the client enqueues.
type countingDevice struct {
	cudart.Device
	mu      stdsync.Mutex
	batches [][]cudart.Copy
}

func (d *countingDevice) MemcpyBatchAsync(cs []cudart.Copy, dir cudart.Direction, s cudart.Stream) error {
	d.mu.Lock()
	d.batches = append(d.batches, append([]cudart.Copy(nil), cs...))
	d.mu.Unlock()
	return d.Device.MemcpyBatchAsync(cs, dir, s)
}

// TestBatchesMergeRuns: one batch per call, and pages contiguous on both
// sides (one region, stride equal to the page bytes) become one copy.
func TestBatchesMergeRuns(t *testing.T) {
	a := startAgent(t, 1<<20)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
	simDev, _ := sim.Open(0)
	dev := &countingDevice{Device: simDev}
	base, err := dev.MemAlloc(64 * 4096)
	if err != nil {
		t.Fatal(err)
	}
	p, err := client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev, Logger: quiet,
		InstanceID: []byte("instance-merge"), Regions: []cudart.Region{{Base: base, Stride: 4096, PageBytes: 4096, Pages: 64}}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	// Host pages of a fresh session come out in ascending order; device
	// pages 10..13 and 20..21 are two runs.
	if ok, err := p.OffloadStream("r", "l", []int32{10, 11, 12, 13, 20, 21}, 0, 0, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	dev.mu.Lock()
	defer dev.mu.Unlock()
	if len(dev.batches) != 1 {
		t.Fatalf("%d batches for one offload", len(dev.batches))
	}
	b := dev.batches[0]
	if len(b) != 2 || b[0].Bytes != 4*4096 || b[1].Bytes != 2*4096 || b[0].Src != uintptr(base)+10*4096 {
		t.Fatalf("copies %+v, want two runs of 4 and 2 pages", b)
	}
}

func TestOpenRejects(t *testing.T) {
	a := startAgent(t, 1<<20)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
	dev, _ := sim.Open(0)
	good := []cudart.Region{{Base: 0x1000, Stride: 4096, PageBytes: 4096, Pages: 8}}
	t.Setenv(contract.EnvToken, "")
	t.Setenv(contract.EnvSocket, "")
	cases := []struct {
		name string
		o    client.Options
		want string
	}{
		{"no device", client.Options{Socket: a.Socket, Token: "tok", Regions: good}, "Device is required"},
		{"no regions", client.Options{Socket: a.Socket, Token: "tok", Device: dev}, "Regions is empty"},
		{"zero bytes", client.Options{Socket: a.Socket, Token: "tok", Device: dev, Regions: []cudart.Region{{Stride: 1, Pages: 1}}}, "region 0"},
		{"stride below bytes", client.Options{Socket: a.Socket, Token: "tok", Device: dev, Regions: []cudart.Region{{Stride: 1, PageBytes: 2, Pages: 1}}}, "stride"},
		{"no pages", client.Options{Socket: a.Socket, Token: "tok", Device: dev, Regions: []cudart.Region{{Stride: 2, PageBytes: 2}}}, "region 0"},
		{"negative max pages", client.Options{Socket: a.Socket, Token: "tok", Device: dev, Regions: good, MaxPages: -1}, "negative"},
		{"spin over the limit", client.Options{Socket: a.Socket, Token: "tok", Device: dev, Regions: good, SpinWait: wire.SpinLimit + 1}, "SpinWait"},
		{"no token", client.Options{Socket: a.Socket, Device: dev, Regions: good}, "no allocation token"},
		{"bad token", client.Options{Socket: a.Socket, Token: "nope", Device: dev, Regions: good}, "unauthorized"},
		{"no agent", client.Options{Socket: a.Socket + ".missing", Token: "tok", Device: dev, Regions: good}, "dial"},
		{"page larger than a chunk", client.Options{Socket: a.Socket, Token: "tok", Device: dev,
			Regions: []cudart.Region{{Base: 0x1000, Stride: 2 << 20, PageBytes: 2 << 20, Pages: 8}}}, "bad size"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.o.Logger = quiet
			p, err := client.Open(context.Background(), tc.o)
			if err == nil {
				p.Close()
				t.Fatal("Open succeeded")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not mention %q", err, tc.want)
			}
		})
	}
	if n := len(a.Server.Sessions()); n != 0 {
		t.Fatalf("refused opens left %d sessions", n)
	}
}

// fakeAgent answers hello, then answers open with rep and the given fds.
func fakeAgent(t *testing.T, rep *wire.OpenReply, fds []int) string {
	return fakeAgentThen(t, rep, fds, func(c *wire.Conn, buf []byte) { c.Recv(buf) }) // wait for the client to hang up
}

// fakeAgentThen is fakeAgent, which then hands the connection to then.
func fakeAgentThen(t *testing.T, rep *wire.OpenReply, fds []int, then func(c *wire.Conn, buf []byte)) string {
	t.Helper()
	body, err := proto.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	return fakeAgentBody(t, body, fds, then)
}

// fakeAgentBody is fakeAgentThen with the open's reply body as bytes.
func fakeAgentBody(t *testing.T, openBody []byte, fds []int, then func(c *wire.Conn, buf []byte)) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fake.sock")
	l, err := net.ListenUnix(wire.Network, &net.UnixAddr{Name: path, Net: wire.Network})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		uc, err := l.AcceptUnix()
		if err != nil {
			return
		}
		c := wire.NewConn(uc)
		defer c.Close()
		buf := make([]byte, wire.MaxMessage+1)
		for _, op := range []wire.Op{wire.OpHello, wire.OpOpen} {
			pkt, _, err := c.Recv(buf)
			if err != nil {
				return
			}
			h, _, _ := wire.ParseHeader(pkt)
			out, _ := wire.AppendPacket(nil, wire.Header{Op: h.Op, Seq: h.Seq}, &wire.HelloReply{Version: wire.Version})
			var pass []int
			if op == wire.OpOpen {
				out, pass = append(wire.AppendHeader(nil, wire.Header{Op: h.Op, Seq: h.Seq}), openBody...), fds
			}
			if len(out) > wire.MaxMessage || c.Send(out, pass) != nil {
				return
			}
		}
		then(c, buf)
	}()
	return path
}

// chunkFD is the descriptor of a 1 MiB file standing in for a granted
// chunk, closed when the test ends.
func chunkFD(t *testing.T) int {
	t.Helper()
	f, err := os.CreateTemp(t.TempDir(), "chunk")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := f.Truncate(1 << 20); err != nil {
		t.Fatal(err)
	}
	return int(f.Fd())
}

// TestRepliesAfterOpenRefuseFiles: once its session is open, the client's
// socket refuses files (where the kernel can: Linux 6.16): an agent's reply
// that carries one fails at the agent's send, with EPERM, and nothing
// reaches the client; the same reply without it is answered as usual.
// Where the kernel cannot, the client refuses such a reply itself.
func TestRepliesAfterOpenRefuseFiles(t *testing.T) {
	fd := chunkFD(t)
	rep := &wire.OpenReply{Session: 1, PageSize: 4096, PagesPerChunk: 256, Capacity: 256, Chunks: []*wire.ChunkGrant{{Id: "c0", Size: 1 << 20}}}
	sent := make(chan error, 1)
	path := fakeAgentThen(t, rep, []int{fd}, func(c *wire.Conn, buf []byte) {
		pkt, _, err := c.Recv(buf)
		if err != nil {
			sent <- err
			return
		}
		h, _, _ := wire.ParseHeader(pkt)
		out, _ := wire.AppendPacket(nil, wire.Header{Op: h.Op, Seq: h.Seq}, &wire.IsOffloadedReply{Offloaded: true})
		err = c.Send(out, []int{fd})
		sent <- err
		if errors.Is(err, syscall.EPERM) {
			_ = c.Send(out, nil)
		}
		c.Recv(buf)
	})
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
	dev, _ := sim.Open(0)
	p, err := client.Open(context.Background(), client.Options{NoLane: true, Socket: path, Token: "t", Device: dev, Logger: quiet,
		Regions: []cudart.Region{{Base: 0x1000, Stride: 4096, PageBytes: 4096, Pages: 8}}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ok, err := p.IsOffloaded("r")
	serr := <-sent
	if wire.CanRefuseFiles() && !errors.Is(serr, syscall.EPERM) {
		t.Fatalf("the agent's send of a file after the open: %v, want EPERM (the client's socket refusing files)", serr)
	}
	switch {
	case errors.Is(serr, syscall.EPERM):
		if !ok || err != nil {
			t.Fatalf("is_offloaded after the refused send: %v, %v; want the reply sent without the file", ok, err)
		}
	case serr == nil:
		t.Log("this kernel has no SO_PASSRIGHTS (Linux 6.16): the client checks replies itself")
		if !errors.Is(err, client.ErrProtocol) || !strings.Contains(err.Error(), "carried 1 fds") {
			t.Fatalf("is_offloaded of a reply with a file: %v, want ErrProtocol", err)
		}
	default:
		t.Fatalf("the fake agent's send: %v", serr)
	}
}

// TestOpenReplyChecked: a reply whose fds or geometry do not add up is a
// protocol error.
func TestOpenReplyChecked(t *testing.T) {
	fd := chunkFD(t)
	chunk := []*wire.ChunkGrant{{Id: "c0", Size: 1 << 20}}
	cases := []struct {
		name string
		rep  *wire.OpenReply
		fds  []int
		want string
	}{
		{"missing fd", &wire.OpenReply{Session: 1, PageSize: 4096, PagesPerChunk: 256, Capacity: 256, Chunks: chunk}, nil, "carries 0 fds"},
		{"extra fd", &wire.OpenReply{Session: 1, PageSize: 4096, PagesPerChunk: 256, Capacity: 256, Chunks: chunk}, []int{fd, fd}, "carries 2 fds"},
		{"capacity beyond chunks", &wire.OpenReply{Session: 1, PageSize: 4096, PagesPerChunk: 256, Capacity: 257, Chunks: chunk}, []int{fd}, "geometry"},
		{"zero page size", &wire.OpenReply{Session: 1, PagesPerChunk: 256, Capacity: 1, Chunks: chunk}, []int{fd}, "geometry"},
		{"chunk too small", &wire.OpenReply{Session: 1, PageSize: 8192, PagesPerChunk: 256, Capacity: 256, Chunks: chunk}, []int{fd}, "cannot hold"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
			dev, _ := sim.Open(0)
			_, err := client.Open(context.Background(), client.Options{NoLane: true, Socket: fakeAgent(t, tc.rep, tc.fds), Token: "t", Device: dev,
				Logger: quiet, Regions: []cudart.Region{{Base: 0x1000, Stride: 4096, PageBytes: 4096, Pages: 8}}})
			if !errors.Is(err, client.ErrProtocol) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrProtocol mentioning %q", err, tc.want)
			}
		})
	}
}

// TestOpenMoreFilesChecked: where an open's chunks need more descriptors
// than its reply passes, the client fetches the rest with more; an agent
// that passes fewer, or more, than the chunks named is a protocol error.
// Where the reply names only the first chunks (chunk_count), each more must
// name as many chunks as it passes fds, and all of them add up to the
// count, which is no more than the session's pages need.
func TestOpenMoreFilesChecked(t *testing.T) {
	fd := chunkFD(t)
	chunks := make([]*wire.ChunkGrant, wire.MaxFDs+1)
	first := make([]int, wire.MaxFDs)
	for i := range chunks {
		chunks[i] = &wire.ChunkGrant{Id: fmt.Sprint("c", i), Size: 1 << 20}
	}
	for i := range first {
		first[i] = fd
	}
	const ppc = 256 // pages of 4 KiB a 1 MiB chunk
	for _, tc := range []struct {
		name  string
		count uint32 // the reply's chunk_count: 0 names every chunk in the reply
		pages uint32 // the session's capacity; 0: ppc for each chunk
		more  []int
		named int // chunks the more names
		want  string
	}{
		{"none passed", 0, 0, nil, 0, fmt.Sprintf("carries %d fds", wire.MaxFDs)},
		{"one too many", 0, 0, []int{fd, fd}, 0, fmt.Sprintf("carries %d fds", wire.MaxFDs+2)},
		{"named: a more that names none", wire.MaxFDs + 1, 0, []int{fd}, 0, "more names 0 chunks but carries 1 fds"},
		{"named: a more that names two for one fd", wire.MaxFDs + 1, 0, []int{fd}, 2, "more names 2 chunks but carries 1 fds"},
		{"named: fewer than the count", wire.MaxFDs + 2, 0, []int{fd}, 1, fmt.Sprintf("says %d chunks but names %d", wire.MaxFDs+2, wire.MaxFDs+1)},
		{"named: more than the pages need", wire.MaxFDs + 2, ppc * (wire.MaxFDs + 1), nil, 0,
			fmt.Sprintf("says %d chunks for %d pages of %d a chunk", wire.MaxFDs+2, ppc*(wire.MaxFDs+1), ppc)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := &wire.OpenReply{Session: 1, PageSize: 4096, PagesPerChunk: ppc, Capacity: ppc, Chunks: chunks}
			if tc.count != 0 {
				rep.Chunks, rep.ChunkCount, rep.Capacity = chunks[:wire.MaxFDs], tc.count, cmp.Or(tc.pages, ppc*tc.count)
			}
			// A count more than the pages need is refused before any more.
			asks := tc.pages == 0
			asked := make(chan uint32, 1)
			path := fakeAgentThen(t, rep, first, func(c *wire.Conn, buf []byte) {
				pkt, _, err := c.Recv(buf)
				if err != nil {
					return
				}
				h, body, _ := wire.ParseHeader(pkt)
				var m wire.More
				if h.Op != wire.OpMore || wire.DecodeBody(body, &m) != nil {
					return
				}
				asked <- m.Offset
				mr := &wire.MoreReply{}
				for i := range tc.named {
					mr.Chunks = append(mr.Chunks, &wire.ChunkGrant{Id: fmt.Sprint("m", i), Size: 1 << 20})
				}
				out, _ := wire.AppendPacket(nil, wire.Header{Op: h.Op, Seq: h.Seq}, mr)
				if c.Send(out, tc.more) == nil {
					c.Recv(buf)
				}
			})
			sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
			dev, _ := sim.Open(0)
			_, err := client.Open(context.Background(), client.Options{NoLane: true, Socket: path, Token: "t", Device: dev,
				Logger: quiet, Regions: []cudart.Region{{Base: 0x1000, Stride: 4096, PageBytes: 4096, Pages: 8}}})
			if !errors.Is(err, client.ErrProtocol) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrProtocol mentioning %q", err, tc.want)
			}
			select {
			case off := <-asked:
				if !asks || off != wire.MaxFDs {
					t.Fatalf("more from %d, want %d (or none where the count is refused)", off, wire.MaxFDs)
				}
			default:
				if asks {
					t.Fatal("the client did not ask for the rest")
				}
			}
		})
	}
}

// hookDevice runs before and after, when set, around EventSynchronize: what
// other threads of the engine do while a call of the pool waits for a copy.
type hookDevice struct {
	cudart.Device
	before, after func()
}

func (d *hookDevice) EventSynchronize(e cudart.Event) error {
	if d.before != nil {
		d.before()
	}
	err := d.Device.EventSynchronize(e)
	if d.after != nil {
		d.after()
	}
	return err
}

// TestOffloadOutlastsPendingUnderContention: an offload that gets "pending"
// waits for the reload the agent names and retries; while it waits, other
// threads take the pages that reload freed, so it gets "pending" again for
// the next reload, and again. It keeps waiting as long as the agent names a
// later reload (each wait is progress), and stores its stream once one
// frees room for it: it does not give up while reloads it could wait for
// remain.
func TestOffloadOutlastsPendingUnderContention(t *testing.T) {
	a := startAgent(t, 1<<20)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
	simDev, _ := sim.Open(0)
	dev := &hookDevice{Device: simDev}
	c := newKV(t, dev, 32, 4096)
	p := openPool(t, a, dev, c, []byte("instance-contention"), 8)
	for i := range 4 {
		if ok, err := p.OffloadStream(fmt.Sprint("s", i), "", []int32{int32(2 * i), int32(2*i + 1)}, 0, 0, 0); !ok || err != nil {
			t.Fatal(ok, err)
		}
	}
	sync(t, p, dev)
	// Three reloads, each held behind its own gate on the engine stream.
	var gates []chan struct{}
	for i := range 3 {
		g := make(chan struct{})
		gates = append(gates, g)
		if err := dev.LaunchHostFunc(0, func() { <-g }); err != nil {
			t.Fatal(err)
		}
		if _, err := p.ReloadStream(fmt.Sprint("s", i), "", []int32{int32(10 + 2*i), int32(11 + 2*i)}); err != nil {
			t.Fatal(err)
		}
	}
	opened := 0
	defer func() {
		for _, g := range gates[opened:] {
			close(g)
		}
	}()
	// Each time the offload below waits, the reload it waits for is let
	// go, and after the first two waits another thread takes the pages
	// that reload freed.
	waits := 0
	dev.before = func() {
		if opened < len(gates) {
			close(gates[opened])
			opened++
		}
	}
	dev.after = func() {
		waits++
		if waits > 2 {
			return
		}
		ok, err := p.OffloadStream(fmt.Sprint("thief", waits), "", []int32{int32(20 + 2*waits), int32(21 + 2*waits)}, 0, 0, 0)
		if !ok || err != nil {
			t.Errorf("the other thread's offload: %v %v", ok, err)
		}
	}
	ok, err := p.OffloadStream("late", "", []int32{30, 31}, 0, 0, 0)
	dev.before, dev.after = nil, nil
	if !ok || err != nil {
		t.Fatalf("offload after %d waits: %v %v", waits, ok, err)
	}
	if waits != 3 {
		t.Fatalf("the offload waited %d times, want 3 (one per reload)", waits)
	}
	for _, s := range []string{"late", "thief1", "thief2", "s3"} {
		if n, err := p.NumPages(s, ""); n != 2 || err != nil {
			t.Fatalf("stream %s: %d pages, %v", s, n, err)
		}
	}
}

// Opening a session retries what passes: "busy" right after the previous
// owner's connection closed (the agent has not seen it close yet), for
// BusyRetryFor, and a refusal by the agent's session bounds (status
// limit) with a backoff, within RetryFor; a live owner's "busy" comes back
// after BusyRetryFor (issue 23: neither was retried).
func TestOpenRetriesBusyAndLimits(t *testing.T) {
	a := serveAgent(t, standalone.Config{GPUs: 2, ChunksPerGPU: 1, ChunkBytes: 1 << 20, Tokens: []string{"tok"},
		Limits: server.Limits{MaxSessionsPerAllocation: 1}})
	sim := cudart.NewSim(cudart.SimOptions{Devices: 2})
	dev0, _ := sim.Open(0)
	dev1, _ := sim.Open(1)
	c0, c1 := newKV(t, dev0, 16, 4096), newKV(t, dev1, 16, 4096)
	owner := openPool(t, a, dev0, c0, []byte("owner-process"), 0)
	open := func(dev cudart.Device, c *kv, inst string) (*client.CPUPagePool, error) {
		return client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev,
			Regions: c.regions, InstanceID: []byte(inst), Logger: quiet, RetryFor: 10 * time.Second})
	}
	// A live owner: busy, after the retries.
	start := time.Now()
	if _, err := open(dev0, c0, "second-process"); !isStatus(err, wire.StatusBusy) || time.Since(start) < client.BusyRetryFor {
		t.Fatalf("open over a live owner: %v after %s, want busy after %s", err, time.Since(start), client.BusyRetryFor)
	}
	// The owner goes while the new process tries: it gets the GPU.
	go func() { time.Sleep(300 * time.Millisecond); owner.Disconnect() }()
	p, err := open(dev0, c0, "second-process")
	if err != nil {
		t.Fatalf("open as the owner went: %v", err)
	}
	// GPU 1 of the allocation is over its sessions bound while GPU 0's
	// session lives; the open waits for room.
	go func() { time.Sleep(300 * time.Millisecond); p.Close() }()
	start = time.Now()
	q, err := open(dev1, c1, "third-process")
	if err != nil || time.Since(start) < 250*time.Millisecond {
		t.Fatalf("open over the sessions bound: %v after %s", err, time.Since(start))
	}
	q.Close()
}

func isStatus(err error, st wire.Status) bool {
	var e *client.Error
	return errors.As(err, &e) && e.Status == st
}

// TestLaneReplyChecked: an agent from before lanes answers OpLane "unknown
// op", and the session goes on over the socket; an agent whose lane reply
// does not pass two pipe ends, one for each direction, is a protocol
// error, and nothing is opened.
func TestLaneReplyChecked(t *testing.T) {
	fd := chunkFD(t)
	rep := &wire.OpenReply{Session: 1, PageSize: 4096, PagesPerChunk: 256, Capacity: 256, Chunks: []*wire.ChunkGrant{{Id: "c0", Size: 1 << 20}}}
	pipeEnds := func(t *testing.T, swap bool) []int {
		ours, theirs, err := wire.LanePipes()
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range append(ours[:], theirs[:]...) {
			t.Cleanup(func() { syscall.Close(e) })
		}
		if swap {
			return []int{theirs[1], theirs[0]}
		}
		return []int{theirs[0], theirs[1]}
	}
	for _, tc := range []struct {
		name   string
		status wire.Status
		fds    func(t *testing.T) []int
		want   string // "": the open succeeds, over the socket
	}{
		{"an agent from before lanes", wire.StatusUnknownOp, nil, ""},
		{"no fds", wire.StatusOK, func(*testing.T) []int { return nil }, "carried 0 fds"},
		{"one fd", wire.StatusOK, func(t *testing.T) []int { return pipeEnds(t, false)[:1] }, "carried 1 fds"},
		{"files, not pipes", wire.StatusOK, func(*testing.T) []int { return []int{fd, fd} }, "not a pipe"},
		{"ends swapped", wire.StatusOK, func(t *testing.T) []int { return pipeEnds(t, true) }, "other direction"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			usage := make(chan bool, 1)
			path := fakeAgentThen(t, rep, []int{fd}, func(c *wire.Conn, buf []byte) {
				for {
					pkt, _, err := c.Recv(buf)
					if err != nil {
						return
					}
					h, _, _ := wire.ParseHeader(pkt)
					var out []byte
					var pass []int
					switch {
					case h.Op == wire.OpLane && tc.status != wire.StatusOK:
						out, _ = wire.AppendPacket(nil, wire.Header{Op: h.Op, Status: tc.status, Seq: h.Seq}, &wire.Error{Message: "unknown op 15"})
					case h.Op == wire.OpLane:
						out, pass = wire.AppendHeader(nil, wire.Header{Op: h.Op, Seq: h.Seq}), tc.fds(t)
					case h.Op == wire.OpUsage:
						usage <- true
						out, _ = wire.AppendPacket(nil, wire.Header{Op: h.Op, Seq: h.Seq}, &wire.UsageReply{Capacity: 256, Free: 256})
					default:
						return
					}
					if c.Send(out, pass) != nil {
						return
					}
				}
			})
			sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
			dev, _ := sim.Open(0)
			p, err := client.Open(context.Background(), client.Options{Socket: path, Token: "t", Device: dev, RetryFor: -1,
				Logger: quiet, Regions: []cudart.Region{{Base: 0x1000, Stride: 4096, PageBytes: 4096, Pages: 8}}})
			if tc.want != "" {
				if !errors.Is(err, client.ErrProtocol) || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("got %v, want ErrProtocol mentioning %q", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			// The fake agent reads the socket alone: an answer proves the
			// request went there.
			if u, err := p.Usage(); err != nil || u.Capacity != 256 || !<-usage {
				t.Fatalf("usage over the socket: %+v, %v", u, err)
			}
		})
	}
}
