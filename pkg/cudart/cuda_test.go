//go:build cgo

package cudart

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// fake is one build of testdata/fakecuda/fakecuda.c.
type fake struct {
	lib, log string
}

// buildFake compiles the fake driver with the given -D definitions into a
// fresh directory. Each build has its own path, so every test dlopens its
// own copy with its own state.
func buildFake(t *testing.T, defs ...string) fake {
	t.Helper()
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("no C compiler (%s) to build the fake libcuda: %v", cc, err)
	}
	dir := t.TempDir()
	f := fake{lib: filepath.Join(dir, "libcuda.so.1"), log: filepath.Join(dir, "calls.log")}
	args := []string{"-shared", "-fPIC", "-Wall", "-Werror", "-o", f.lib, "testdata/fakecuda/fakecuda.c", "-lpthread",
		fmt.Sprintf("-DFAKE_LOG=%q", f.log)}
	for _, d := range defs {
		args = append(args, "-D"+d)
	}
	if out, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
		t.Fatalf("build fake libcuda: %v\n%s", err, out)
	}
	return f
}

// calls returns the fake's call log lines that start with prefix.
func (f fake) calls(t *testing.T, prefix string) []string {
	t.Helper()
	b, err := os.ReadFile(f.log)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if l != "" && strings.HasPrefix(l, prefix) {
			out = append(out, l)
		}
	}
	return out
}

func TestLoadChoice(t *testing.T) {
	dir := t.TempDir()
	notELF := filepath.Join(dir, "libcuda.so.1")
	if err := os.WriteFile(notELF, []byte("not a library\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	empty := t.TempDir()
	v13 := buildFake(t, "FAKE_VERSION=13000")
	v128 := buildFake(t, "FAKE_VERSION=12080")
	v122 := buildFake(t, "FAKE_VERSION=12020")
	old := buildFake(t, "FAKE_VERSION=11080")
	noGetProc := buildFake(t, "FAKE_VERSION=12020", "FAKE_NO_GETPROC")
	missing := buildFake(t, `FAKE_MISSING="cuLaunchHostFunc"`)
	noDevInit := buildFake(t, "FAKE_INIT_RESULT=100")
	zero := buildFake(t, "FAKE_DEVICES=0")
	two := buildFake(t, "FAKE_DEVICES=2")

	cases := []struct {
		name, backend, lib string
		// want: the backend chosen, or "" when Load must fail.
		want     string
		reason   string // substring of Choice.Reason or of the error
		is       error  // errors.Is target of the error (forced cuda) or nil
		batchABI int
		devices  int
	}{
		{"absent auto", "auto", "/nonexistent/libcuda.so.1", "sim", "dlopen /nonexistent/libcuda.so.1", nil, 0, 1},
		{"absent forced", "cuda", "/nonexistent/libcuda.so.1", "", "dlopen /nonexistent/libcuda.so.1", ErrNoDriver, 0, 0},
		{"directory", "cuda", empty, "", "dlopen " + empty, ErrNoDriver, 0, 0},
		{"not a library", "auto", notELF, "sim", "dlopen " + notELF, nil, 0, 1},
		{"too old auto", "auto", old.lib, "sim", "driver version 11.8 < 12.0 required", nil, 0, 1},
		{"too old forced", "cuda", old.lib, "", "driver version 11.8 < 12.0 required", ErrDriverTooOld, 0, 0},
		{"no cuGetProcAddress_v2", "cuda", noGetProc.lib, "", "does not export cuGetProcAddress_v2", ErrDriverTooOld, 0, 0},
		{"missing symbol", "cuda", missing.lib, "", "resolve cuLaunchHostFunc in driver 13.0 (symbol status 1): cuGetProcAddress: CUDA_ERROR_NOT_FOUND (500)", &Error{Code: 500}, 0, 0},
		{"cuInit fails auto", "auto", noDevInit.lib, "sim", "cuInit: CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected", nil, 0, 1},
		{"cuInit fails forced", "cuda", noDevInit.lib, "", "cuInit: CUDA_ERROR_NO_DEVICE (100)", ErrNoDevice, 0, 0},
		{"no devices auto", "auto", zero.lib, "sim", "reports no devices", nil, 0, 1},
		{"no devices forced", "cuda", zero.lib, "", "cuDeviceGetCount: CUDA_ERROR_NO_DEVICE", ErrNoDevice, 0, 0},
		{"13.0", "auto", v13.lib, "cuda", "driver 13.0, 1 device (Fake GPU 0)", nil, 13000, 1},
		{"12.8", "cuda", v128.lib, "cuda", "driver 12.8, 1 device (Fake GPU 0)", nil, 12080, 1},
		{"12.2 has no batch", "", v122.lib, "cuda", "driver 12.2, 1 device", nil, 0, 1},
		{"two devices", "auto", two.lib, "cuda", "driver 13.0, 2 devices", nil, 13000, 2},
		{"sim asked for", "sim", v13.lib, "sim", "asked for", nil, 0, 1},
		{"unknown backend", "gpu", v13.lib, "", `unknown backend "gpu"`, nil, 0, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d, ch, err := Load(Options{Backend: c.backend, Library: c.lib, Logger: quietLog()})
			if c.want == "" {
				if err == nil {
					t.Fatalf("Load succeeded with %v, want an error", ch)
				}
				if !strings.Contains(err.Error(), c.reason) {
					t.Errorf("error %q does not contain %q", err, c.reason)
				}
				if c.is != nil && !errors.Is(err, c.is) {
					t.Errorf("error %q is not %v", err, c.is)
				}
				if d != nil {
					t.Errorf("Load returned a driver with its error")
				}
				return
			}
			if err != nil {
				t.Fatalf("Load: %v", err)
			}
			if d.Name() != c.want || ch.Backend != c.want {
				t.Errorf("backend %q (choice %q), want %q", d.Name(), ch.Backend, c.want)
			}
			if !strings.Contains(ch.Reason, c.reason) {
				t.Errorf("reason %q does not contain %q", ch.Reason, c.reason)
			}
			if ch.BatchABI != c.batchABI {
				t.Errorf("batch ABI %d, want %d", ch.BatchABI, c.batchABI)
			}
			if n, _ := d.DeviceCount(); n != c.devices || ch.Devices != c.devices {
				t.Errorf("devices %d (choice %d), want %d", n, ch.Devices, c.devices)
			}
		})
	}
}

func TestLoadLibraryEnv(t *testing.T) {
	f := buildFake(t, "FAKE_VERSION=12080")
	t.Setenv(LibraryEnv, f.lib)
	d, ch, err := Load(Options{Backend: "cuda", Logger: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	if d.Name() != "cuda" || ch.Library != f.lib || ch.DriverVersion != 12080 {
		t.Errorf("choice %+v, want cuda from %s at 12080", ch, f.lib)
	}
}

func TestLoadLogsChoice(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	if _, _, err := Load(Options{Library: "/nonexistent/libcuda.so.1", Logger: log}); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, want := range []string{"using the simulator", "dlopen /nonexistent/libcuda.so.1"} {
		if !strings.Contains(out, want) {
			t.Errorf("log %q lacks %q", out, want)
		}
	}
}

// mmapHost returns n bytes of anonymous memory outside the Go heap, as
// pool chunks are.
func mmapHost(t *testing.T, n int) []byte {
	t.Helper()
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Munmap(b) })
	return b
}

// openFake opens device 0 of a fake driver built with defs, its copies all
// on the copy engine (the copy kernel's tests use openFakeWith).
func openFake(t *testing.T, defs ...string) (fake, *cudaDevice) {
	t.Helper()
	return openFakeWith(t, Options{NoKernel: true}, defs...)
}

// openFakeWith is openFake with o's options (Backend, Library and Logger
// are set here).
func openFakeWith(t *testing.T, o Options, defs ...string) (fake, *cudaDevice) {
	t.Helper()
	f := buildFake(t, defs...)
	o.Backend, o.Library, o.Logger = "cuda", f.lib, quietLog()
	drv, _, err := Load(o)
	if err != nil {
		t.Fatal(err)
	}
	dev, err := drv.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.Close() })
	return f, dev.(*cudaDevice)
}

// TestFakeUUID: Open reads each device's UUID through cuDeviceGetUuid and
// formats it as NVML does.
func TestFakeUUID(t *testing.T) {
	f := buildFake(t, "FAKE_DEVICES=2")
	drv, _, err := Load(Options{Backend: "cuda", Library: f.lib, Logger: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []string{"GPU-66616b65-6375-6461-0000-000000000000", "GPU-66616b65-6375-6461-0000-000000000001"} {
		dev, err := drv.Open(i)
		if err != nil {
			t.Fatal(err)
		}
		if dev.UUID() != want {
			t.Errorf("device %d: UUID %q, want %q", i, dev.UUID(), want)
		}
		dev.Close()
	}
}

// TestFakeRoundTrip runs scattered pages host -> device -> host through the
// real binding on each driver ABI, and checks from the fake's call log that
// the right copy entry point was used with merged runs.
func TestFakeRoundTrip(t *testing.T) {
	const page, n = 4096, 16
	// Device pages 0,1,2 are adjacent and so are host pages 5,6,7: those
	// three copies merge into one run; the rest stay apart.
	devIdx := []int{0, 1, 2, 9, 4, 12, 7}
	hostIdx := []int{5, 6, 7, 1, 14, 3, 10}
	const runs = 5
	for _, c := range []struct {
		version  string
		stream   bool // a created stream, or the legacy default stream
		wantCall string
	}{
		{"13000", true, "cuMemcpyBatchAsync abi=13000 count=5"},
		{"12080", true, "cuMemcpyBatchAsync abi=12080 count=5"},
		{"12020", true, "cuMemcpyHtoDAsync"},
		{"13000", false, "cuMemcpyHtoDAsync"}, // the batch call rejects stream 0
	} {
		t.Run(fmt.Sprintf("%s/stream=%v", c.version, c.stream), func(t *testing.T) {
			f, dev := openFake(t, "FAKE_VERSION="+c.version)
			host := mmapHost(t, n*page)
			back := mmapHost(t, n*page)
			copy(host, randBytes(len(host), 7))
			for i := range back {
				back[i] = 0xA5
			}
			if err := dev.HostRegister(host); err != nil {
				t.Fatal(err)
			}
			if err := dev.HostRegister(back); err != nil {
				t.Fatal(err)
			}
			dp, err := dev.MemAlloc(n * page)
			if err != nil {
				t.Fatal(err)
			}
			var s Stream
			if c.stream {
				if s, err = dev.StreamCreate(); err != nil {
					t.Fatal(err)
				}
			}
			var in, out []Copy
			for i := range devIdx {
				d := uintptr(dp) + uintptr(devIdx[i]*page)
				in = append(in, Copy{Dst: d, Src: addr(host[hostIdx[i]*page:]), Bytes: page})
				out = append(out, Copy{Dst: addr(back[hostIdx[i]*page:]), Src: d, Bytes: page})
			}
			if err := dev.MemcpyBatchAsync(in, HostToDevice, s); err != nil {
				t.Fatal(err)
			}
			if err := dev.MemcpyBatchAsync(out, DeviceToHost, s); err != nil {
				t.Fatal(err)
			}
			if err := dev.StreamSynchronize(s); err != nil {
				t.Fatal(err)
			}
			for i := 0; i < n; i++ {
				got, src := back[i*page:(i+1)*page], host[i*page:(i+1)*page]
				moved := false
				for _, h := range hostIdx {
					moved = moved || h == i
				}
				if moved && !bytes.Equal(got, src) {
					t.Errorf("host page %d did not make the round trip", i)
				}
				if !moved && !bytes.Equal(got, bytes.Repeat([]byte{0xA5}, page)) {
					t.Errorf("host page %d was written but is not in the batch", i)
				}
			}
			calls := f.calls(t, c.wantCall)
			if strings.HasPrefix(c.wantCall, "cuMemcpyBatchAsync") {
				if len(calls) != 2 {
					t.Errorf("log has %d lines %q, want 2 (one batch each way)", len(calls), c.wantCall)
				}
				if n := len(f.calls(t, "cuMemcpyHtoDAsync")) + len(f.calls(t, "cuMemcpyDtoHAsync")); n != 0 {
					t.Errorf("batch available, but %d single async copies were made", n)
				}
			} else {
				if len(calls) != runs {
					t.Errorf("%d %s calls, want one per merged run (%d)", len(calls), c.wantCall, runs)
				}
				if n := len(f.calls(t, "cuMemcpyDtoHAsync")); n != runs {
					t.Errorf("%d cuMemcpyDtoHAsync calls, want %d", n, runs)
				}
			}
			if got := f.calls(t, "cuMemcpyHtoDAsync bytes=12288"); !c.stream || c.version == "12020" {
				if len(got) != 1 {
					t.Errorf("the merged run of 3 pages was not one 12288-byte copy: %v", f.calls(t, "cuMemcpyHtoDAsync"))
				}
			}
		})
	}
}

func TestFakeBatchSelectsABIByVersion(t *testing.T) {
	for _, c := range []struct {
		version string
		lookups []string
	}{
		{"13000", []string{"cuGetProcAddress cuMemcpyBatchAsync version=13000"}},
		{"12090", []string{"cuGetProcAddress cuMemcpyBatchAsync version=12080"}},
		{"12060", nil},
	} {
		f := buildFake(t, "FAKE_VERSION="+c.version)
		if _, _, err := Load(Options{Backend: "cuda", Library: f.lib, Logger: quietLog()}); err != nil {
			t.Fatal(err)
		}
		got := f.calls(t, "cuGetProcAddress cuMemcpyBatchAsync")
		if strings.Join(got, "|") != strings.Join(c.lookups, "|") {
			t.Errorf("driver %s: lookups %q, want %q", c.version, got, c.lookups)
		}
	}
}

func TestFakeMisuseChangesNothing(t *testing.T) {
	f, dev := openFake(t)
	host := mmapHost(t, 8192)
	unreg := mmapHost(t, 8192)
	if err := dev.HostRegister(host); err != nil {
		t.Fatal(err)
	}
	dp, err := dev.MemAlloc(8192)
	if err != nil {
		t.Fatal(err)
	}
	s, err := dev.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	ok := Copy{Dst: uintptr(dp), Src: addr(host), Bytes: 4096}
	cases := []struct {
		name   string
		copies []Copy
		dir    Direction
		s      Stream
		is     error
		msg    string
	}{
		{"empty batch", nil, HostToDevice, s, ErrInvalidValue, "empty batch"},
		{"bad direction", []Copy{ok}, Direction(9), s, ErrInvalidValue, "bad direction"},
		{"zero bytes", []Copy{ok, {Dst: uintptr(dp), Src: addr(host), Bytes: 0}}, HostToDevice, s, ErrInvalidValue, "copy 1: zero bytes"},
		{"unregistered source", []Copy{ok, {Dst: uintptr(dp), Src: addr(unreg), Bytes: 4096}}, HostToDevice, s, ErrInvalidValue, "copy 1 (HtoD): host range"},
		{"past the registration", []Copy{{Dst: uintptr(dp), Src: addr(host[4096:]), Bytes: 8192}}, HostToDevice, s, ErrInvalidValue, "is not registered memory"},
		{"unregistered destination", []Copy{{Dst: addr(unreg), Src: uintptr(dp), Bytes: 4096}}, DeviceToHost, s, ErrInvalidValue, "copy 0 (DtoH)"},
		{"driver rejects stream", []Copy{ok}, HostToDevice, Stream(0xdead), ErrInvalidHandle, "cuMemcpyBatchAsync: CUDA_ERROR_INVALID_HANDLE (400): invalid resource handle"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := dev.MemcpyBatchAsync(c.copies, c.dir, c.s)
			if !errors.Is(err, c.is) || err == nil || !strings.Contains(err.Error(), c.msg) {
				t.Fatalf("err = %v, want %v containing %q", err, c.is, c.msg)
			}
		})
	}
	if n := len(f.calls(t, "cuMemcpy")); n != 0 {
		t.Errorf("%d copies reached the driver from rejected batches", n)
	}
	// Errors from the driver carry the call and the driver's own words.
	_, err = dev.MemAlloc(2 << 30)
	if want := "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"; err == nil || err.Error() != want || !errors.Is(err, ErrOutOfMemory) {
		t.Errorf("MemAlloc(2 GiB) = %v, want %q", err, want)
	}
	if err := dev.MemFree(dp + 1); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("MemFree(not a base) = %v", err)
	}
	if err := dev.HostUnregister(unreg); !errors.Is(err, ErrHostNotRegistered) {
		t.Errorf("HostUnregister(never registered) = %v", err)
	}
	if err := dev.HostRegister(host[4096:]); !errors.Is(err, ErrHostRegistered) {
		t.Errorf("HostRegister(overlap) = %v", err)
	}
	if err := dev.StreamDestroy(Stream(0x1234)); !errors.Is(err, ErrInvalidHandle) {
		t.Errorf("StreamDestroy(unknown) = %v", err)
	}
	if err := dev.LaunchHostFunc(s, nil); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("LaunchHostFunc(nil) = %v", err)
	}
	if _, err := dev.drv.Open(1); !errors.Is(err, ErrInvalidDevice) {
		t.Errorf("Open(1) of a 1-device driver = %v", err)
	}
}

// TestFakeRegisterSplits registers a range larger than MaxRegisterBytes
// (address space only: the fake never touches it) and checks that it goes
// to the driver in pieces of at most 64 GiB, portable, and that a failure
// on a later piece undoes the earlier ones.
func TestFakeRegisterSplits(t *testing.T) {
	if runtime.GOARCH != "amd64" && runtime.GOARCH != "arm64" {
		t.Skip("needs a 64-bit address space")
	}
	const size = MaxRegisterBytes + 3<<30
	b, err := syscall.Mmap(-1, 0, size, syscall.PROT_NONE, syscall.MAP_PRIVATE|syscall.MAP_ANON|syscall.MAP_NORESERVE)
	if err != nil {
		t.Skipf("cannot reserve %d bytes of address space: %v", size, err)
	}
	defer syscall.Munmap(b)
	f, dev := openFake(t)

	// A range registered elsewhere inside the second piece makes that piece
	// fail after the first succeeded.
	tail := b[MaxRegisterBytes+1<<30 : MaxRegisterBytes+2<<30]
	if err := dev.HostRegister(tail); err != nil {
		t.Fatal(err)
	}
	err = dev.HostRegister(b)
	if !errors.Is(err, ErrHostRegistered) || !strings.Contains(err.Error(), "cuMemHostRegister") {
		t.Fatalf("HostRegister over a registered range = %v", err)
	}
	// Our own overlap check catches it before the driver does; take the
	// registration away from our table only, so the driver must reject.
	dev.mu.Lock()
	saved := dev.regs
	dev.regs = nil
	dev.mu.Unlock()
	err = dev.HostRegister(b)
	if !errors.Is(err, ErrHostRegistered) || !strings.Contains(err.Error(), "piece at offset 68719476736") {
		t.Fatalf("HostRegister with the driver rejecting piece 2 = %v", err)
	}
	if got := f.calls(t, "cuMemHostUnregister"); len(got) != 1 || got[0] != fmt.Sprintf("cuMemHostUnregister bytes=%d", MaxRegisterBytes) {
		t.Errorf("after the failed piece: unregister calls %q, want the first piece undone", got)
	}
	dev.mu.Lock()
	dev.regs = saved
	dev.mu.Unlock()
	if err := dev.HostUnregister(tail); err != nil {
		t.Fatal(err)
	}

	before := len(f.calls(t, "cuMemHostRegister"))
	if err := dev.HostRegister(b); err != nil {
		t.Fatal(err)
	}
	got := f.calls(t, "cuMemHostRegister")[before:]
	want := []string{
		fmt.Sprintf("cuMemHostRegister bytes=%d flags=1", MaxRegisterBytes),
		fmt.Sprintf("cuMemHostRegister bytes=%d flags=1", 3<<30),
	}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("register calls %q, want %q", got, want)
	}
	if err := dev.HostUnregister(b); err != nil {
		t.Fatal(err)
	}
}

// TestFakeContextPerThread calls the device from many goroutines, some
// locked to fresh OS threads: the fake rejects any call made on a thread
// where the primary context is not current, so every call must set it.
func TestFakeContextPerThread(t *testing.T) {
	f, dev := openFake(t)
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread() // a new thread for this goroutine, never unlocked: it exits with it
			for i := 0; i < 20; i++ {
				p, err := dev.MemAlloc(4096)
				if err == nil {
					err = dev.MemFree(p)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if got := f.calls(t, "cuEventCreate"); len(got) != 0 {
		t.Errorf("unexpected calls %q", got)
	}
	e, err := dev.EventCreate()
	if err != nil {
		t.Fatal(err)
	}
	if got := f.calls(t, "cuEventCreate"); len(got) != 1 || got[0] != "cuEventCreate flags=2" {
		t.Errorf("event created with %q, want CU_EVENT_DISABLE_TIMING (2)", got)
	}
	s, err := dev.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	if got := f.calls(t, "cuStreamCreate"); len(got) != 1 || got[0] != "cuStreamCreate flags=1" {
		t.Errorf("stream created with %q, want CU_STREAM_NON_BLOCKING (1)", got)
	}
	if err := dev.EventRecord(e, s); err != nil {
		t.Fatal(err)
	}
	if err := dev.StreamWaitEvent(0, e); err != nil {
		t.Fatal(err)
	}
	if done, err := dev.EventQuery(e); err != nil || !done {
		t.Errorf("EventQuery = %v, %v", done, err)
	}
}

// TestFakeHostFuncFromDriverThread checks that a host function launched on
// a stream runs when the driver calls it from a thread Go did not create.
func TestFakeHostFuncFromDriverThread(t *testing.T) {
	_, dev := openFake(t)
	s, err := dev.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	const n = 50
	done := make(chan int, n)
	for i := 0; i < n; i++ {
		if err := dev.LaunchHostFunc(s, func() { done <- i }); err != nil {
			t.Fatal(err)
		}
	}
	seen := map[int]bool{}
	timeout := time.After(10 * time.Second)
	for len(seen) < n {
		select {
		case i := <-done:
			seen[i] = true
		case <-timeout:
			t.Fatalf("%d of %d host functions ran", len(seen), n)
		}
	}
}

func TestFakeClose(t *testing.T) {
	f, dev := openFake(t)
	host := mmapHost(t, 4096)
	if err := dev.HostRegister(host); err != nil {
		t.Fatal(err)
	}
	if _, err := dev.MemAlloc(4096); err != nil {
		t.Fatal(err)
	}
	if err := dev.Close(); err != nil {
		t.Fatal(err)
	}
	if got := f.calls(t, "cuMemHostUnregister"); len(got) != 1 {
		t.Errorf("Close unregistered %q, want the one range", got)
	}
	if got := f.calls(t, "cuDevicePrimaryCtxRelease"); len(got) != 1 {
		t.Errorf("Close released the primary context %d times, want 1", len(got))
	}
	if _, err := dev.MemAlloc(4096); !errors.Is(err, ErrInvalidHandle) {
		t.Errorf("MemAlloc after Close = %v", err)
	}
	again, err := dev.drv.Open(0)
	must(t, err)
	if again == Device(dev) {
		t.Error("Open after Close returned the closed handle")
	}
	if same, _ := dev.drv.Open(0); same != again {
		t.Error("a second Open of an open device returned another handle")
	}
	must(t, again.Close())
	if err := dev.Close(); err != nil {
		t.Errorf("second Close = %v", err)
	}
}

// TestFakeNoBatch checks the escape hatch: with NoBatch a 13.0 driver's
// batch entry point is not used and copies go one per merged run.
func TestFakeNoBatch(t *testing.T) {
	f := buildFake(t, "FAKE_VERSION=13000")
	drv, ch, err := Load(Options{Backend: "cuda", Library: f.lib, NoBatch: true, NoKernel: true, Logger: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	if ch.BatchABI != 0 {
		t.Errorf("NoBatch: choice says batch ABI %d", ch.BatchABI)
	}
	dev, err := drv.Open(0)
	must(t, err)
	defer dev.Close()
	host := mmapHost(t, 8192)
	must(t, dev.HostRegister(host))
	dp, err := dev.MemAlloc(8192)
	must(t, err)
	s, err := dev.StreamCreate()
	must(t, err)
	must(t, dev.MemcpyBatchAsync([]Copy{{Dst: uintptr(dp) + 4096, Src: addr(host), Bytes: 4096}, {Dst: uintptr(dp), Src: addr(host[4096:]), Bytes: 4096}}, HostToDevice, s))
	if got := f.calls(t, "cuMemcpy"); len(got) != 2 || !strings.HasPrefix(got[0], "cuMemcpyHtoDAsync bytes=4096 stream=own") {
		t.Errorf("NoBatch copies went as %q, want two cuMemcpyHtoDAsync", got)
	}
}

// TestFakeRegisterDoesNotBlockCopies pins a range slowly and checks that
// copies through an already registered range complete meanwhile, that the
// range being registered is not yet usable, and that an overlapping
// registration is refused while it is in progress.
func TestFakeRegisterDoesNotBlockCopies(t *testing.T) {
	_, dev := openFake(t, "FAKE_REGISTER_US=1000000")
	ready := mmapHost(t, 4096)
	must(t, dev.HostRegister(ready))
	slow := mmapHost(t, 4096)
	dp, err := dev.MemAlloc(4096)
	must(t, err)
	s, err := dev.StreamCreate()
	must(t, err)
	registered := make(chan error, 1)
	go func() { registered <- dev.HostRegister(slow) }()
	// Wait until the slow range is reserved.
	for {
		dev.mu.RLock()
		n := len(dev.regs)
		dev.mu.RUnlock()
		if n == 2 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	for i := 0; i < 10; i++ {
		must(t, dev.MemcpyBatchAsync([]Copy{{Dst: uintptr(dp), Src: addr(ready), Bytes: 4096}}, HostToDevice, s))
	}
	select {
	case err := <-registered:
		t.Fatalf("registration finished (%v) before the copies were checked; the fake's delay is too short", err)
	default:
	}
	if err := dev.MemcpyBatchAsync([]Copy{{Dst: uintptr(dp), Src: addr(slow), Bytes: 4096}}, HostToDevice, s); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("copy from a range still being registered = %v", err)
	}
	if err := dev.HostRegister(slow[:2048]); !errors.Is(err, ErrHostRegistered) {
		t.Errorf("overlapping registration during another = %v", err)
	}
	if err := dev.HostUnregister(slow); !errors.Is(err, ErrHostNotRegistered) {
		t.Errorf("unregister during registration = %v", err)
	}
	must(t, <-registered)
	must(t, dev.MemcpyBatchAsync([]Copy{{Dst: uintptr(dp), Src: addr(slow), Bytes: 4096}}, HostToDevice, s))
}

// TestFakeBatchInPieces: a large batch goes to the driver in pieces that
// double (64, 64, 128, 256, then at most 512 runs a call), in order, so
// that the copy engine starts while the rest is enqueued; a piece that
// fails after others were enqueued waits for the stream before the error
// returns (no copy of the batch left in flight), and one that fails first
// enqueued nothing and waits for nothing.
func TestFakeBatchInPieces(t *testing.T) {
	const page, n = 256, 1000
	for _, c := range []struct {
		name   string
		failAt int // the batch call that fails (0: none)
		calls  []string
		copied int // runs that reach the device
		synced bool
	}{
		{"whole", 0, []string{"count=64 ", "count=64 ", "count=128 ", "count=256 ", "count=488 "}, n, false},
		{"third call fails", 3, []string{"count=64 ", "count=64 "}, 128, true},
		{"first call fails", 1, nil, 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			var defs []string
			if c.failAt > 0 {
				defs = append(defs, fmt.Sprintf("FAKE_BATCH_FAIL_AT=%d", c.failAt))
			}
			f, dev := openFake(t, defs...)
			host, back := mmapHost(t, 2*n*page), mmapHost(t, 2*n*page)
			copy(host, randBytes(len(host), 3))
			for i := range back {
				back[i] = 0xA5
			}
			for _, b := range [][]byte{host, back} {
				if err := dev.HostRegister(b); err != nil {
					t.Fatal(err)
				}
			}
			dp, err := dev.MemAlloc(2 * n * page)
			if err != nil {
				t.Fatal(err)
			}
			// Poisoned device memory, and later read back, by one copy on
			// the legacy default stream (a single async copy, not a batch
			// call).
			whole := func(dir Direction) {
				t.Helper()
				c := Copy{Dst: uintptr(dp), Src: addr(back), Bytes: uint64(len(back))}
				if dir == DeviceToHost {
					c = Copy{Dst: addr(back), Src: uintptr(dp), Bytes: uint64(len(back))}
				}
				if err := dev.MemcpyBatchAsync([]Copy{c}, dir, 0); err != nil {
					t.Fatal(err)
				}
			}
			whole(HostToDevice)
			s, err := dev.StreamCreate()
			if err != nil {
				t.Fatal(err)
			}
			// Every other page on both sides: no two copies merge.
			in := make([]Copy, n)
			for i := range in {
				in[i] = Copy{Dst: uintptr(dp) + uintptr(2*i*page), Src: addr(host[2*i*page:]), Bytes: page}
			}
			err = dev.MemcpyBatchAsync(in, HostToDevice, s)
			if (err != nil) != (c.failAt > 0) {
				t.Fatalf("MemcpyBatchAsync: %v", err)
			}
			if err != nil && !strings.Contains(err.Error(), fmt.Sprintf("run %d:", c.copied)) {
				t.Errorf("the error does not name run %d, the first of the failed call: %v", c.copied, err)
			}
			var got []string
			for _, l := range f.calls(t, "cuMemcpyBatchAsync abi=") {
				got = append(got, l[strings.Index(l, "count="):strings.Index(l, "bytes=")])
			}
			if strings.Join(got, "|") != strings.Join(c.calls, "|") {
				t.Errorf("batch calls %q, want %q", got, c.calls)
			}
			if synced := len(f.calls(t, "cuStreamSynchronize")) > 0; synced != c.synced {
				t.Errorf("waited for the stream: %v, want %v", synced, c.synced)
			}
			whole(DeviceToHost)
			for i := range n {
				moved := bytes.Equal(back[2*i*page:(2*i+1)*page], host[2*i*page:(2*i+1)*page])
				if moved != (i < c.copied) {
					t.Fatalf("run %d reached the device: %v, want %v", i, moved, i < c.copied)
				}
			}
		})
	}
}
