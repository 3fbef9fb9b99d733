// Command libkvpool is the C ABI of the kvpool client: build it with
//
//	go build -buildmode=c-shared -o libkvpool.so ./cmd/libkvpool
//
// and include kvpool.h. It is a thin layer over pkg/client: handles in
// place of *client.CPUPagePool, C buffers in place of slices, status codes
// in place of errors. The Python package (python/kvpool) loads it with
// ctypes; C and C++ engines link it directly. docs/c-abi.md describes the
// functions and what a host process must know (one Go runtime per process,
// fork, signals, threads).
package main

/*
#define KVPOOL_NO_PROTOTYPES
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kvpool.h"

static inline void *kv_ptr(uint64_t a) { return (void *)(uintptr_t)a; }
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/wire"
)

func main() {}

// abiVersion is KVPOOL_ABI_VERSION of the kvpool.h this library implements.
const abiVersion = 1

// Status codes of kvpool.h.
const (
	statusOK               = 0
	errInvalid             = -1
	errBadHandle           = -2
	errUnknownStream       = -3
	errDuplicateStream     = -4
	errPageCount           = -5
	errOutOfRange          = -6
	errDuplicateIndex      = -7
	errBadName             = -8
	errBadSize             = -9
	errClosed              = -10
	errDisconnected        = -11
	errProtocol            = -12
	errCUDA                = -13
	errUnauthorized        = -14
	errBusy                = -15
	errNoCapacity          = -16
	errBufferTooSmall      = -17
	errOther               = -99
	defaultOpenTimeout     = 30 * time.Second
	defaultSimDevices      = 2
	envLogLevel            = "KVPOOL_LOG_LEVEL"
	defaultClientName      = "kvpool-c-abi"
	maxPagesPerCall        = 1<<31 - 1
	maxRegionsPerLayout    = 1 << 16
	maxRanks               = 1024
	maxStringArgumentBytes = 1 << 20
)

// struct_size values kvpool_open takes: the options as they are now, and as
// first released (without spin_wait_us and what follows it).
const (
	optionsSize      = C.sizeof_kvpool_options
	optionsSizeFirst = unsafe.Offsetof(C.kvpool_options{}.spin_wait_us)
	optionsSizeSpin  = unsafe.Offsetof(C.kvpool_options{}.ranks) // the second release
	localitySize     = C.sizeof_kvpool_locality
)

// abiCodes gives the wire statuses their kvpool.h codes: one hop from the
// status, which pkg/wire's table relates to the pool's errors. A status
// not named here (and a code of a newer agent) is KVPOOL_ERR_OTHER.
var abiCodes = map[wire.Status]C.int{
	wire.StatusUnknownStream:   errUnknownStream,
	wire.StatusDuplicateStream: errDuplicateStream,
	wire.StatusPageCount:       errPageCount,
	wire.StatusOutOfRange:      errOutOfRange,
	wire.StatusDuplicateIndex:  errDuplicateIndex,
	wire.StatusBadName:         errBadName,
	wire.StatusBadSize:         errBadSize,
	wire.StatusClosed:          errClosed,
	wire.StatusUnauthorized:    errUnauthorized,
	wire.StatusBusy:            errBusy,
	wire.StatusNoCapacity:      errNoCapacity,
}

// statusOf maps an error to its kvpool.h status: a refusal by the agent
// by its wire status, a pool error raised on this side by the status of
// the same meaning (wire.StatusOf), the client's own failures by kind.
func statusOf(err error) C.int {
	var ce *client.Error
	if errors.As(err, &ce) {
		return abiCode(ce.Status)
	}
	var cu *cudart.Error
	var op *net.OpError
	switch {
	case errors.Is(err, client.ErrDisconnected), errors.As(err, &op):
		return errDisconnected
	case errors.Is(err, client.ErrProtocol):
		return errProtocol
	case errors.As(err, &cu):
		return errCUDA
	}
	return abiCode(wire.StatusOf(err))
}

func abiCode(st wire.Status) C.int {
	if code, ok := abiCodes[st]; ok {
		return code
	}
	return errOther
}

// Per-thread error messages, as errno: a failed call stores its message
// under the OS thread that made it (an exported function runs on the
// caller's thread), and kvpool_last_error reads it back on that thread.
var lastErrors sync.Map // tid -> string

func fail(code C.int, err error) C.int {
	lastErrors.Store(unix.Gettid(), err.Error())
	return code
}

func failErr(err error) C.int { return fail(statusOf(err), err) }

func invalid(format string, args ...any) C.int {
	return fail(errInvalid, fmt.Errorf("kvpool: "+format, args...))
}

//export kvpool_abi_version
func kvpool_abi_version() C.int { return abiVersion }

//export kvpool_last_error
func kvpool_last_error(buf *C.char, capacity C.size_t) C.size_t {
	v, ok := lastErrors.Load(unix.Gettid())
	if !ok {
		if buf != nil && capacity > 0 {
			*buf = 0
		}
		return 0
	}
	msg := v.(string)
	if buf != nil && capacity > 0 {
		n := min(len(msg), int(capacity)-1)
		dst := unsafe.Slice((*byte)(unsafe.Pointer(buf)), int(capacity))
		copy(dst, msg[:n])
		dst[n] = 0
	}
	return C.size_t(len(msg))
}

// handle is one open pool.
type handle struct {
	pool    *client.CPUPagePool
	ordinal int
	sim     *cudart.Sim // nil on the CUDA driver
	dev     cudart.Device
	spans   []span // simulated device memory this handle registered
}

var (
	handlesMu sync.RWMutex
	handles   = map[uint64]*handle{}
	nextID    uint64
)

func lookup(h C.kvpool_handle) (*handle, C.int) {
	handlesMu.RLock()
	p := handles[uint64(h)]
	handlesMu.RUnlock()
	if p == nil {
		return nil, fail(errBadHandle, fmt.Errorf("kvpool: %d is not an open handle", uint64(h)))
	}
	return p, statusOK
}

// Drivers are loaded once per process and shared by every handle: the
// simulator's device memory and the CUDA primary context are per process.
var (
	driverMu   sync.Mutex
	cudaDriver cudart.Driver
	cudaErr    error
	cudaTried  bool
	simDriver  *cudart.Sim
	simOpts    cudart.SimOptions
)

func logger() *slog.Logger {
	level := slog.LevelWarn
	switch strings.ToLower(os.Getenv(envLogLevel)) {
	case "debug":
		level = slog.LevelDebug
	case "info":
		level = slog.LevelInfo
	case "error":
		level = slog.LevelError
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}

func loadDriver(backend string, so cudart.SimOptions) (cudart.Driver, *cudart.Sim, error) {
	driverMu.Lock()
	defer driverMu.Unlock()
	sim := func() (cudart.Driver, *cudart.Sim, error) {
		if simDriver == nil {
			simDriver, simOpts = cudart.NewSim(so), so
		} else if simOpts.Devices != so.Devices || simOpts.CopyDelay != so.CopyDelay || !slices.Equal(simOpts.UUIDs, so.UUIDs) {
			return nil, nil, fmt.Errorf("kvpool: the simulator of this process runs with %d devices and a copy delay of %v; asked for %d and %v",
				simOpts.Devices, simOpts.CopyDelay, so.Devices, so.CopyDelay)
		}
		return simDriver, simDriver, nil
	}
	switch backend {
	case "", cudart.BackendAuto, cudart.BackendCUDA:
	case cudart.BackendSim:
		return sim()
	default:
		return nil, nil, fmt.Errorf("kvpool: unknown backend %q (want %q, %q or %q)", backend, cudart.BackendAuto, cudart.BackendCUDA, cudart.BackendSim)
	}
	if !cudaTried {
		cudaTried = true
		cudaDriver, _, cudaErr = cudart.Load(cudart.Options{Backend: cudart.BackendCUDA, Logger: logger()})
	}
	if cudaDriver != nil {
		return cudaDriver, nil, nil
	}
	if backend == cudart.BackendCUDA {
		return nil, nil, cudaErr
	}
	return sim()
}

func goString(p *C.char, n C.size_t, what string) (string, error) {
	if n > maxStringArgumentBytes {
		return "", fmt.Errorf("kvpool: %s of %d bytes", what, uint64(n))
	}
	if p == nil && n > 0 {
		return "", fmt.Errorf("kvpool: %s is NULL with length %d", what, uint64(n))
	}
	return C.GoStringN(p, C.int(n)), nil
}

// names decodes a call's rid and label (label == nil: the call has none).
func names(rid *C.char, ridLen C.size_t, label *C.char, labelLen C.size_t, withLabel bool) (r, l string, st C.int) {
	r, err := goString(rid, ridLen, "rid")
	if err == nil && withLabel {
		l, err = goString(label, labelLen, "label")
	}
	if err != nil {
		return "", "", fail(errInvalid, err)
	}
	return r, l, statusOK
}

func cString(p *C.char) string {
	if p == nil {
		return ""
	}
	return C.GoString(p)
}

func int32s(p *C.int32_t, n C.int64_t, what string) ([]int32, error) {
	if n < 0 || n > maxPagesPerCall {
		return nil, fmt.Errorf("kvpool: %s: count %d", what, int64(n))
	}
	if n == 0 {
		return []int32{}, nil
	}
	if p == nil {
		return nil, fmt.Errorf("kvpool: %s is NULL with count %d", what, int64(n))
	}
	return unsafe.Slice((*int32)(unsafe.Pointer(p)), int(n)), nil
}

// ranksOf is the ranks the caller declares (0 from a struct without the field).
func ranksOf(opts *C.kvpool_options) int {
	if uintptr(opts.struct_size) < optionsSize {
		return 0
	}
	return int(opts.ranks)
}

// simOptions is the simulator kvpool_open would load: sim_devices devices
// (default 2) named as the agent names its simulated GPUs, or, in a
// container that lists its visible GPUs (NVIDIA_VISIBLE_DEVICES, then
// CUDA_VISIBLE_DEVICES), exactly those, so that ordinal i is the i-th GPU
// the container was given, as CUDA would number them.
func simOptions(opts *C.kvpool_options) (cudart.SimOptions, error) {
	so := cudart.SimOptions{Devices: int(opts.sim_devices), CopyDelay: time.Duration(opts.sim_copy_delay_us) * time.Microsecond}
	vis, err := cudart.VisibleFromEnv()
	switch {
	case errors.Is(err, cudart.ErrNoVisibleList):
	case err != nil:
		return so, fmt.Errorf("kvpool: simulator: %w", err)
	case len(vis) == 0:
		return so, fmt.Errorf("kvpool: simulator: the container sees no GPU (%s=%q)", cudart.EnvNVIDIAVisible, os.Getenv(cudart.EnvNVIDIAVisible))
	case so.Devices != 0 && so.Devices != len(vis):
		return so, fmt.Errorf("kvpool: simulator: sim_devices %d, but the container sees %d GPUs", so.Devices, len(vis))
	default:
		so.Devices, so.UUIDs = len(vis), vis
	}
	if so.Devices == 0 {
		so.Devices = defaultSimDevices
	}
	return so, nil
}

// openArgs checks kvpool_open's options and returns the regions and the
// spin wait they give; a code other than statusOK is the call's result.
func openArgs(opts *C.kvpool_options) ([]cudart.Region, time.Duration, C.int) {
	if size := uintptr(opts.struct_size); size != optionsSize && size != optionsSizeSpin && size != optionsSizeFirst {
		return nil, 0, invalid("open: options struct_size %d, this library (ABI %d) takes %d, %d or %d", uint32(opts.struct_size), abiVersion, optionsSizeFirst, optionsSizeSpin, optionsSize)
	}
	if uintptr(opts.struct_size) >= optionsSize && (opts.ranks < 0 || opts.ranks > maxRanks || opts.reserved != 0) {
		return nil, 0, invalid("open: ranks %d (want 0 to %d), reserved %d (want 0)", int32(opts.ranks), maxRanks, int32(opts.reserved))
	}
	var spin time.Duration // client default
	if uintptr(opts.struct_size) >= optionsSizeSpin {
		us := int64(opts.spin_wait_us)
		switch {
		case us < 0:
			spin = -1
		case us > int64(wire.SpinLimit/time.Microsecond):
			return nil, 0, invalid("open: spin_wait_us %d is over the limit of %d", us, wire.SpinLimit/time.Microsecond)
		default:
			spin = time.Duration(us) * time.Microsecond
		}
	}
	if opts.n_regions <= 0 || opts.n_regions > maxRegionsPerLayout || opts.regions == nil {
		return nil, 0, invalid("open: %d regions (NULL: %v)", int32(opts.n_regions), opts.regions == nil)
	}
	if opts.device < 0 {
		return nil, 0, invalid("open: device %d", int32(opts.device))
	}
	if opts.max_pages < 0 || opts.max_pages > maxPagesPerCall {
		return nil, 0, invalid("open: max_pages %d", int64(opts.max_pages))
	}
	if opts.timeout_ms < 0 || opts.sim_copy_delay_us < 0 || opts.sim_devices < 0 {
		return nil, 0, invalid("open: negative timeout, simulator copy delay or simulator devices")
	}
	cregs := unsafe.Slice(opts.regions, int(opts.n_regions))
	regions := make([]cudart.Region, len(cregs))
	for i, r := range cregs {
		if r.pages <= 0 || r.pages > maxPagesPerCall {
			return nil, 0, invalid("open: region %d: %d pages", i, int64(r.pages))
		}
		regions[i] = cudart.Region{Base: cudart.DevicePtr(r.base), Stride: uint64(r.stride), PageBytes: uint64(r.page_bytes), Pages: int(r.pages)}
	}
	return regions, spin, statusOK
}

//export kvpool_open
func kvpool_open(opts *C.kvpool_options, out *C.kvpool_handle) C.int {
	if opts == nil || out == nil {
		return invalid("open: NULL options or handle pointer")
	}
	regions, spin, code := openArgs(opts)
	if code != statusOK {
		return code
	}
	so, err := simOptions(opts)
	if err != nil {
		return failErr(err)
	}
	drv, sim, err := loadDriver(cString(opts.backend), so)
	if err != nil {
		return failErr(err)
	}
	ordinal := int(opts.device)
	dev, err := drv.Open(ordinal)
	if err != nil {
		return failErr(fmt.Errorf("kvpool: open device %d: %w", ordinal, err))
	}
	h := &handle{ordinal: ordinal, sim: sim, dev: dev}
	if sim != nil {
		// The caller's KV cache is host memory standing in for the device.
		if err := h.registerSpans(regions); err != nil {
			return failErr(err)
		}
	}
	timeout := time.Duration(opts.timeout_ms) * time.Millisecond
	if timeout == 0 {
		timeout = defaultOpenTimeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	name := cString(opts.name)
	if name == "" {
		name = defaultClientName
	}
	p, err := client.Open(ctx, client.Options{
		Socket:   cString(opts.socket),
		Token:    cString(opts.token),
		Device:   dev,
		Regions:  regions,
		MaxPages: int(opts.max_pages),
		Ranks:    ranksOf(opts),
		Order:    cudart.Stream(opts.order_stream),
		Name:     name,
		Logger:   logger(),
		SpinWait: spin,
	})
	if err != nil {
		h.unregisterSpans()
		return failErr(err)
	}
	h.pool = p
	handlesMu.Lock()
	nextID++
	id := nextID
	handles[id] = h
	handlesMu.Unlock()
	*out = C.kvpool_handle(id)
	return statusOK
}

//export kvpool_close
func kvpool_close(hd C.kvpool_handle) C.int {
	handlesMu.Lock()
	h := handles[uint64(hd)]
	delete(handles, uint64(hd))
	handlesMu.Unlock()
	if h == nil {
		return fail(errBadHandle, fmt.Errorf("kvpool: %d is not an open handle", uint64(hd)))
	}
	err := h.pool.Close()
	h.unregisterSpans()
	if err != nil {
		return failErr(err)
	}
	return statusOK
}

//export kvpool_offload
func kvpool_offload(hd C.kvpool_handle, rid *C.char, ridLen C.size_t, label *C.char, labelLen C.size_t,
	gpuPages *C.int32_t, n C.int64_t, storedLen, position, released C.int64_t) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	r, l, st := names(rid, ridLen, label, labelLen, true)
	if st != statusOK {
		return st
	}
	pages, err := int32s(gpuPages, n, "gpu_pages")
	if err != nil {
		return fail(errInvalid, err)
	}
	ok, err := h.pool.OffloadStream(r, l, pages, int64(storedLen), int64(position), int64(released))
	if err != nil {
		return failErr(err)
	}
	if ok {
		return 1
	}
	return 0
}

//export kvpool_reload
func kvpool_reload(hd C.kvpool_handle, rid *C.char, ridLen C.size_t, label *C.char, labelLen C.size_t,
	gpuPages *C.int32_t, n C.int64_t, hostPages *C.int32_t, capacity C.int64_t, meta *C.kvpool_stream_meta) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	r, l, st := names(rid, ridLen, label, labelLen, true)
	if st != statusOK {
		return st
	}
	pages, err := int32s(gpuPages, n, "gpu_pages")
	if err != nil {
		return fail(errInvalid, err)
	}
	if meta == nil {
		return invalid("reload: NULL meta")
	}
	if capacity < n {
		return fail(errBufferTooSmall, fmt.Errorf("kvpool: reload: host page buffer holds %d, the stream needs %d", int64(capacity), int64(n)))
	}
	out, err := int32s(hostPages, capacity, "host_pages")
	if err != nil {
		return fail(errInvalid, err)
	}
	s, err := h.pool.ReloadStream(r, l, pages)
	if len(s.CPUPageIndices) > len(out) {
		// The agent's page count check makes this impossible.
		return fail(errProtocol, fmt.Errorf("kvpool: reload: the agent returned %d host pages for %d device pages", len(s.CPUPageIndices), len(pages)))
	}
	copy(out, s.CPUPageIndices)
	meta.stored_len, meta.position, meta.released = C.int64_t(s.StoredLen), C.int64_t(s.Position), C.int64_t(s.Released)
	meta.num_pages = C.int64_t(len(s.CPUPageIndices))
	if err != nil {
		return failErr(err)
	}
	return statusOK
}

//export kvpool_discard
func kvpool_discard(hd C.kvpool_handle, rid *C.char, ridLen C.size_t, label *C.char, labelLen C.size_t) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	r, l, st := names(rid, ridLen, label, labelLen, true)
	if st != statusOK {
		return st
	}
	if err := h.pool.Discard(r, l); err != nil {
		return failErr(err)
	}
	return statusOK
}

//export kvpool_remove_request
func kvpool_remove_request(hd C.kvpool_handle, rid *C.char, ridLen C.size_t) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	r, _, st := names(rid, ridLen, nil, 0, false)
	if st != statusOK {
		return st
	}
	if err := h.pool.RemoveRequest(r); err != nil {
		return failErr(err)
	}
	return statusOK
}

//export kvpool_is_offloaded
func kvpool_is_offloaded(hd C.kvpool_handle, rid *C.char, ridLen C.size_t) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	r, _, st := names(rid, ridLen, nil, 0, false)
	if st != statusOK {
		return st
	}
	ok, err := h.pool.IsOffloaded(r)
	if err != nil {
		return failErr(err)
	}
	if ok {
		return 1
	}
	return 0
}

//export kvpool_labels
func kvpool_labels(hd C.kvpool_handle, rid *C.char, ridLen C.size_t, buf *C.char, capacity C.size_t,
	ends *C.size_t, endsCap C.size_t, nLabels *C.size_t, nBytes *C.size_t) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	r, _, st := names(rid, ridLen, nil, 0, false)
	if st != statusOK {
		return st
	}
	if nLabels == nil || nBytes == nil {
		return invalid("labels: NULL size pointers")
	}
	if (buf == nil && capacity > 0) || (ends == nil && endsCap > 0) {
		return invalid("labels: NULL buffer with a capacity")
	}
	labels, err := h.pool.Labels(r)
	if err != nil {
		return failErr(err)
	}
	total := 0
	for _, l := range labels {
		total += len(l)
	}
	*nLabels, *nBytes = C.size_t(len(labels)), C.size_t(total)
	if uint64(endsCap) < uint64(len(labels)) || uint64(capacity) < uint64(total) {
		return fail(errBufferTooSmall, fmt.Errorf("kvpool: labels: need %d labels of %d bytes in all, buffers hold %d and %d",
			len(labels), total, uint64(endsCap), uint64(capacity)))
	}
	if len(labels) == 0 {
		return statusOK
	}
	dst := unsafe.Slice((*byte)(unsafe.Pointer(buf)), int(capacity))
	endv := unsafe.Slice((*C.size_t)(unsafe.Pointer(ends)), int(endsCap))
	off := 0
	for i, l := range labels {
		off += copy(dst[off:], l)
		endv[i] = C.size_t(off)
	}
	return statusOK
}

//export kvpool_num_pages
func kvpool_num_pages(hd C.kvpool_handle, rid *C.char, ridLen C.size_t, label *C.char, labelLen C.size_t, out *C.int64_t) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	r, l, st := names(rid, ridLen, label, labelLen, true)
	if st != statusOK {
		return st
	}
	if out == nil {
		return invalid("num_pages: NULL out")
	}
	n, err := h.pool.NumPages(r, l)
	if err != nil {
		return failErr(err)
	}
	*out = C.int64_t(n)
	return statusOK
}

//export kvpool_num_free_pages
func kvpool_num_free_pages(hd C.kvpool_handle, out *C.int64_t) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	if out == nil {
		return invalid("num_free_pages: NULL out")
	}
	n, err := h.pool.NumFreePages()
	if err != nil {
		return failErr(err)
	}
	*out = C.int64_t(n)
	return statusOK
}

//export kvpool_sync
func kvpool_sync(hd C.kvpool_handle, stream C.uint64_t) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	if err := h.pool.Sync(cudart.Stream(stream)); err != nil {
		return failErr(err)
	}
	return statusOK
}

//export kvpool_synchronize
func kvpool_synchronize(hd C.kvpool_handle) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	if err := h.pool.Synchronize(); err != nil {
		return failErr(err)
	}
	return statusOK
}

//export kvpool_stream_synchronize
func kvpool_stream_synchronize(hd C.kvpool_handle, stream C.uint64_t) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	if err := h.dev.StreamSynchronize(cudart.Stream(stream)); err != nil {
		return failErr(err)
	}
	return statusOK
}

//export kvpool_info_get
func kvpool_info_get(hd C.kvpool_handle, out *C.kvpool_info) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	if out == nil {
		return invalid("info: NULL out")
	}
	session, capacity, pageSize := h.pool.Session()
	out.session, out.capacity, out.host_page_bytes = C.uint64_t(session), C.int64_t(capacity), C.uint64_t(pageSize)
	out.device, out.simulated = C.int32_t(h.ordinal), 0
	if h.sim != nil {
		out.simulated = 1
	}
	return statusOK
}

//export kvpool_locality_get
func kvpool_locality_get(hd C.kvpool_handle, out *C.kvpool_locality) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	if out == nil || uintptr(out.struct_size) != localitySize {
		return invalid("locality: NULL out, or struct_size not %d", localitySize)
	}
	l := h.pool.Locality()
	out.gpu_numa, out.ranks, out.chunks = C.int32_t(l.GPUNUMA), C.int32_t(l.Ranks), C.int32_t(len(l.Chunks))
	out.local, out.remote, out.unknown = C.int32_t(l.Local), C.int32_t(l.Remote), C.int32_t(l.Unknown)
	return statusOK
}

//export kvpool_chunk_numa
func kvpool_chunk_numa(hd C.kvpool_handle, numa *C.int32_t, capacity C.int64_t, n *C.int64_t) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	if n == nil || capacity < 0 || (numa == nil && capacity > 0) {
		return invalid("chunk_numa: NULL count, or a negative capacity %d, or a NULL buffer of capacity %d", int64(capacity), int64(capacity))
	}
	l := h.pool.Locality()
	*n = C.int64_t(len(l.Chunks))
	if int64(capacity) < int64(len(l.Chunks)) {
		return fail(errBufferTooSmall, fmt.Errorf("kvpool: chunk_numa: %d chunks, room for %d", len(l.Chunks), int64(capacity)))
	}
	if len(l.Chunks) > 0 {
		out := unsafe.Slice((*int32)(unsafe.Pointer(numa)), len(l.Chunks))
		for i, c := range l.Chunks {
			out[i] = int32(c.NUMA)
		}
	}
	return statusOK
}

//export kvpool_disconnect
func kvpool_disconnect(hd C.kvpool_handle) C.int {
	h, st := lookup(hd)
	if h == nil {
		return st
	}
	h.pool.Disconnect()
	return statusOK
}
