//go:build cgo

package cudart

// #cgo LDFLAGS: -ldl
// #include <stdlib.h>
// #include "cuda_shim.h"
import "C"

import (
	"errors"
	"fmt"
	"runtime/cgo"
	"sort"
	"sync"
	"unsafe"
)

// CUDA constants this file passes to the driver.
const (
	cuStreamNonBlocking    = 0x1 // CU_STREAM_NON_BLOCKING
	cuEventDisableTiming   = 0x2 // CU_EVENT_DISABLE_TIMING
	cuHostRegisterPortable = 0x1 // CU_MEMHOSTREGISTER_PORTABLE
	cuErrorNotReady        = 600 // CUDA_ERROR_NOT_READY
)

// Copy is handed to C as an array of kv_copy: the layouts must agree (both
// array lengths below are zero exactly when the sizes are equal).
var (
	_ [unsafe.Sizeof(Copy{}) - C.sizeof_kv_copy]struct{}
	_ [C.sizeof_kv_copy - unsafe.Sizeof(Copy{})]struct{}
)

// cudaDriver is the CUDA driver loaded from libcuda.so.1 at run time.
type cudaDriver struct {
	api     *C.kv_api
	path    string
	version int
	// maxRegister is MaxRegisterBytes except in tests.
	maxRegister uint64
	// kernelOff says why the copy kernel is not used (Options.NoKernel,
	// KernelEnv, or an entry point the driver lacks); nil when it may be.
	kernelOff error

	mu   sync.Mutex
	devs map[int]*cudaDevice // open handles, one per ordinal
}

// openCUDA loads the driver at path, checks its version, resolves every
// entry point and initializes it. It does not count devices.
func openCUDA(path string, noBatch, noKernel bool) (*cudaDriver, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var cerr *C.char
	api := C.kv_open(cpath, &cerr)
	if api == nil {
		msg := C.GoString(cerr)
		C.free(unsafe.Pointer(cerr))
		return nil, fmt.Errorf("%w: %s", ErrNoDriver, msg)
	}
	ok := false
	defer func() {
		if !ok {
			C.kv_close(api)
		}
	}()
	var v C.int
	if r := C.kv_driver_version(api, &v); r != 0 {
		return nil, fmt.Errorf("%w: cuDriverGetVersion in %s returned %d", ErrNoDriver, path, int(r))
	}
	api.driver_version = v
	if int(v) < MinDriverVersion {
		return nil, fmt.Errorf("%w: driver version %s < %s required (%s)", ErrDriverTooOld, FormatVersion(int(v)), FormatVersion(MinDriverVersion), path)
	}
	if api.getProcAddress == nil {
		return nil, fmt.Errorf("%w: %s (driver %s) does not export cuGetProcAddress_v2", ErrDriverTooOld, path, FormatVersion(int(v)))
	}
	d := &cudaDriver{api: api, path: path, version: int(v), maxRegister: MaxRegisterBytes}
	var failed *C.char
	var status C.int
	if r := C.kv_bind(api, &failed, &status); r != 0 {
		name := C.GoString(failed)
		// cuGetErrorName may be the symbol that failed; say what we can.
		e := d.err("cuGetProcAddress", r)
		return nil, fmt.Errorf("resolve %s in driver %s (symbol status %d): %w", name, FormatVersion(int(v)), int(status), e)
	}
	if noBatch {
		api.memcpyBatchAsync, api.batch_abi = nil, 0
	}
	if noKernel {
		d.kernelOff = errors.New("turned off (Options.NoKernel or " + KernelEnv + "=off)")
	} else if r := C.kv_bind_kernel(api, &failed); r != 0 {
		d.kernelOff = fmt.Errorf("resolve %s: %w", C.GoString(failed), d.err("cuGetProcAddress", r))
	}
	// From here the library stays loaded: unloading a driver after cuInit
	// was called is not safe.
	ok = true
	if r := C.kv_init(api); r != 0 {
		return nil, d.err("cuInit", r)
	}
	return d, nil
}

// BatchABI reports which cuMemcpyBatchAsync signature was bound: 12080
// (CUDA 12.8, with failIdx), 13000 (CUDA 13, without), or 0 when the driver
// has none and copies go one cuMemcpyAsync per merged run.
func (d *cudaDriver) BatchABI() int { return int(d.api.batch_abi) }

func (d *cudaDriver) Name() string { return "cuda" }

// Version is the driver's CUDA version, e.g. 13000 for 13.0.
func (d *cudaDriver) Version() int { return d.version }

func (d *cudaDriver) err(call string, r C.kv_result) error {
	e := &Error{Call: call, Code: int(r)}
	if s := C.kv_error_name(d.api, r); s != nil {
		e.Name = C.GoString(s)
	} else {
		e.Name = fmt.Sprintf("CUresult(%d)", int(r))
	}
	if s := C.kv_error_string(d.api, r); s != nil {
		e.Msg = C.GoString(s)
	}
	return e
}

func (d *cudaDriver) DeviceCount() (int, error) {
	var n C.int
	if r := C.kv_device_count(d.api, &n); r != 0 {
		return 0, d.err("cuDeviceGetCount", r)
	}
	return int(n), nil
}

// deviceName returns the name of device ordinal, or "" on error.
func (d *cudaDriver) deviceName(ordinal int) string {
	var dev C.kv_device
	if C.kv_device_get(d.api, C.int(ordinal), &dev) != 0 {
		return ""
	}
	var buf [256]C.char
	if C.kv_device_name(d.api, dev, &buf[0], C.int(len(buf))) != 0 {
		return ""
	}
	return C.GoString(&buf[0])
}

// Open retains the device's primary context. Every later call through the
// Device makes that context current on whichever OS thread runs it, inside
// the same cgo call, so callers need no runtime.LockOSThread. As with the
// simulator, every Open of one ordinal returns the same handle until it is
// closed, so registrations made through one are known to all.
func (d *cudaDriver) Open(ordinal int) (Device, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if dev := d.devs[ordinal]; dev != nil {
		dev.mu.RLock()
		closed := dev.closed
		dev.mu.RUnlock()
		if !closed {
			return dev, nil
		}
	}
	n, err := d.DeviceCount()
	if err != nil {
		return nil, err
	}
	if ordinal < 0 || ordinal >= n {
		return nil, callErr("cuDeviceGet", ErrInvalidDevice, "ordinal %d, driver has %d devices", ordinal, n)
	}
	var dev C.kv_device
	if r := C.kv_device_get(d.api, C.int(ordinal), &dev); r != 0 {
		return nil, d.err("cuDeviceGet", r)
	}
	var uuid [16]byte
	if r := C.kv_device_uuid(d.api, dev, (*C.uchar)(unsafe.Pointer(&uuid[0]))); r != 0 {
		return nil, d.err("cuDeviceGetUuid", r)
	}
	var ctx C.kv_context
	if r := C.kv_ctx_retain(d.api, dev, &ctx); r != 0 {
		return nil, d.err("cuDevicePrimaryCtxRetain", r)
	}
	h := &cudaDevice{
		drv:     d,
		ordinal: ordinal,
		uuid:    FormatUUID(uuid),
		dev:     dev,
		ctx:     ctx,
		allocs:  map[DevicePtr]bool{},
		streams: map[Stream]bool{},
		events:  map[Event]bool{},
	}
	if d.devs == nil {
		d.devs = map[int]*cudaDevice{}
	}
	// The copy kernel runs on streams of the greatest priority: on a
	// default-priority stream its blocks queued behind the engine's
	// pending compute blocks (a batch of 1.3 ms took 19 ms beside a GEMM-like
	// kernel; 1.6 at the greatest priority: docs/benchmarks.md). Without
	// that priority it is off; it says why from the start.
	off := d.kernelOff
	if off == nil {
		if r := C.kv_greatest_priority(d.api, ctx, &h.priority); r != 0 {
			off = fmt.Errorf("stream priorities: %w", d.err("cuCtxGetStreamPriorityRange", r))
		}
	}
	h.kernel.tried, h.kernel.err = off != nil, off
	d.devs[ordinal] = h
	return h, nil
}

type cudaReg struct {
	base, size uint64
	pieces     []uint64 // bases of the cuMemHostRegister calls
	pending    bool     // being registered: reserved, not yet usable
}

type cudaDevice struct {
	drv     *cudaDriver
	ordinal int
	uuid    string
	dev     C.kv_device
	ctx     C.kv_context

	mu      sync.RWMutex
	closed  bool
	allocs  map[DevicePtr]bool
	regs    []cudaReg // sorted by base
	streams map[Stream]bool
	events  map[Event]bool
	kernel  copyKernel
	// priority of the streams made here: the context's greatest where the
	// copy kernel may run (its blocks then go ahead of the engine's queued
	// compute blocks), else 0.
	priority C.int
}

func (d *cudaDevice) Ordinal() int { return d.ordinal }

func (d *cudaDevice) UUID() string { return d.uuid }

func (d *cudaDevice) err(call string, r C.kv_result) error { return d.drv.err(call, r) }

// live returns an error when the device was closed. Callers hold mu.
func (d *cudaDevice) live(call string) error {
	if d.closed {
		return callErr(call, ErrInvalidHandle, "device %d is closed", d.ordinal)
	}
	return nil
}

func (d *cudaDevice) MemAlloc(n uint64) (DevicePtr, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.live("cuMemAlloc"); err != nil {
		return 0, err
	}
	if n == 0 {
		return 0, callErr("cuMemAlloc", ErrInvalidValue, "zero bytes")
	}
	var p C.kv_dptr
	if r := C.kv_mem_alloc(d.drv.api, d.ctx, &p, C.size_t(n)); r != 0 {
		return 0, d.err("cuMemAlloc", r)
	}
	d.allocs[DevicePtr(p)] = true
	return DevicePtr(p), nil
}

func (d *cudaDevice) MemFree(p DevicePtr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.live("cuMemFree"); err != nil {
		return err
	}
	if !d.allocs[p] {
		return callErr("cuMemFree", ErrInvalidValue, "%#x is not the start of an allocation made here", uintptr(p))
	}
	if r := C.kv_mem_free(d.drv.api, d.ctx, C.kv_dptr(p)); r != 0 {
		return d.err("cuMemFree", r)
	}
	delete(d.allocs, p)
	return nil
}

func (d *cudaDevice) MemcpyHtoD(dst DevicePtr, src []byte) error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if err := d.live("cuMemcpyHtoD"); err != nil {
		return err
	}
	if len(src) == 0 {
		return nil
	}
	if r := C.kv_memcpy_htod(d.drv.api, d.ctx, C.kv_dptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))); r != 0 {
		return d.err("cuMemcpyHtoD", r)
	}
	return nil
}

func (d *cudaDevice) MemcpyDtoH(dst []byte, src DevicePtr) error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if err := d.live("cuMemcpyDtoH"); err != nil {
		return err
	}
	if len(dst) == 0 {
		return nil
	}
	if r := C.kv_memcpy_dtoh(d.drv.api, d.ctx, unsafe.Pointer(&dst[0]), C.kv_dptr(src), C.size_t(len(dst))); r != 0 {
		return d.err("cuMemcpyDtoH", r)
	}
	return nil
}

// HostRegister page-locks b with CU_MEMHOSTREGISTER_PORTABLE in calls of at
// most MaxRegisterBytes. If one call fails, the pieces already registered are
// unregistered again, so a failed registration changes nothing. The driver
// calls run without the device's lock, so copies through other registered
// ranges go on while a large range is being pinned.
func (d *cudaDevice) HostRegister(b []byte) error {
	const call = "cuMemHostRegister"
	if len(b) == 0 {
		return callErr(call, ErrInvalidValue, "empty range")
	}
	base, size := uint64(addr(b)), uint64(len(b))
	d.mu.Lock()
	if err := d.live(call); err != nil {
		d.mu.Unlock()
		return err
	}
	i := sort.Search(len(d.regs), func(i int) bool { return d.regs[i].base >= base })
	if (i < len(d.regs) && d.regs[i].base < base+size) ||
		(i > 0 && d.regs[i-1].base+d.regs[i-1].size > base) {
		d.mu.Unlock()
		return callErr(call, ErrHostRegistered, "range %#x+%d overlaps a range registered here", base, size)
	}
	// Reserve the range: overlapping registrations are refused meanwhile,
	// and copies do not use it until it is done.
	d.regs = append(d.regs, cudaReg{})
	copy(d.regs[i+1:], d.regs[i:])
	d.regs[i] = cudaReg{base: base, size: size, pending: true}
	d.mu.Unlock()

	var pieces []uint64
	var err error
	for off := uint64(0); off < size; off += d.drv.maxRegister {
		n := min(d.drv.maxRegister, size-off)
		if r := C.kv_host_register(d.drv.api, d.ctx, C.uint64_t(base+off), C.size_t(n), cuHostRegisterPortable); r != 0 {
			err = fmt.Errorf("register %#x+%d (piece at offset %d of %d bytes): %w", base, size, off, n, d.err(call, r))
			break
		}
		pieces = append(pieces, base+off)
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	if err == nil && d.closed {
		err = callErr(call, ErrInvalidHandle, "device %d was closed during the registration", d.ordinal)
	}
	if err != nil {
		for _, p := range pieces {
			C.kv_host_unregister(d.drv.api, d.ctx, C.uint64_t(p))
		}
	}
	if d.closed {
		return err
	}
	j := sort.Search(len(d.regs), func(j int) bool { return d.regs[j].base >= base })
	if err != nil {
		d.regs = append(d.regs[:j], d.regs[j+1:]...)
		return err
	}
	d.regs[j].pieces, d.regs[j].pending = pieces, false
	return nil
}

func (d *cudaDevice) HostUnregister(b []byte) error {
	const call = "cuMemHostUnregister"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.live(call); err != nil {
		return err
	}
	base := uint64(addr(b))
	i := sort.Search(len(d.regs), func(i int) bool { return d.regs[i].base >= base })
	if len(b) == 0 || i == len(d.regs) || d.regs[i].base != base {
		return callErr(call, ErrHostNotRegistered, "%#x was not registered here", base)
	}
	if d.regs[i].pending {
		return callErr(call, ErrHostNotRegistered, "%#x is still being registered", base)
	}
	var first error
	for _, p := range d.regs[i].pieces {
		if r := C.kv_host_unregister(d.drv.api, d.ctx, C.uint64_t(p)); r != 0 && first == nil {
			first = d.err(call, r)
		}
	}
	d.regs = append(d.regs[:i], d.regs[i+1:]...)
	return first
}

// registered reports whether [p, p+n) lies in one registered range. Callers
// hold mu.
func (d *cudaDevice) registered(p, n uint64) bool {
	i := sort.Search(len(d.regs), func(i int) bool { return d.regs[i].base > p }) - 1
	if i < 0 {
		return false
	}
	r := d.regs[i]
	off := p - r.base
	return !r.pending && off <= r.size && n <= r.size-off
}

func (d *cudaDevice) StreamCreate() (Stream, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.live("cuStreamCreate"); err != nil {
		return 0, err
	}
	var s C.kv_stream
	if r := C.kv_stream_create(d.drv.api, d.ctx, &s, cuStreamNonBlocking, d.priority); r != 0 {
		if d.priority != 0 {
			return 0, d.err("cuStreamCreateWithPriority", r)
		}
		return 0, d.err("cuStreamCreate", r)
	}
	d.streams[Stream(uintptr(s))] = true
	return Stream(uintptr(s)), nil
}

// cstream converts a Stream to the driver's handle. Stream values are
// handles the driver returned, never Go pointers.
func cstream(s Stream) C.kv_stream { return C.kv_stream(s) }

func cevent(e Event) C.kv_event { return C.kv_event(e) }

func (d *cudaDevice) StreamDestroy(s Stream) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.live("cuStreamDestroy"); err != nil {
		return err
	}
	if !d.streams[s] {
		return callErr("cuStreamDestroy", ErrInvalidHandle, "stream %#x was not created here", uintptr(s))
	}
	if r := C.kv_stream_destroy(d.drv.api, d.ctx, cstream(s)); r != 0 {
		return d.err("cuStreamDestroy", r)
	}
	delete(d.streams, s)
	return nil
}

func (d *cudaDevice) StreamSynchronize(s Stream) error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if err := d.live("cuStreamSynchronize"); err != nil {
		return err
	}
	if r := C.kv_stream_synchronize(d.drv.api, d.ctx, cstream(s)); r != 0 {
		return d.err("cuStreamSynchronize", r)
	}
	return nil
}

// EventCreate makes an event with CU_EVENT_DISABLE_TIMING: events here only
// order streams, and timing would make every record slower.
func (d *cudaDevice) EventCreate() (Event, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.live("cuEventCreate"); err != nil {
		return 0, err
	}
	var e C.kv_event
	if r := C.kv_event_create(d.drv.api, d.ctx, &e, cuEventDisableTiming); r != 0 {
		return 0, d.err("cuEventCreate", r)
	}
	d.events[Event(uintptr(e))] = true
	return Event(uintptr(e)), nil
}

func (d *cudaDevice) EventDestroy(e Event) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.live("cuEventDestroy"); err != nil {
		return err
	}
	if !d.events[e] {
		return callErr("cuEventDestroy", ErrInvalidHandle, "event %#x was not created here", uintptr(e))
	}
	if r := C.kv_event_destroy(d.drv.api, d.ctx, cevent(e)); r != 0 {
		return d.err("cuEventDestroy", r)
	}
	delete(d.events, e)
	return nil
}

func (d *cudaDevice) EventRecord(e Event, s Stream) error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if err := d.live("cuEventRecord"); err != nil {
		return err
	}
	if r := C.kv_event_record(d.drv.api, d.ctx, cevent(e), cstream(s)); r != 0 {
		return d.err("cuEventRecord", r)
	}
	return nil
}

func (d *cudaDevice) EventSynchronize(e Event) error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if err := d.live("cuEventSynchronize"); err != nil {
		return err
	}
	if r := C.kv_event_synchronize(d.drv.api, d.ctx, cevent(e)); r != 0 {
		return d.err("cuEventSynchronize", r)
	}
	return nil
}

func (d *cudaDevice) EventQuery(e Event) (bool, error) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if err := d.live("cuEventQuery"); err != nil {
		return false, err
	}
	switch r := C.kv_event_query(d.drv.api, d.ctx, cevent(e)); r {
	case 0:
		return true, nil
	case cuErrorNotReady:
		return false, nil
	default:
		return false, d.err("cuEventQuery", r)
	}
}

func (d *cudaDevice) StreamWaitEvent(s Stream, e Event) error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if err := d.live("cuStreamWaitEvent"); err != nil {
		return err
	}
	if r := C.kv_stream_wait_event(d.drv.api, d.ctx, cstream(s), cevent(e)); r != 0 {
		return d.err("cuStreamWaitEvent", r)
	}
	return nil
}

// MemcpyBatchAsync merges copies that continue each other on both sides,
// checks that every host range is registered here, hands the small runs
// to the copy kernel (copykernel.go: runs of 32 KiB and less, launched
// first) and enqueues the rest with cuMemcpyBatchAsync (source access
// order STREAM, so device sources written by earlier work on s are read
// after it), in pieces (batchPiece): the GPU starts on a piece once its
// call returns, and enqueueing costs the driver about as much as moving a
// 32 KiB copy, so one call for a large batch left the copy engine idle
// until the last copy was enqueued. Without a batch entry point, or on the
// legacy default stream, which the batch call does not accept, it issues
// one cuMemcpy{HtoD,DtoH}Async per merged run. When a call fails after
// others were enqueued, it waits for s before it returns, so that no copy
// of the batch is left in flight.
func (d *cudaDevice) MemcpyBatchAsync(copies []Copy, dir Direction, s Stream) error {
	return d.memcpy(copies, dir, s, true)
}

func (d *cudaDevice) memcpy(copies []Copy, dir Direction, s Stream, useBatch bool) error {
	const call = "cuMemcpyBatchAsync"
	if dir != HostToDevice && dir != DeviceToHost {
		return callErr(call, ErrInvalidValue, "bad direction %v", dir)
	}
	if len(copies) == 0 {
		return callErr(call, ErrInvalidValue, "empty batch")
	}
	d.mu.RLock()
	defer d.mu.RUnlock()
	if err := d.live(call); err != nil {
		return err
	}
	for i, c := range copies {
		if c.Bytes == 0 {
			return callErr(call, ErrInvalidValue, "copy %d: zero bytes", i)
		}
		host := c.Dst
		if dir == HostToDevice {
			host = c.Src
		}
		if !d.registered(uint64(host), c.Bytes) {
			return callErr(call, ErrInvalidValue, "copy %d (%v): host range %#x+%d is not registered memory", i, dir, host, c.Bytes)
		}
	}
	runs := MergeRuns(copies)
	// The kernel only on streams made here (of the greatest priority),
	// not on the legacy default stream or a caller's own.
	kern, ce := []Copy(nil), runs
	if d.priority != 0 && d.streams[s] {
		kern, ce = d.kernel.split(d, runs, dir)
	}
	enqueued := false
	// fail returns err, first waiting for s when part of the batch was
	// enqueued, so that no copy of it is left in flight.
	fail := func(err error) error {
		if enqueued {
			if r := C.kv_stream_synchronize(d.drv.api, d.ctx, cstream(s)); r != 0 {
				err = errors.Join(err, d.err("cuStreamSynchronize", r))
			}
		}
		return err
	}
	if len(kern) > 0 {
		if i, err := d.kernel.launch(d, kern, s); err != nil {
			enqueued = i > 0
			return fail(fmt.Errorf("%d copies (%d merged runs, %d for the copy kernel) %v, kernel run %d: %w", len(copies), len(runs), len(kern), dir, i, err))
		}
		enqueued = true
	}
	var failed *C.char
	var idx C.size_t
	dtoh := C.int(0)
	if dir == DeviceToHost {
		dtoh = 1
	}
	batch := C.int(0)
	if useBatch && s != 0 {
		batch = 1
	}
	for start, n := 0, 0; start < len(ce); start += n {
		n = batchPiece(start, len(ce))
		r := C.kv_memcpy(d.drv.api, d.ctx, (*C.kv_copy)(unsafe.Pointer(&ce[start])), C.size_t(n), dtoh, cstream(s), batch, &failed, &idx)
		if r == 0 {
			enqueued = true
			continue
		}
		enqueued = enqueued || idx > 0
		what, which := "", "run"
		if len(kern) > 0 {
			what, which = fmt.Sprintf(", %d for the copy kernel", len(kern)), "copy-engine run"
		}
		return fail(fmt.Errorf("%d copies (%d merged runs%s) %v, %s %d: %w", len(copies), len(runs), what, dir, which, start+int(idx), d.err(C.GoString(failed), r)))
	}
	return nil
}

const (
	// firstPiece is the runs of a batch's first driver call: enough to
	// keep the copy engine busy while the second is enqueued.
	firstPiece = 64
	// maxPiece bounds the runs of one driver call, so that a large batch
	// pays a call's own cost (not measured apart) a few times, not once
	// per 64 runs: 512 runs take the H200's driver about 200-300 µs.
	maxPiece = 512
)

// batchPiece is how many of n runs the driver call starting at run start
// enqueues: firstPiece, then as many as the calls before it (the runs
// enqueued double), at most maxPiece.
func batchPiece(start, n int) int {
	return min(n-start, max(firstPiece, min(start, maxPiece)))
}

//export kvpoolHostFn
func kvpoolHostFn(h C.uintptr_t) {
	hd := cgo.Handle(h)
	fn := hd.Value().(func())
	hd.Delete()
	fn()
}

// LaunchHostFunc enqueues fn on s with cuLaunchHostFunc. The driver runs it
// on its own thread once earlier work on s is done.
func (d *cudaDevice) LaunchHostFunc(s Stream, fn func()) error {
	const call = "cuLaunchHostFunc"
	if fn == nil {
		return callErr(call, ErrInvalidValue, "nil function")
	}
	d.mu.RLock()
	defer d.mu.RUnlock()
	if err := d.live(call); err != nil {
		return err
	}
	h := cgo.NewHandle(fn)
	if r := C.kv_launch_host_func(d.drv.api, d.ctx, cstream(s), C.uintptr_t(h)); r != 0 {
		h.Delete()
		return d.err(call, r)
	}
	return nil
}

// Close waits for the context's work, destroys the streams and events made
// through this handle, frees its allocations, unregisters its host ranges
// and releases the primary context. Later calls fail with
// CUDA_ERROR_INVALID_HANDLE.
func (d *cudaDevice) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	var first error
	keep := func(call string, r C.kv_result) {
		if r != 0 && first == nil {
			first = d.err(call, r)
		}
	}
	api := d.drv.api
	for s := range d.streams {
		keep("cuStreamSynchronize", C.kv_stream_synchronize(api, d.ctx, cstream(s)))
		keep("cuStreamDestroy", C.kv_stream_destroy(api, d.ctx, cstream(s)))
	}
	keep("cuStreamSynchronize", C.kv_stream_synchronize(api, d.ctx, 0))
	if err := d.kernel.unload(d); err != nil && first == nil {
		first = err
	}
	for e := range d.events {
		keep("cuEventDestroy", C.kv_event_destroy(api, d.ctx, cevent(e)))
	}
	for p := range d.allocs {
		keep("cuMemFree", C.kv_mem_free(api, d.ctx, C.kv_dptr(p)))
	}
	for _, r := range d.regs {
		for _, p := range r.pieces {
			keep("cuMemHostUnregister", C.kv_host_unregister(api, d.ctx, C.uint64_t(p)))
		}
	}
	d.streams, d.events, d.allocs, d.regs = nil, nil, nil, nil
	keep("cuDevicePrimaryCtxRelease", C.kv_ctx_release(api, d.dev))
	return first
}
