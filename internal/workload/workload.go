// Package workload drives a kvpool agent the way an inference engine would,
// on a simulated GPU, and checks every byte that comes back. cmd/kvclient,
// kvbench and the end-to-end tests run it.
package workload

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sort"
	"time"

	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/wire"
)

// Config of a workload run.
type Config struct {
	Socket, Token string
	// Device is the UUID of the GPU the session serves, the way an engine
	// has it: given (by the container's visible devices,
	// cudart.VisibleDevices), not chosen. The simulated device the
	// workload copies with carries that UUID, as the driver would report
	// it. Empty: the agent's simulated GPU of index GPU.
	Device string
	// GPU, when Device is empty, is a simulated GPU of the agent's, by
	// index (cudart.SimulatedUUID): for tests and benchmarks that pick one.
	GPU int
	// Ranks is the world size the client declares (client.Options.Ranks);
	// 0: the agent counts the container's GPUs.
	Ranks       int
	DevicePages int    // device KV cache pages (default 256)
	PageBytes   uint64 // bytes per page in each of the two regions, K and V (default 16 KiB)
	MaxPages    int    // host pages to ask for (default 128; negative: the session's fair share, Options.MaxPages 0)
	MaxStream   int    // most pages in one stream (default 16)
	Ops         int    // mixed operations after the checks (default 2000)
	Duration    time.Duration
	Seed        uint64
	InstanceID  []byte // default the process's
	CopyDelay   time.Duration
	Logger      *slog.Logger
	// Progress is called about every 100 operations.
	Progress func(done int)
	// Probe, when set, is called right before (before true) and right
	// after each offload, reload, discard and remove_request of the mixed
	// workload: kvbench times a bare echo there, so that its floor is
	// measured in the same conditions as the calls.
	Probe func(before bool)
}

func (c *Config) defaults() {
	if c.DevicePages == 0 {
		c.DevicePages = 256
	}
	if c.PageBytes == 0 {
		c.PageBytes = 16 << 10
	}
	if c.MaxPages == 0 {
		c.MaxPages = 128
	}
	if c.MaxStream == 0 {
		c.MaxStream = 16
	}
	if c.Ops == 0 && c.Duration == 0 {
		c.Ops = 2000
	}
	if c.Seed == 0 {
		c.Seed = uint64(time.Now().UnixNano())
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Op names an operation in Result.
type Op string

// OpStats are one operation's counts and latencies.
type OpStats struct {
	Count     int
	RoundTrip []time.Duration // agent round trips (one per request)
	Copy      []time.Duration // from the call's return to its copies' completion
	Bytes     int64           // bytes copied
}

// Result of a run.
type Result struct {
	Ops         map[Op]*OpStats
	FullRejects int // offloads refused because the pool was full (correct behaviour)
	Mismatches  int // pages whose bytes differed after the round trip
	Checks      int // assertions that held
	Elapsed     time.Duration
	Capacity    int
	Device      string          // the UUID of the GPU the session served
	Locality    client.Locality // where its chunks lie, as the agent said
}

func (r *Result) op(o Op) *OpStats {
	if r.Ops[o] == nil {
		r.Ops[o] = &OpStats{}
	}
	return r.Ops[o]
}

// Percentile returns the p-th percentile (0..100) of d.
func Percentile(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(float64(len(s)-1) * p / 100)
	return s[i]
}

type stream struct {
	rid, label string
	data       []uint64 // seed of each page's expected bytes, in order
	meta       [3]int64
}

type runner struct {
	cfg               Config
	rng               *rand.Rand
	buf, want, poison []byte // page-sized scratch
	dev               cudart.Device
	p                 *client.CPUPagePool
	k, v              cudart.DevicePtr
	res               *Result

	streams  []*stream
	held     int
	lastRTT  time.Duration
	capacity int
	nextRid  int
	mixing   bool // in the mixed phase
}

// Run opens a session, runs the deterministic checks and then cfg.Ops mixed
// operations (or until cfg.Duration). It returns an error at the first
// mismatch or unexpected outcome.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	cfg.defaults()
	uuid := cfg.Device
	if uuid == "" {
		if cfg.GPU < 0 {
			return nil, fmt.Errorf("workload: no GPU: Device is empty and GPU %d is negative", cfg.GPU)
		}
		uuid = cudart.SimulatedUUID(cfg.GPU)
	}
	r, err := open(ctx, cfg, uuid)
	if err != nil {
		return nil, err
	}
	defer r.dev.Close()
	defer r.p.Close()
	_, r.capacity, _ = r.p.Session()
	r.res.Capacity = r.capacity
	r.res.Locality = r.p.Locality()
	start := time.Now()
	if err := r.checks(); err != nil {
		return r.res, err
	}
	if err := r.mixed(ctx); err != nil {
		return r.res, err
	}
	r.res.Elapsed = time.Since(start)
	return r.res, nil
}

// open makes a simulated device of UUID uuid, its KV cache and a session
// on it.
func open(ctx context.Context, cfg Config, uuid string) (*runner, error) {
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1, UUIDs: []string{uuid},
		MemoryBytes: 2*uint64(cfg.DevicePages)*cfg.PageBytes + 1<<20, CopyDelay: cfg.CopyDelay})
	dev, err := sim.Open(0)
	if err != nil {
		return nil, err
	}
	r := &runner{cfg: cfg, rng: rand.New(rand.NewPCG(cfg.Seed, 0x6b76)), dev: dev, res: &Result{Ops: map[Op]*OpStats{}, Device: uuid},
		buf: make([]byte, 2*cfg.PageBytes), want: make([]byte, 2*cfg.PageBytes), poison: bytes.Repeat([]byte{0xA5}, int(2*cfg.PageBytes))}
	size := uint64(cfg.DevicePages) * cfg.PageBytes
	if r.k, err = dev.MemAlloc(size); err != nil {
		dev.Close()
		return nil, err
	}
	if r.v, err = dev.MemAlloc(size); err != nil {
		dev.Close()
		return nil, err
	}
	r.p, err = client.Open(ctx, client.Options{
		Socket: cfg.Socket, Token: cfg.Token, Device: dev, MaxPages: max(cfg.MaxPages, 0), Ranks: cfg.Ranks, InstanceID: cfg.InstanceID,
		Name: "kvpool-workload", Logger: cfg.Logger,
		Regions: []cudart.Region{
			{Base: r.k, Stride: cfg.PageBytes, PageBytes: cfg.PageBytes, Pages: cfg.DevicePages},
			{Base: r.v, Stride: cfg.PageBytes, PageBytes: cfg.PageBytes, Pages: cfg.DevicePages},
		},
		Trace: func(op wire.Op, d time.Duration) { r.lastRTT = d },
	})
	if err != nil {
		dev.Close()
		return nil, err
	}
	return r, nil
}

func (r *runner) probe(before bool) {
	if r.cfg.Probe != nil && r.mixing {
		r.cfg.Probe(before)
	}
}

func (r *runner) failf(format string, args ...any) error {
	r.res.Mismatches++
	return fmt.Errorf("workload: "+format, args...)
}

func (r *runner) ok() { r.res.Checks++ }

// devPages returns n distinct random device pages.
func (r *runner) devPages(n int) []int32 {
	perm := r.rng.Perm(r.cfg.DevicePages)[:n]
	out := make([]int32, n)
	for i, p := range perm {
		out[i] = int32(p)
	}
	return out
}

func (r *runner) pageAddr(p int32) (cudart.DevicePtr, cudart.DevicePtr) {
	off := cudart.DevicePtr(uint64(p) * r.cfg.PageBytes)
	return r.k + off, r.v + off
}

func (r *runner) writePage(p int32, b []byte) error {
	k, v := r.pageAddr(p)
	if err := r.dev.MemcpyHtoD(k, b[:r.cfg.PageBytes]); err != nil {
		return err
	}
	return r.dev.MemcpyHtoD(v, b[r.cfg.PageBytes:])
}

// pageBytes fills b with the random bytes of seed.
func pageBytes(b []byte, seed uint64) {
	var key [32]byte
	for i := range 8 {
		key[i] = byte(seed >> (8 * i))
	}
	rand.NewChaCha8(key).Read(b)
}

func (r *runner) readPage(p int32) ([]byte, error) {
	b := r.buf
	k, v := r.pageAddr(p)
	if err := r.dev.MemcpyDtoH(b[:r.cfg.PageBytes], k); err != nil {
		return nil, err
	}
	return b, r.dev.MemcpyDtoH(b[r.cfg.PageBytes:], v)
}

// sync orders the engine's (default) stream behind the pool's copies and
// waits for it, timing the wait as copy time.
func (r *runner) sync(o Op) error {
	start := time.Now()
	if err := r.p.Sync(0); err != nil {
		return err
	}
	if err := r.dev.StreamSynchronize(0); err != nil {
		return err
	}
	st := r.res.op(o)
	st.Copy = append(st.Copy, time.Since(start))
	return nil
}

func (r *runner) free() (int, error) { return r.p.NumFreePages() }

// offload fills n random device pages with random bytes and offloads them.
func (r *runner) offload(rid, label string, n int) (*stream, bool, error) {
	pages := r.devPages(n)
	s := &stream{rid: rid, label: label, meta: [3]int64{r.rng.Int64N(1 << 20), r.rng.Int64N(1 << 20), r.rng.Int64N(8)}}
	for _, p := range pages {
		seed := r.rng.Uint64()
		b := r.want
		pageBytes(b, seed)
		if err := r.writePage(p, b); err != nil {
			return nil, false, err
		}
		s.data = append(s.data, seed)
	}
	r.probe(true)
	ok, err := r.p.OffloadStream(rid, label, pages, s.meta[0], s.meta[1], s.meta[2])
	r.probe(false)
	st := r.res.op("offload")
	st.Count++
	st.RoundTrip = append(st.RoundTrip, r.lastRTT)
	if err != nil || !ok {
		return nil, ok, err
	}
	if err := r.sync("offload"); err != nil {
		return nil, false, err
	}
	st.Bytes += int64(n) * 2 * int64(r.cfg.PageBytes)
	// The engine reuses the device pages: poison them.
	for _, p := range pages {
		if err := r.writePage(p, r.poison); err != nil {
			return nil, false, err
		}
	}
	r.streams = append(r.streams, s)
	r.held += n
	return s, true, nil
}

// reload reloads stream i onto fresh random device pages and compares.
func (r *runner) reload(i int) error {
	s := r.streams[i]
	pages := r.devPages(len(s.data))
	r.probe(true)
	got, err := r.p.ReloadStream(s.rid, s.label, pages)
	r.probe(false)
	st := r.res.op("reload")
	st.Count++
	st.RoundTrip = append(st.RoundTrip, r.lastRTT)
	if err != nil {
		return err
	}
	r.dropStream(i)
	if err := r.sync("reload"); err != nil {
		return err
	}
	st.Bytes += int64(len(pages)) * 2 * int64(r.cfg.PageBytes)
	if got.StoredLen != s.meta[0] || got.Position != s.meta[1] || got.Released != s.meta[2] || len(got.CPUPageIndices) != len(pages) {
		return r.failf("reload %s/%s: metadata %+v, want %v and %d pages", s.rid, s.label, got, s.meta, len(pages))
	}
	for j, p := range pages {
		b, err := r.readPage(p)
		if err != nil {
			return err
		}
		pageBytes(r.want, s.data[j])
		if !bytes.Equal(b, r.want) {
			return r.failf("reload %s/%s: device page %d (stream page %d) differs from what was offloaded", s.rid, s.label, p, j)
		}
	}
	r.ok()
	return nil
}

func (r *runner) dropStream(i int) {
	r.held -= len(r.streams[i].data)
	r.streams = slices.Delete(r.streams, i, i+1)
}

func (r *runner) expectFree(what string) error {
	n, err := r.free()
	if err != nil {
		return err
	}
	if n != r.capacity-r.held {
		return r.failf("%s: num_free_pages %d, want %d", what, n, r.capacity-r.held)
	}
	r.ok()
	return nil
}

func (r *runner) rid() string {
	r.nextRid++
	return fmt.Sprintf("req-%d-%d", r.cfg.Seed%1000, r.nextRid)
}

// checks runs the deterministic part: round trip, labels, discard,
// remove_request, pool full.
func (r *runner) checks() error {
	if err := r.checkStreams(); err != nil {
		return err
	}
	return r.checkFull()
}

// checkStreams: round trip, labels, num_pages, discard, is_offloaded and
// remove_request, the free count after each.
func (r *runner) checkStreams() error {
	if err := r.expectFree("fresh session"); err != nil {
		return err
	}
	a := r.rid()
	if _, ok, err := r.offload(a, "k0", 4); err != nil || !ok {
		return fmt.Errorf("workload: first offload: ok %v: %w", ok, err)
	}
	if _, ok, err := r.offload(a, "k1", 3); err != nil || !ok {
		return fmt.Errorf("workload: second offload: ok %v: %w", ok, err)
	}
	labels, err := r.p.Labels(a)
	if err != nil {
		return err
	}
	if !slices.Equal(labels, []string{"k0", "k1"}) {
		return r.failf("labels %q, want [k0 k1]", labels)
	}
	if n, err := r.p.NumPages(a, "k1"); err != nil || n != 3 {
		return r.failf("num_pages %d %v, want 3", n, err)
	}
	if err := r.expectFree("after two offloads"); err != nil {
		return err
	}
	// Discard returns the pages at once.
	if err := r.p.Discard(a, "k1"); err != nil {
		return err
	}
	r.dropStream(1)
	if err := r.expectFree("after discard"); err != nil {
		return err
	}
	if err := r.reload(0); err != nil {
		return err
	}
	if off, err := r.p.IsOffloaded(a); err != nil || off {
		return r.failf("is_offloaded after the last reload: %v %v", off, err)
	}
	// remove_request drops every label of a request.
	b := r.rid()
	for _, l := range []string{"x", "y", "z"} {
		if _, ok, err := r.offload(b, l, 2); err != nil || !ok {
			return fmt.Errorf("workload: offload %s: ok %v: %w", l, ok, err)
		}
	}
	if err := r.p.RemoveRequest(b); err != nil {
		return err
	}
	r.streams = r.streams[:0]
	r.held = 0
	if err := r.p.Synchronize(); err != nil {
		return err
	}
	return r.expectFree("after remove_request")
}

// checkFull fills the pool: the offload that does not fit returns false
// and changes nothing; then it reloads everything back, verifying, in
// random order.
func (r *runner) checkFull() error {
	n := max(1, min(r.cfg.MaxStream, r.capacity/4+1))
	for {
		before := r.capacity - r.held
		rid := r.rid()
		_, ok, err := r.offload(rid, "fill", n)
		if err != nil {
			return err
		}
		if !ok {
			r.res.FullRejects++
			if before >= n {
				return r.failf("offload of %d pages refused with %d free", n, before)
			}
			if err := r.expectFree("after a refused offload"); err != nil {
				return err
			}
			if off, err := r.p.IsOffloaded(rid); err != nil || off {
				return r.failf("a refused offload left request %s: %v %v", rid, off, err)
			}
			break
		}
	}
	for len(r.streams) > 0 {
		if err := r.reload(r.rng.IntN(len(r.streams))); err != nil {
			return err
		}
	}
	return r.expectFree("after reloading everything")
}

// mixed runs random operations, checking the bytes of every reload and the
// free page count along the way.
func (r *runner) mixed(ctx context.Context) error {
	r.mixing = true
	deadline := time.Time{}
	if r.cfg.Duration > 0 {
		deadline = time.Now().Add(r.cfg.Duration)
	}
	for i := 0; ; i++ {
		if r.cfg.Ops > 0 && i >= r.cfg.Ops {
			break
		}
		if !deadline.IsZero() && time.Now().After(deadline) {
			break
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if r.cfg.Progress != nil && i%100 == 0 {
			r.cfg.Progress(i)
		}
		switch x := r.rng.IntN(100); {
		case x < 45 || len(r.streams) == 0:
			n := 1 + r.rng.IntN(r.cfg.MaxStream)
			before := r.capacity - r.held
			_, ok, err := r.offload(r.rid(), "kv", n)
			if err != nil {
				return err
			}
			if !ok {
				r.res.FullRejects++
				if before >= n {
					return r.failf("offload of %d pages refused with %d free", n, before)
				}
			}
		case x < 85:
			if err := r.reload(r.rng.IntN(len(r.streams))); err != nil {
				return err
			}
		case x < 92:
			i := r.rng.IntN(len(r.streams))
			s := r.streams[i]
			r.probe(true)
			if err := r.p.Discard(s.rid, s.label); err != nil {
				return err
			}
			r.probe(false)
			st := r.res.op("discard")
			st.Count++
			st.RoundTrip = append(st.RoundTrip, r.lastRTT)
			r.dropStream(i)
		default:
			i := r.rng.IntN(len(r.streams))
			r.probe(true)
			if err := r.p.RemoveRequest(r.streams[i].rid); err != nil {
				return err
			}
			r.probe(false)
			st := r.res.op("remove_request")
			st.Count++
			st.RoundTrip = append(st.RoundTrip, r.lastRTT)
			r.dropStream(i)
		}
		if i%50 == 0 {
			if err := r.expectFree("mixed"); err != nil {
				return err
			}
		}
	}
	return r.expectFree("end of mixed workload")
}

// Summary is one line per operation, for logs.
func (r *Result) Summary() string {
	var keys []string
	for k := range r.Ops {
		keys = append(keys, string(k))
	}
	sort.Strings(keys)
	var b bytes.Buffer
	for _, k := range keys {
		st := r.Ops[Op(k)]
		fmt.Fprintf(&b, "%s: %d calls, round trip p50 %v p99 %v, copy p50 %v; ", k, st.Count,
			Percentile(st.RoundTrip, 50), Percentile(st.RoundTrip, 99), Percentile(st.Copy, 50))
	}
	fmt.Fprintf(&b, "full rejects %d, checks %d, mismatches %d", r.FullRejects, r.Checks, r.Mismatches)
	return b.String()
}
