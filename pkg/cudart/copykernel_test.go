//go:build cgo

package cudart

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
)

// kernelBed is a fake device with host and device memory for the copy
// kernel's tests: host holds random bytes, back and the device are
// poisoned, all registered or allocated through the real binding.
type kernelBed struct {
	f          fake
	dev        *cudaDevice
	host, back []byte
	dp         DevicePtr
	s          Stream
}

func newKernelBed(t *testing.T, o Options, size int, defs ...string) *kernelBed {
	t.Helper()
	f, dev := openFakeWith(t, o, defs...)
	b := &kernelBed{f: f, dev: dev, host: mmapHost(t, size), back: mmapHost(t, size)}
	copy(b.host, randBytes(size, 21))
	for i := range b.back {
		b.back[i] = 0xA5
	}
	must(t, dev.HostRegister(b.host))
	must(t, dev.HostRegister(b.back))
	var err error
	b.dp, err = dev.MemAlloc(uint64(size))
	must(t, err)
	must(t, dev.MemcpyHtoD(b.dp, bytes.Repeat([]byte{0x5A}, size)))
	b.s, err = dev.StreamCreate()
	must(t, err)
	return b
}

// launches lists the runs of each kernel launch the fake saw.
func (b *kernelBed) launches(t *testing.T) []string { return b.field(t, "cuLaunchKernel", 1) }

// batchCounts lists the count of each cuMemcpyBatchAsync call.
func (b *kernelBed) batchCounts(t *testing.T) []string {
	return b.field(t, "cuMemcpyBatchAsync abi=", 2)
}

// field lists word i of each fake log line that starts with prefix.
func (b *kernelBed) field(t *testing.T, prefix string, i int) []string {
	t.Helper()
	var out []string
	for _, l := range b.f.calls(t, prefix) {
		out = append(out, strings.Fields(l)[i])
	}
	return out
}

// TestFakeCopyKernel sends batches through the binding with the copy
// kernel on: which runs reach the kernel and which the copy engine, in
// launches of at most copyKernelRuns, and that every byte lands where the
// batch says and nowhere else.
func TestFakeCopyKernel(t *testing.T) {
	const page = 4096
	type run struct{ dev, host, bytes int } // byte offsets
	every := func(n, size int) []run {
		var rs []run
		for i := range n {
			rs = append(rs, run{2 * i * size, 2 * ((i * 7) % n) * size, size})
		}
		return rs
	}
	cases := []struct {
		name     string
		runs     []run
		launches []string // runs= of each launch, per direction
		batches  []string // count= of each copy-engine call, per direction
	}{
		{"3,000 pages of 4 KiB", every(3000, page), []string{"runs=1360", "runs=1360", "runs=280"}, nil},
		{"one page", every(1, page), []string{"runs=1"}, nil},
		{"32 KiB pages", every(8, 32<<10), []string{"runs=8"}, nil},
		{"64 KiB pages: the copy engine", every(4, 64<<10), nil, []string{"count=4"}},
		{"mixed", []run{
			{0, 0, page},                 // kernel
			{8 * page, 40 * page, 16},    // kernel: 16 bytes
			{16 * page, 8 * page, 65536}, // too large
			{48*page + 8, 30 * page, 64}, // device side not 16-byte aligned
			{52 * page, 34*page + 4, 64}, // host side not aligned
			{56 * page, 36 * page, 100},  // length not a multiple of 16
			{60 * page, 38 * page, 2 * page},
		}, []string{"runs=3"}, []string{"count=4"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			size := 0
			for _, r := range c.runs {
				size = max(size, r.dev+r.bytes, r.host+r.bytes)
			}
			size = (size + page - 1) / page * page
			b := newKernelBed(t, Options{}, size)
			var in, out []Copy
			for _, r := range c.runs {
				d := uintptr(b.dp) + uintptr(r.dev)
				in = append(in, Copy{Dst: d, Src: addr(b.host[r.host:]), Bytes: uint64(r.bytes)})
				out = append(out, Copy{Dst: addr(b.back[r.host:]), Src: d, Bytes: uint64(r.bytes)})
			}
			must(t, b.dev.MemcpyBatchAsync(in, HostToDevice, b.s))
			must(t, b.dev.MemcpyBatchAsync(out, DeviceToHost, b.s))
			must(t, b.dev.StreamSynchronize(b.s))
			want := bytes.Repeat([]byte{0xA5}, size)
			for _, r := range c.runs {
				copy(want[r.host:r.host+r.bytes], b.host[r.host:])
			}
			if i := firstDiff(b.back, want); i >= 0 {
				t.Fatalf("host byte %d after the round trip: %#x, want %#x", i, b.back[i], want[i])
			}
			twice := func(xs []string) []string { return append(append([]string(nil), xs...), xs...) }
			if got := b.launches(t); strings.Join(got, " ") != strings.Join(twice(c.launches), " ") {
				t.Errorf("kernel launches %q, want %q each way", got, c.launches)
			}
			if got := b.batchCounts(t); strings.Join(got, " ") != strings.Join(twice(c.batches), " ") {
				t.Errorf("copy-engine calls %q, want %q each way", got, c.batches)
			}
			if got := b.f.calls(t, "cuStreamCreate"); len(got) != 1 || got[0] != "cuStreamCreate flags=1 priority=-5" {
				t.Errorf("streams made as %q, want one of the greatest priority (-5)", got)
			}
			if n := len(b.f.calls(t, "cuModuleLoadData")); n != 1 && len(c.launches) > 0 {
				t.Errorf("the module was loaded %d times, want once", n)
			}
			if loaded, err := b.dev.kernel.state(); loaded != (len(c.launches) > 0) || err != nil {
				t.Errorf("kernel loaded %v (%v), want %v", loaded, err, len(c.launches) > 0)
			}
		})
	}
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// TestFakeCopyKernelNeverFaults: a run the copy engine would refuse (its
// device side past its allocation, or in one freed since an earlier batch
// used it) never reaches the kernel, whose fault would end the context:
// the batch fails with the driver's error and the device goes on working.
func TestFakeCopyKernelNeverFaults(t *testing.T) {
	const page = 4096
	b := newKernelBed(t, Options{}, 16*page)
	other, err := b.dev.MemAlloc(4 * page)
	must(t, err)
	ok := Copy{Dst: uintptr(b.dp), Src: addr(b.host), Bytes: page}
	// other is used once, so the kernel knows it, then freed.
	must(t, b.dev.MemcpyBatchAsync([]Copy{ok, {Dst: uintptr(other), Src: addr(b.host[page:]), Bytes: page}}, HostToDevice, b.s))
	must(t, b.dev.MemFree(other))
	cases := []struct {
		name string
		bad  Copy
	}{
		{"past the allocation's end", Copy{Dst: uintptr(b.dp) + 16*page - 2048, Src: addr(b.host[2*page:]), Bytes: page}},
		{"in a freed allocation", Copy{Dst: uintptr(other), Src: addr(b.host[3*page:]), Bytes: page}},
		{"not device memory", Copy{Dst: 0x10000, Src: addr(b.host[4*page:]), Bytes: page}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := b.dev.MemcpyBatchAsync([]Copy{ok, c.bad}, HostToDevice, b.s)
			if !errors.Is(err, ErrInvalidValue) || !strings.Contains(err.Error(), "cuMemcpyBatchAsync") {
				t.Fatalf("err = %v, want the copy engine's CUDA_ERROR_INVALID_VALUE", err)
			}
			if got := b.f.calls(t, "cuLaunchKernel faulted"); len(got) != 0 {
				t.Fatalf("the kernel got a bad run: %q", got)
			}
			// The device still works.
			must(t, b.dev.MemcpyBatchAsync([]Copy{ok}, HostToDevice, b.s))
			must(t, b.dev.StreamSynchronize(b.s))
		})
	}
}

// TestFakeCopyKernelOff: every way the kernel is not used leaves the
// batches to the copy engine, which moves every byte.
func TestFakeCopyKernelOff(t *testing.T) {
	cases := []struct {
		name   string
		o      Options
		env    string
		defs   []string
		loaded bool   // cuModuleLoadData was called
		why    string // in the kernel's Err after the batch
	}{
		{"NoKernel", Options{NoKernel: true}, "", nil, false, "turned off"},
		{"KVPOOL_COPY_KERNEL=off", Options{}, "off", nil, false, "turned off"},
		{"driver without cuLaunchKernel", Options{}, "", []string{`FAKE_MISSING="cuLaunchKernel"`}, false, "resolve cuLaunchKernel"},
		{"driver without stream priorities", Options{}, "", []string{`FAKE_MISSING="cuStreamCreateWithPriority"`}, false, "resolve cuStreamCreateWithPriority"},
		{"driver cannot compile the PTX", Options{}, "", []string{"FAKE_MODULE_RESULT=218"}, true, "CUDA_ERROR_INVALID_PTX"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(KernelEnv, c.env)
			b := newKernelBed(t, c.o, 64<<10, c.defs...)
			in := []Copy{{Dst: uintptr(b.dp), Src: addr(b.host), Bytes: 4096}, {Dst: uintptr(b.dp) + 8192, Src: addr(b.host[16384:]), Bytes: 4096}}
			must(t, b.dev.MemcpyBatchAsync(in, HostToDevice, b.s))
			got := make([]byte, 4096)
			must(t, b.dev.MemcpyDtoH(got, b.dp+8192))
			if !bytes.Equal(got, b.host[16384:16384+4096]) {
				t.Error("the copy engine did not move the bytes")
			}
			if n := len(b.launches(t)); n != 0 {
				t.Errorf("%d kernel launches", n)
			}
			if got := b.batchCounts(t); strings.Join(got, " ") != "count=2" {
				t.Errorf("copy-engine calls %q, want one of 2", got)
			}
			// Off from the start: streams of the default priority; off
			// only once the PTX was refused: made before, of the greatest.
			want := "cuStreamCreate flags=1"
			if c.loaded {
				want += " priority=-5"
			}
			if got := b.f.calls(t, "cuStreamCreate"); len(got) != 1 || got[0] != want {
				t.Errorf("streams made as %q, want %q", got, want)
			}
			if loaded := len(b.f.calls(t, "cuModuleLoadData")) > 0; loaded != c.loaded {
				t.Errorf("module loaded: %v, want %v", loaded, c.loaded)
			}
			if _, err := b.dev.kernel.state(); err == nil || !strings.Contains(err.Error(), c.why) {
				t.Errorf("kernel error %v, want one saying %q", err, c.why)
			}
		})
	}
	t.Run("bad "+KernelEnv, func(t *testing.T) {
		t.Setenv(KernelEnv, "yes")
		if _, _, err := Load(Options{Backend: BackendSim}); err == nil || !strings.Contains(err.Error(), `KVPOOL_COPY_KERNEL="yes"`) {
			t.Errorf("Load: %v, want an error naming the value", err)
		}
	})
}

// TestFakeCopyKernelOwnStreamsOnly: on the legacy default stream the
// batch goes to the copy engine (one async copy a run), not the kernel,
// whose blocks need a stream of the greatest priority.
func TestFakeCopyKernelOwnStreamsOnly(t *testing.T) {
	b := newKernelBed(t, Options{}, 64<<10)
	in := []Copy{{Dst: uintptr(b.dp), Src: addr(b.host), Bytes: 4096}, {Dst: uintptr(b.dp) + 8192, Src: addr(b.host[16384:]), Bytes: 4096}}
	must(t, b.dev.MemcpyBatchAsync(in, HostToDevice, 0))
	if n := len(b.launches(t)); n != 0 {
		t.Errorf("%d kernel launches on the legacy stream", n)
	}
	if n := len(b.f.calls(t, "cuMemcpyHtoDAsync bytes=4096 stream=default")); n != 2 {
		t.Errorf("%d async copies on the legacy stream, want 2", n)
	}
	must(t, b.dev.MemcpyBatchAsync(in, HostToDevice, b.s))
	if got := b.launches(t); len(got) != 1 {
		t.Errorf("kernel launches %q on the device's own stream, want 1", got)
	}
}

// TestFakeCopyKernelLaunchFails: a launch that fails after others were
// enqueued waits for the stream before the error returns (no copy of the
// batch left in flight), and the error names the launch's first run.
func TestFakeCopyKernelLaunchFails(t *testing.T) {
	const page, n = 4096, 3000
	for _, c := range []struct {
		failAt int
		first  int  // the failed launch's first run
		synced bool // the stream was waited for
	}{
		{1, 0, false},
		{2, copyKernelRuns, true},
		{3, 2 * copyKernelRuns, true},
	} {
		t.Run(fmt.Sprintf("launch %d", c.failAt), func(t *testing.T) {
			b := newKernelBed(t, Options{}, 2*n*page, fmt.Sprintf("FAKE_LAUNCH_FAIL_AT=%d", c.failAt))
			var in []Copy
			for i := range n {
				in = append(in, Copy{Dst: uintptr(b.dp) + uintptr(2*i*page), Src: addr(b.host[2*i*page:]), Bytes: page})
			}
			syncs := len(b.f.calls(t, "cuStreamSynchronize"))
			err := b.dev.MemcpyBatchAsync(in, HostToDevice, b.s)
			if !errors.Is(err, ErrInvalidValue) || !strings.Contains(err.Error(), fmt.Sprintf("kernel run %d:", c.first)) {
				t.Fatalf("err = %v, want CUDA_ERROR_INVALID_VALUE at kernel run %d", err, c.first)
			}
			if synced := len(b.f.calls(t, "cuStreamSynchronize")) > syncs; synced != c.synced {
				t.Errorf("waited for the stream: %v, want %v", synced, c.synced)
			}
			if got := b.batchCounts(t); len(got) != 0 {
				t.Errorf("copy-engine calls after the failed launch: %q", got)
			}
		})
	}
}

// TestCopyKernelRanges: a newly confirmed allocation replaces every known
// one it overlaps (addresses freed and handed out again) and the list stays
// sorted.
func TestCopyKernelRanges(t *testing.T) {
	r := func(base, end uint64) devRange { return devRange{base: base, end: end} }
	cases := []struct {
		name      string
		have      []devRange
		add       devRange
		want      []devRange
		wantIndex int
	}{
		{"into an empty list", nil, r(100, 200), []devRange{r(100, 200)}, 0},
		{"between two", []devRange{r(0, 100), r(300, 400)}, r(100, 300), []devRange{r(0, 100), r(100, 300), r(300, 400)}, 1},
		{"over two it overlaps", []devRange{r(0, 100), r(200, 300), r(500, 600)}, r(50, 250), []devRange{r(50, 250), r(500, 600)}, 0},
		{"the same base, larger", []devRange{r(0, 100), r(200, 300)}, r(200, 400), []devRange{r(0, 100), r(200, 400)}, 1},
		{"at the end", []devRange{r(0, 100)}, r(100, 101), []devRange{r(0, 100), r(100, 101)}, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			k := &copyKernel{ranges: append([]devRange(nil), c.have...)}
			i := k.insert(c.add)
			if i != c.wantIndex || fmt.Sprint(k.ranges) != fmt.Sprint(c.want) {
				t.Errorf("insert %v into %v: %v at %d, want %v at %d", c.add, c.have, k.ranges, i, c.want, c.wantIndex)
			}
		})
	}
	t.Run("into a full list", func(t *testing.T) {
		// maxRanges allocations seen, every tenth confirmed in this batch
		// (epoch 2): a new one leaves those and itself.
		k := &copyKernel{}
		var want []devRange
		for i := range maxRanges {
			x := devRange{base: uint64(100 * i), end: uint64(100*i + 50), epoch: 1}
			if i%10 == 0 {
				x.epoch = 2
				want = append(want, x)
			}
			k.ranges = append(k.ranges, x)
		}
		add := devRange{base: 150, end: 160, epoch: 2}
		want = slices.Insert(want, 1, add)
		if i := k.insert(add); i != 1 || !slices.Equal(k.ranges, want) {
			t.Errorf("%d ranges, the new one at %d; want %d, at 1", len(k.ranges), i, len(want))
		}
	})
}
