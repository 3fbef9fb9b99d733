//go:build cgo

package cudart

// Tests on a real GPU. They skip, saying why, where no driver loads or no
// device answers; with KVPOOL_GPU_REQUIRED=1 they fail instead (the device
// check script sets it after its probe found a GPU). TestGPUBandwidth
// measures only with KVPOOL_GPU_BENCH=1. hack/gpu/check.sh runs them all.

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/hostmem"
)

// gpuPath is one way the real backend moves a batch.
type gpuPath struct {
	name              string
	noBatch, noKernel bool
}

// gpuPaths: the copy kernel with the batch call beside it (the default),
// the batch call alone, and one cuMemcpyAsync per run.
var gpuPaths = []gpuPath{{"kernel", false, false}, {"batch", false, true}, {"async", true, true}}

func gpuDevice(t testing.TB, p gpuPath) (Device, Choice) {
	t.Helper()
	drv, ch, err := Load(Options{Backend: BackendCUDA, NoBatch: p.noBatch, NoKernel: p.noKernel, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		if os.Getenv("KVPOOL_GPU_REQUIRED") == "1" {
			t.Fatalf("KVPOOL_GPU_REQUIRED=1 but: %v", err)
		}
		t.Skipf("no GPU: %v", err)
	}
	dev, err := drv.Open(0)
	if err != nil {
		t.Fatalf("open device 0: %v", err)
	}
	t.Cleanup(func() {
		if err := dev.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	return dev, ch
}

// TestGPUProbe prints one line the check script reads: whether a GPU
// answers, and the choice's reason.
func TestGPUProbe(t *testing.T) {
	_, ch, err := Load(Options{Backend: BackendCUDA, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		fmt.Printf("GPU-PROBE: skip: %v\n", err)
		t.Skipf("no GPU: %v", err)
	}
	fmt.Printf("GPU-PROBE: ok: %s; library %s; batch ABI %d\n", ch.Reason, ch.Library, ch.BatchABI)
}

var gpuPageSizes = []uint64{16 << 10, 32 << 10, 64 << 10, 256 << 10, 2 << 20}

// TestGPURoundTrip runs the round-trip scenario on the GPU for every page
// size, dense, strided and split (K+V) layouts, through the copy kernel
// (pages of 32 KiB and less; larger ones go to the batch call beside it),
// the batch call alone and the per-run fallback.
func TestGPURoundTrip(t *testing.T) {
	for _, p := range gpuPaths {
		dev, ch := gpuDevice(t, p)
		path := p.name
		if p.name == "batch" {
			path = fmt.Sprintf("batch%d", ch.BatchABI)
		}
		for i, size := range gpuPageSizes {
			for _, lc := range []layoutCase{
				{"dense", size, 1, 0},
				{"strided", size / 2, 1, size / 2},
				{"k+v", size / 2, 2, 0},
			} {
				t.Run(path+"/"+lc.String(), func(t *testing.T) {
					// Enough device pages to scatter 64 of them twice, and
					// at most ~128 MiB per region.
					pages := max(160, min(256, int((128<<20)/(lc.pageBytes+lc.gap))))
					scenarioRoundTrip(t, dev, lc, pages, 96, 64, uint64(i)*7+uint64(len(lc.name)))
				})
			}
		}
		// 64 regions of 4 KiB pages: 4,096 copies a batch, which go to
		// the driver in pieces (batchPiece).
		lc := layoutCase{"64 regions", 4 << 10, 64, 0}
		t.Run(path+"/"+lc.String(), func(t *testing.T) { scenarioRoundTrip(t, dev, lc, 160, 96, 64, 99) })
		t.Run(path+"/back-to-back", func(t *testing.T) {
			for i, size := range gpuPageSizes {
				scenarioBackToBack(t, dev, size, 64, uint64(i))
			}
		})
		t.Run(path+"/done", func(t *testing.T) { scenarioDone(t, dev, 2<<20) })
		if loaded, err := dev.(*cudaDevice).kernel.state(); loaded == p.noKernel {
			t.Errorf("%s: copy kernel loaded %v (%v)", path, loaded, err)
		}
	}
}

// TestGPUCopyKernelSizes moves runs of every length the copy kernel's
// loops treat differently (one vector, a partial block, the four-vector
// loop and its tail, up to copyKernelMaxRun), at random offsets, in one
// batch each way among unaligned runs and large ones that go to the copy
// engine beside it, onto poisoned memory: every byte of each run lands and
// no byte around it changes.
func TestGPUCopyKernelSizes(t *testing.T) {
	dev, _ := gpuDevice(t, gpuPaths[0])
	const size = 16 << 20 // 64 slots (below) for 59 runs
	r := rand.New(rand.NewPCG(31, 32))
	lengths := []int{16, 32, 48, 4080, 4096, 4112, 12272, 12288, 12304, 16368, 16384, 16400, 28688, 32752, 32768}
	for range 40 {
		lengths = append(lengths, 16*(1+r.IntN(copyKernelMaxRun/16)))
	}
	// Not for the kernel: unaligned, odd-length, and 64 KiB runs.
	lengths = append(lengths, 100, 4097, 65536, 200000)
	host, back := newPinned(t, dev, size), newPinned(t, dev, size)
	copy(host.b, randBytes(size, 33))
	fill(back.b, 0xA5)
	dp, err := dev.MemAlloc(size)
	must(t, err)
	defer dev.MemFree(dp)
	must(t, dev.MemcpyHtoD(dp, bytes.Repeat([]byte{0x5A}, size)))
	s, err := dev.StreamCreate()
	must(t, err)
	defer dev.StreamDestroy(s)
	// Each run gets its own slot of 256 KiB on both sides (shuffled), at a
	// random 16-byte offset in it (or an odd one for the odd runs).
	const slot = 256 << 10
	devSlot, hostSlot := r.Perm(size/slot), r.Perm(size/slot)
	var in, out []Copy
	want, wantDev := bytes.Repeat([]byte{0xA5}, size), bytes.Repeat([]byte{0x5A}, size)
	for i, n := range lengths {
		off := 16 * r.IntN((slot-n)/16)
		if n%16 != 0 {
			off++
		}
		d, h := devSlot[i]*slot+off, hostSlot[i]*slot+off
		in = append(in, Copy{Dst: uintptr(dp) + uintptr(d), Src: addr(host.b[h:]), Bytes: uint64(n)})
		out = append(out, Copy{Dst: addr(back.b[h:]), Src: uintptr(dp) + uintptr(d), Bytes: uint64(n)})
		copy(want[h:h+n], host.b[h:h+n])
		copy(wantDev[d:d+n], host.b[h:h+n])
	}
	// The offload reads what the reload wrote: the same stream orders them.
	must(t, dev.MemcpyBatchAsync(in, HostToDevice, s))
	must(t, dev.MemcpyBatchAsync(out, DeviceToHost, s))
	must(t, dev.StreamSynchronize(s))
	checkKernelCopies(t, dev, dp, wantDev, back.b, want)
}

// checkKernelCopies checks the device memory at dp against wantDev (what
// the reloads wrote) and host against want (what the offloads wrote), and
// that the copy kernel moved them.
func checkKernelCopies(t *testing.T, dev Device, dp DevicePtr, wantDev, host, want []byte) {
	t.Helper()
	gotDev := make([]byte, len(wantDev))
	must(t, dev.MemcpyDtoH(gotDev, dp))
	if i := firstDiff(gotDev, wantDev); i >= 0 {
		t.Fatalf("HtoD: device byte %d is %#x, want %#x", i, gotDev[i], wantDev[i])
	}
	if i := firstDiff(host, want); i >= 0 {
		t.Fatalf("DtoH: host byte %d is %#x, want %#x", i, host[i], want[i])
	}
	if loaded, err := dev.(*cudaDevice).kernel.state(); !loaded {
		t.Fatalf("the copy kernel was not used: %v", err)
	}
}

// TestGPUCopyKernelBothWays runs the copy kernel in both directions at
// once, on two streams (an offload and a reload overlapping, as a Mover's
// do): 2,048 pages of 16 KiB each way, scattered, onto poisoned memory.
func TestGPUCopyKernelBothWays(t *testing.T) {
	dev, _ := gpuDevice(t, gpuPaths[0])
	const page, n = 16 << 10, 2048
	const half = 2 * n * page // device: pages to reload into, then pages to offload from
	host, back := newPinned(t, dev, n*page), newPinned(t, dev, n*page)
	copy(host.b, randBytes(n*page, 41))
	fill(back.b, 0xA5)
	dp, err := dev.MemAlloc(2 * half)
	must(t, err)
	defer dev.MemFree(dp)
	devData := randBytes(half, 42)
	must(t, dev.MemcpyHtoD(dp, bytes.Repeat([]byte{0x5A}, half)))
	must(t, dev.MemcpyHtoD(dp+half, devData))
	r := rand.New(rand.NewPCG(43, 44))
	hostPerm, devPerm := r.Perm(n), r.Perm(2 * n)[:n]
	var in, out []Copy
	for i := range n {
		// Reload host page i to device page devPerm[i] of the first half;
		// offload device page devPerm[i] of the second half to back page
		// hostPerm[i].
		d := uintptr(dp) + uintptr(devPerm[i]*page)
		in = append(in, Copy{Dst: d, Src: addr(host.b[i*page:]), Bytes: page})
		out = append(out, Copy{Dst: addr(back.b[hostPerm[i]*page:]), Src: d + half, Bytes: page})
	}
	s1, err := dev.StreamCreate()
	must(t, err)
	defer dev.StreamDestroy(s1)
	s2, err := dev.StreamCreate()
	must(t, err)
	defer dev.StreamDestroy(s2)
	for range 4 { // the same batches again, overlapping each other too
		must(t, dev.MemcpyBatchAsync(in, HostToDevice, s1))
		must(t, dev.MemcpyBatchAsync(out, DeviceToHost, s2))
	}
	must(t, dev.StreamSynchronize(s1))
	must(t, dev.StreamSynchronize(s2))
	wantDev := bytes.Repeat([]byte{0x5A}, half)
	want := make([]byte, n*page)
	for i := range n {
		copy(wantDev[devPerm[i]*page:], host.b[i*page:(i+1)*page])
		copy(want[hostPerm[i]*page:], devData[devPerm[i]*page:(devPerm[i]+1)*page])
	}
	checkKernelCopies(t, dev, dp, wantDev, back.b, want)
}

// TestGPUEventOrdering makes the engine's stream wait for a long copy
// through Sync and checks that work queued behind it on the engine's stream
// does not run before the copy has finished.
func TestGPUEventOrdering(t *testing.T) {
	dev, _ := gpuDevice(t, gpuPaths[0])
	const big = 512 << 20
	dp, err := dev.MemAlloc(big)
	must(t, err)
	defer dev.MemFree(dp)
	host := newPinned(t, dev, big)
	fill(host.b, 0x3C)
	m, err := NewMover(dev)
	must(t, err)
	defer m.Close()
	engine, err := dev.StreamCreate()
	must(t, err)
	must1(t)(m.Reload(engine, []Copy{{Dst: uintptr(dp), Src: addr(host.b), Bytes: big}}))
	must(t, m.Sync(engine))
	ran := make(chan bool, 1)
	// The host function sees the last byte of the reload only if the
	// engine's stream really waited for it.
	last := newPinned(t, dev, 4096)
	fill(last.b, 0)
	must(t, dev.MemcpyBatchAsync([]Copy{{Dst: addr(last.b), Src: uintptr(dp) + big - 4096, Bytes: 4096}}, DeviceToHost, engine))
	must(t, dev.LaunchHostFunc(engine, func() { ran <- last.b[4095] == 0x3C }))
	select {
	case ok := <-ran:
		if !ok {
			t.Fatal("work behind Sync on the engine's stream ran before the reload completed")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("host function never ran")
	}
}

// bench helpers

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// timeIt runs fn (which enqueues and waits) runs times after one warm-up
// and returns the median bytes per second.
func timeIt(t *testing.T, runs int, bytes uint64, fn func() error) float64 {
	must(t, fn())
	var rates []float64
	for i := 0; i < runs; i++ {
		start := time.Now()
		must(t, fn())
		rates = append(rates, float64(bytes)/time.Since(start).Seconds())
	}
	return median(rates)
}

// timeBatches enqueues reps batches with enqueue(i), waits with wait, runs
// times after one warm-up, and returns the median bytes per second and the
// median host time spent enqueuing one batch.
func timeBatches(t *testing.T, runs, reps int, bytes uint64, enqueue func(i int) error, wait func() error) (float64, time.Duration) {
	var rates []float64
	var enq []float64
	for r := -1; r < runs; r++ {
		start := time.Now()
		for i := 0; i < reps; i++ {
			must(t, enqueue(i))
		}
		queued := time.Since(start)
		must(t, wait())
		if r >= 0 {
			rates = append(rates, float64(bytes)/time.Since(start).Seconds())
			enq = append(enq, float64(queued)/float64(reps))
		}
	}
	return median(rates), time.Duration(median(enq))
}

// TestGPUBandwidth measures scattered pages against one large pinned copy
// in the same run, for both copy paths, each direction and both at once,
// and host registration time per GiB. It prints a table last and writes
// it to $KVPOOL_GPU_REPORT when set.
func TestGPUBandwidth(t *testing.T) {
	if os.Getenv("KVPOOL_GPU_BENCH") != "1" {
		t.Skip("set KVPOOL_GPU_BENCH=1 to measure")
	}
	const (
		poolBytes = 1 << 30 // device and host pools
		batch     = 64      // pages per batch
		runs      = 7
	)
	// Bytes moved per timed run: 1 GiB, or $KVPOOL_GPU_BENCH_MIB (a dry
	// run against the fake driver uses a little).
	minBytes := 1 << 30
	if v, err := strconv.Atoi(os.Getenv("KVPOOL_GPU_BENCH_MIB")); err == nil && v > 0 {
		minBytes = v << 20
	}
	var report strings.Builder
	out := func(format string, args ...any) {
		fmt.Fprintf(&report, format, args...)
	}
	// The table is printed and written even when a measurement fails
	// half-way, so one device run always returns what it measured.
	defer func() {
		table := report.String()
		fmt.Printf("\n%s\n", table)
		if p := os.Getenv("KVPOOL_GPU_REPORT"); p != "" {
			if err := os.WriteFile(p, []byte(table), 0o644); err != nil {
				t.Error(err)
			}
		}
	}()
	var notes []string // printed after the table
	defer func() {
		for _, n := range notes {
			out("\n%s\n", n)
		}
	}()
	// The fallback path first: if the batch path fails on some driver, the
	// table still has the floor and the fallback's rows; the copy kernel
	// last.
	for i, p := range []gpuPath{gpuPaths[2], gpuPaths[1], gpuPaths[0]} {
		dev, ch := gpuDevice(t, p)
		noBatch := p.noBatch || ch.BatchABI == 0
		path := fmt.Sprintf("batch (cuMemcpyBatchAsync %s)", FormatVersion(ch.BatchABI))
		switch {
		case noBatch:
			path = "async per run"
		case !p.noKernel:
			path = fmt.Sprintf("copy kernel (<= %d KiB; batch beside it)", copyKernelMaxRun>>10)
		}
		if i == 0 {
			out("device: %s; library %s\n\n", ch.Reason, ch.Library)
			// Registration of a memfd chunk mapped as a client maps it,
			// first touched page by page (faulting first and then
			// registering is the faster order), then cuMemHostRegister.
			const regBytes = 4 << 30
			chunk, err := hostmem.Alloc(hostmem.Options{Size: regBytes, Name: "cudart-bench"})
			must(t, err)
			b, err := hostmem.Map(chunk.File, regBytes)
			must(t, err)
			start := time.Now()
			for off := 0; off < regBytes; off += os.Getpagesize() {
				b[off] = 1
			}
			fault := time.Since(start)
			start = time.Now()
			must(t, dev.HostRegister(b))
			reg := time.Since(start)
			must(t, dev.HostUnregister(b))
			hostmem.Unmap(b)
			chunk.Close()
			out("registration: %.1f ms per GiB (cuMemHostRegister of a 4 GiB memfd chunk, one call; faulting it in first took %.1f ms per GiB)\n\n",
				reg.Seconds()*1000/4, fault.Seconds()*1000/4)
			out("| page | direction | path | GB/s | ratio to 1 GiB copy | enqueue µs/batch |\n| --- | --- | --- | --- | --- | --- |\n")
		}
		dp, err := dev.MemAlloc(poolBytes)
		must(t, err)
		host := newPinned(t, dev, poolBytes)
		if !p.noKernel {
			// The first batch with a small run loads the kernel's module
			// (the driver compiles the PTX): once a process, timed here.
			s, err := dev.StreamCreate()
			must(t, err)
			start := time.Now()
			must(t, dev.MemcpyBatchAsync([]Copy{{Dst: uintptr(dp), Src: addr(host.b), Bytes: 4096}}, HostToDevice, s))
			must(t, dev.StreamSynchronize(s))
			notes = append(notes, fmt.Sprintf("copy kernel: the first batch (module load, the driver compiling the PTX) took %.1f ms", time.Since(start).Seconds()*1000))
			must(t, dev.StreamDestroy(s))
		}
		seedBlock := randBytes(64<<20, 5)
		for off := 0; off < poolBytes; off += len(seedBlock) {
			copy(host.b[off:], seedBlock)
			must(t, dev.MemcpyHtoD(dp+DevicePtr(off), seedBlock))
		}
		s1, err := dev.StreamCreate()
		must(t, err)
		s2, err := dev.StreamCreate()
		must(t, err)

		// The floor: one contiguous 1 GiB pinned copy each way.
		floor := map[Direction]float64{}
		for _, dir := range []Direction{DeviceToHost, HostToDevice} {
			c := Copy{Dst: uintptr(dp), Src: addr(host.b), Bytes: poolBytes}
			if dir == DeviceToHost {
				c.Dst, c.Src = c.Src, c.Dst
			}
			floor[dir] = timeIt(t, runs, poolBytes, func() error {
				if err := dev.MemcpyBatchAsync([]Copy{c}, dir, s1); err != nil {
					return err
				}
				return dev.StreamSynchronize(s1)
			})
			out("| 1 GiB contiguous | %v | floor: one copy | %.1f | 1.00 | |\n", dir, floor[dir]/1e9)
		}

		r := rand.New(rand.NewPCG(11, 12))
		// scattered makes nb batches of k copies of size-byte pages: even
		// device pages and host pages of the pool's first half for half 0,
		// odd device pages and the second half for half 1, so no two
		// copies of a batch merge and the two directions at once touch
		// disjoint memory.
		scattered := func(size uint64, nb, k int, dir Direction, half int) [][]Copy {
			n := poolBytes / int(size)
			layout := Layout{Regions: []Region{{Base: dp, Stride: size, PageBytes: size, Pages: n}}}
			var bs [][]Copy
			for range nb {
				devIdx, hostIdx := pick(r, n/2, k), pick(r, n/4, k)
				ha := make([]uintptr, k)
				for i := range devIdx {
					devIdx[i] = 2*devIdx[i] + half
					ha[i] = addr(host.b[(2*hostIdx[i]+half*n/2)*int(size):])
				}
				c, err := layout.Copies(dir, devIdx, ha)
				must(t, err)
				bs = append(bs, c)
			}
			return bs
		}
		// oneWay times nb batches of k copies of size in rotation, one
		// direction on one stream.
		oneWay := func(size uint64, nb, k, reps int, moved uint64, dir Direction) (float64, time.Duration) {
			bs := scattered(size, nb, k, dir, 0)
			return timeBatches(t, runs, reps, moved,
				func(i int) error { return dev.MemcpyBatchAsync(bs[i%len(bs)], dir, s1) },
				func() error { return dev.StreamSynchronize(s1) })
		}
		// both times d2h and h2d batches enqueued together on two streams;
		// the rate is the aggregate of bytes.
		both := func(d2h, h2d [][]Copy, reps int, bytes uint64) (float64, time.Duration) {
			return timeBatches(t, runs, reps, bytes,
				func(i int) error {
					if err := dev.MemcpyBatchAsync(d2h[i%len(d2h)], DeviceToHost, s1); err != nil {
						return err
					}
					return dev.MemcpyBatchAsync(h2d[i%len(h2d)], HostToDevice, s2)
				},
				func() error {
					if err := dev.StreamSynchronize(s1); err != nil {
						return err
					}
					return dev.StreamSynchronize(s2)
				})
		}
		bothFloor := max(floor[DeviceToHost], floor[HostToDevice])
		for _, size := range gpuPageSizes {
			if !p.noKernel && size > copyKernelMaxRun {
				continue // the batch path's rows above
			}
			// 8 different batches in rotation.
			reps := max(16, minBytes/(batch*int(size)))
			moved := uint64(reps) * batch * size
			for _, dir := range []Direction{DeviceToHost, HostToDevice} {
				rate, enq := oneWay(size, 8, batch, reps, moved, dir)
				out("| %s | %v | %s | %.1f | %.2f | %.1f |\n", sizeName(size), dir, path, rate/1e9, rate/floor[dir], float64(enq.Nanoseconds())/1e3)
			}
			if size == 256<<10 {
				// Both directions at once: the aggregate against one
				// direction's floor.
				rate, enq := both(scattered(size, 8, batch, DeviceToHost, 0), scattered(size, 8, batch, HostToDevice, 1), reps, 2*moved)
				out("| %s | both at once | %s | %.1f | %.2f | %.1f |\n", sizeName(size), path, rate/1e9, rate/bothFloor, float64(enq.Nanoseconds())/2e3)
			}
		}
		if !noBatch {
			// Large batches of small pages (a layout of many regions per
			// page, or few heads per GPU): 4,096 copies a batch, which the
			// driver gets in pieces (batchPiece), the copy engine starting
			// on the first while the rest are enqueued; or the kernel gets
			// in three launches. Four batches in rotation.
			for _, size := range []uint64{4 << 10, 16 << 10, 32 << 10} {
				const big = 4096
				reps := max(4, minBytes/(big*int(size)))
				moved := uint64(reps) * big * size
				for _, dir := range []Direction{DeviceToHost, HostToDevice} {
					rate, enq := oneWay(size, 4, big, reps, moved, dir)
					out("| %s, %d a batch | %v | %s | %.1f | %.2f | %.1f |\n", sizeName(size), big, dir, path,
						rate/1e9, rate/floor[dir], float64(enq.Nanoseconds())/1e3)
				}
				if size == 16<<10 {
					// Does the kernel fill both directions of the link as
					// the copy engines do?
					rate, enq := both(scattered(size, 4, big, DeviceToHost, 0), scattered(size, 4, big, HostToDevice, 1), reps, 2*moved)
					out("| %s, %d a batch | both at once | %s | %.1f | %.2f | %.1f |\n", sizeName(size), big, path,
						rate/1e9, rate/bothFloor, float64(enq.Nanoseconds())/2e3)
				}
			}
		}
		must(t, dev.StreamDestroy(s1))
		must(t, dev.StreamDestroy(s2))
		must(t, dev.MemFree(dp))
	}
}

func sizeName(n uint64) string {
	if n >= 1<<20 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d KiB", n>>10)
}
