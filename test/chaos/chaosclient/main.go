// Command chaosclient is one client process of the restart chaos test
// (test/chaos): it offloads streams of random bytes, keeps a checksum of
// every stream it believes the agent holds, reloads and verifies them,
// while the harness kills and restarts the agent under it. It runs until
// its stdin closes, then reloads and verifies every stream it still holds
// and prints a JSON Result on stdout.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"sync/atomic"
	"time"

	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/poolerr"
	"github.com/kvpool/kvpool/pkg/wire"
)

// Result is what a client reports.
type Result struct {
	Ops, Offloads, Refused, Reloads, Removes, Checks int
	Lost                                             int      // streams the agent no longer knows
	Corrupt                                          int      // streams whose bytes or metadata came back wrong
	Errors                                           []string // unexpected errors (the first 20)
	ErrorCount                                       int
	Final                                            int     // streams verified at the end
	SlowCalls                                        int     // calls that took over 100 ms (they waited for a restart)
	LongestCall                                      float64 // seconds
	Sessions                                         int     // distinct session IDs seen (1: the session was never lost)
	LongOffloads                                     int     // offloads longer than one packet's page list (--long)
}

// The device layout: two regions (K and V) of devicePages pages of
// pageBytes each. --long makes pages small and the device large enough for
// streams longer than one packet's page list (wire.MaxPagesPerPacket).
var (
	pageBytes   = 4096
	devicePages = 64
	long        bool
)

type stream struct {
	rid, label string
	n          int
	sum        [32]byte
	meta       [3]int64
}

type runner struct {
	p    *client.CPUPagePool
	dev  cudart.Device
	k, v cudart.DevicePtr
	rng  *rand.Rand
	res  Result
	held []*stream
	next int
	ids  map[uint64]bool
}

func main() {
	socket := flag.String("socket", "", "agent socket")
	token := flag.String("token", "", "allocation token")
	gpu := flag.Int("gpu", 0, "GPU ordinal")
	seed := flag.Uint64("seed", 1, "random seed")
	flag.BoolVar(&long, "long", false, "small pages, and one offload in four longer than one packet's page list")
	flag.Parse()
	if long {
		pageBytes, devicePages = 64, wire.MaxPagesPerPacket+6000
	}
	if err := run(*socket, *token, *gpu, *seed); err != nil {
		fmt.Fprintln(os.Stderr, "chaosclient:", err)
		os.Exit(1)
	}
}

func run(socket, token string, gpu int, seed uint64) error {
	sim := cudart.NewSim(cudart.SimOptions{Devices: gpu + 1, MemoryBytes: uint64(2*devicePages*pageBytes + 1<<20)})
	dev, err := sim.Open(gpu)
	if err != nil {
		return err
	}
	r := &runner{dev: dev, rng: rand.New(rand.NewPCG(seed, 99)), ids: map[uint64]bool{}}
	if r.k, err = dev.MemAlloc(uint64(devicePages * pageBytes)); err != nil {
		return err
	}
	if r.v, err = dev.MemAlloc(uint64(devicePages * pageBytes)); err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	r.p, err = client.Open(context.Background(), client.Options{Socket: socket, Token: token, Device: dev, Logger: log,
		Name: "chaosclient", RetryFor: 30 * time.Second,
		Regions: []cudart.Region{
			{Base: r.k, Stride: uint64(pageBytes), PageBytes: uint64(pageBytes), Pages: devicePages},
			{Base: r.v, Stride: uint64(pageBytes), PageBytes: uint64(pageBytes), Pages: devicePages},
		}})
	if err != nil {
		return err
	}
	var stop atomic.Bool
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin) // until the parent closes it: EOF or an error both mean stop
		stop.Store(true)
	}()
	for !stop.Load() {
		r.step()
	}
	for len(r.held) > 0 {
		r.reload(0)
		r.res.Final++
	}
	r.res.Sessions = len(r.ids)
	if err := r.p.Close(); err != nil {
		r.fail("close: %v", err)
	}
	return json.NewEncoder(os.Stdout).Encode(r.res)
}

func (r *runner) fail(format string, args ...any) {
	r.res.ErrorCount++
	if len(r.res.Errors) < 20 {
		r.res.Errors = append(r.res.Errors, fmt.Sprintf(format, args...))
	}
}

// timed runs f and notes calls that waited for an agent restart.
func (r *runner) timed(f func()) {
	start := time.Now()
	f()
	d := time.Since(start)
	if d > 100*time.Millisecond {
		r.res.SlowCalls++
	}
	r.res.LongestCall = max(r.res.LongestCall, d.Seconds())
	id, _, _ := r.p.Session()
	r.ids[id] = true
}

func (r *runner) devPages(n int) []int32 {
	out := make([]int32, n)
	for i, p := range r.rng.Perm(devicePages)[:n] {
		out[i] = int32(p)
	}
	return out
}

// checksum reads the device pages (both regions) and hashes them in order.
func (r *runner) checksum(pages []int32) ([32]byte, error) {
	h := sha256.New()
	buf := make([]byte, pageBytes)
	for _, p := range pages {
		for _, base := range []cudart.DevicePtr{r.k, r.v} {
			if err := r.dev.MemcpyDtoH(buf, base+cudart.DevicePtr(uint64(p)*uint64(pageBytes))); err != nil {
				return [32]byte{}, err
			}
			h.Write(buf)
		}
	}
	var sum [32]byte
	copy(sum[:], h.Sum(nil))
	return sum, nil
}

func (r *runner) sync() error {
	if err := r.p.Sync(0); err != nil {
		return err
	}
	return r.dev.StreamSynchronize(0)
}

func (r *runner) step() {
	r.res.Ops++
	switch x := r.rng.IntN(10); {
	case x < 5 || len(r.held) == 0:
		r.offload()
	case x < 8:
		r.reload(r.rng.IntN(len(r.held)))
	case x < 9:
		r.remove(r.rng.IntN(len(r.held)))
	default:
		r.check(r.rng.IntN(len(r.held)))
	}
}

func (r *runner) offload() {
	r.next++
	n := 1 + r.rng.IntN(8)
	if long && r.rng.IntN(4) == 0 {
		n = wire.MaxPagesPerPacket + 1 + r.rng.IntN(devicePages-wire.MaxPagesPerPacket)
	}
	s := &stream{rid: fmt.Sprintf("req-%d", r.next), label: "kv", n: n,
		meta: [3]int64{r.rng.Int64N(1 << 20), r.rng.Int64N(1 << 20), r.rng.Int64N(8)}}
	pages := r.devPages(s.n)
	data := make([]byte, pageBytes)
	for _, p := range pages {
		for _, base := range []cudart.DevicePtr{r.k, r.v} {
			for i := range data {
				data[i] = byte(r.rng.Uint32())
			}
			if err := r.dev.MemcpyHtoD(base+cudart.DevicePtr(uint64(p)*uint64(pageBytes)), data); err != nil {
				r.fail("write device: %v", err)
				return
			}
		}
	}
	sum, err := r.checksum(pages)
	if err != nil {
		r.fail("checksum: %v", err)
		return
	}
	s.sum = sum
	var ok bool
	r.timed(func() { ok, err = r.p.OffloadStream(s.rid, s.label, pages, s.meta[0], s.meta[1], s.meta[2]) })
	if err != nil {
		r.fail("offload %s: %v", s.rid, err)
		return
	}
	if !ok {
		// Full, or the agent was unavailable past the bound: as the engine
		// does, discard what may have been claimed.
		r.res.Refused++
		// The agent may be the reason it was refused (killed): a failed
		// discard is no error of the pool's, the next session starts clean.
		_ = r.p.Discard(s.rid, s.label)
		return
	}
	if err := r.sync(); err != nil {
		r.fail("sync: %v", err)
		return
	}
	r.res.Offloads++
	if s.n > wire.MaxPagesPerPacket {
		r.res.LongOffloads++
	}
	r.held = append(r.held, s)
}

func (r *runner) take(i int) *stream {
	s := r.held[i]
	r.held[i] = r.held[len(r.held)-1]
	r.held = r.held[:len(r.held)-1]
	return s
}

func (r *runner) reload(i int) {
	s := r.take(i)
	// Poison the target pages first, so stale device bytes cannot pass.
	dst := r.devPages(s.n)
	poison := make([]byte, pageBytes)
	for j := range poison {
		poison[j] = 0xA5
	}
	for _, p := range dst {
		for _, base := range []cudart.DevicePtr{r.k, r.v} {
			if err := r.dev.MemcpyHtoD(base+cudart.DevicePtr(uint64(p)*uint64(pageBytes)), poison); err != nil {
				r.fail("poison device page %d: %v", p, err)
				return
			}
		}
	}
	var got client.OffloadedStream
	var err error
	r.timed(func() { got, err = r.p.ReloadStream(s.rid, s.label, dst) })
	if errors.Is(err, poolerr.ErrUnknownStream) {
		r.res.Lost++
		r.fail("reload %s: lost: %v", s.rid, err)
		return
	}
	if err != nil {
		r.fail("reload %s: %v", s.rid, err)
		return
	}
	if err := r.sync(); err != nil {
		r.fail("sync: %v", err)
		return
	}
	r.res.Reloads++
	sum, err := r.checksum(dst)
	if err != nil {
		r.fail("checksum: %v", err)
		return
	}
	if sum != s.sum || len(got.CPUPageIndices) != s.n || got.StoredLen != s.meta[0] || got.Position != s.meta[1] || got.Released != s.meta[2] {
		r.res.Corrupt++
		r.fail("reload %s: bytes or metadata differ (meta %d/%d/%d, want %v)", s.rid, got.StoredLen, got.Position, got.Released, s.meta)
	}
	// Some reloads are done twice over the wire by a restart: the second
	// must have found the stream gone.
	var off bool
	r.timed(func() { off, err = r.p.IsOffloaded(s.rid) })
	if err != nil || off {
		r.fail("after reload %s: offloaded %v, %v", s.rid, off, err)
	}
}

func (r *runner) remove(i int) {
	s := r.take(i)
	var err error
	r.timed(func() { err = r.p.RemoveRequest(s.rid) })
	if err != nil {
		r.fail("remove %s: %v", s.rid, err)
		return
	}
	r.res.Removes++
}

func (r *runner) check(i int) {
	s := r.held[i]
	var n int
	var err error
	r.timed(func() { n, err = r.p.NumPages(s.rid, s.label) })
	if errors.Is(err, poolerr.ErrUnknownStream) {
		r.take(i)
		r.res.Lost++
		r.fail("num_pages %s: lost", s.rid)
		return
	}
	if err != nil || n != s.n {
		r.fail("num_pages %s: %d, %v; want %d", s.rid, n, err, s.n)
		return
	}
	r.res.Checks++
}
