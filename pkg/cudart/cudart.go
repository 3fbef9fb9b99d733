// Package cudart is the narrow seam between kvpool's client and CUDA.
//
// It exposes only what moving KV pages needs: device memory (for tests and
// tools), page-locking of host memory for DMA, streams, batched asynchronous
// copies, events, and making one stream wait on an event. The calls mirror the
// CUDA driver API (cuMemHostRegister, cuMemcpyBatchAsync, cuEventRecord,
// cuStreamWaitEvent, cuStreamSynchronize, ...) so the real backend is a thin
// binding, and the simulator in this package behaves the same way on a CPU:
// copies run later, in stream order, on their stream's own goroutine.
//
// Load picks the backend: the CUDA driver, opened from libcuda.so.1 at run
// time (no toolkit at build time; entry points resolved by version through
// cuGetProcAddress), when it loads and a device answers, else the
// simulator. Layout describes an engine's KV pages in device memory and
// Mover moves them on a copy stream per direction, ordered against the
// caller's stream by events. docs/gpu.md has the details.
//
// The package knows nothing about pools, sessions or sockets.
package cudart

import (
	"encoding/hex"
	"errors"
	"fmt"
)

// DevicePtr is a device virtual address (CUdeviceptr).
type DevicePtr uintptr

// Stream is a copy queue (CUstream). Work on one stream runs in order; work on
// different streams may overlap. The zero Stream is the device's default
// stream.
type Stream uintptr

// Event marks a point in a stream (CUevent). Waiting on an event waits for the
// work that was enqueued on its stream before the most recent EventRecord.
// An event that was never recorded counts as complete, as in CUDA.
type Event uintptr

// Direction says which side of a copy is on the device.
type Direction uint8

const (
	// HostToDevice copies from registered host memory to device memory.
	HostToDevice Direction = iota + 1
	// DeviceToHost copies from device memory to registered host memory.
	DeviceToHost
)

func (d Direction) String() string {
	switch d {
	case HostToDevice:
		return "HtoD"
	case DeviceToHost:
		return "DtoH"
	}
	return fmt.Sprintf("Direction(%d)", uint8(d))
}

// Copy is one contiguous transfer of a batch. Dst and Src are addresses: the
// device side is a DevicePtr value, the host side the address of registered
// host memory.
type Copy struct {
	Dst, Src uintptr
	Bytes    uint64
}

// Driver enumerates devices of one backend.
type Driver interface {
	// Name is "cuda" or "sim".
	Name() string
	// DeviceCount returns the number of visible devices.
	DeviceCount() (int, error)
	// Open returns a handle on device ordinal with its primary context
	// current for the calls made through it.
	Open(ordinal int) (Device, error)
}

// Device is one GPU as the client uses it. Implementations are safe for
// concurrent use.
type Device interface {
	Ordinal() int
	// UUID names the GPU as NVML and nvidia-smi do ("GPU-" and 32 hex
	// digits, cuDeviceGetUuid): unlike the ordinal, it is the same inside
	// a container and on the host, so the agent knows which GPU it is.
	UUID() string

	// MemAlloc and MemFree manage device memory (cuMemAlloc, cuMemFree).
	MemAlloc(bytes uint64) (DevicePtr, error)
	MemFree(p DevicePtr) error
	// MemcpyHtoD and MemcpyDtoH are synchronous copies for setup and
	// verification (cuMemcpyHtoD, cuMemcpyDtoH): the bytes have landed
	// when they return. They do not order against other streams;
	// synchronize first.
	MemcpyHtoD(dst DevicePtr, src []byte) error
	MemcpyDtoH(dst []byte, src DevicePtr) error

	// HostRegister page-locks b for DMA (cuMemHostRegister). Only registered
	// host memory may be the host side of an async copy.
	HostRegister(b []byte) error
	HostUnregister(b []byte) error

	StreamCreate() (Stream, error)
	StreamDestroy(s Stream) error
	StreamSynchronize(s Stream) error

	EventCreate() (Event, error)
	EventDestroy(e Event) error
	EventRecord(e Event, s Stream) error
	EventSynchronize(e Event) error
	// EventQuery reports whether the event's work has completed.
	EventQuery(e Event) (bool, error)
	// StreamWaitEvent makes later work on s wait for e (cuStreamWaitEvent).
	StreamWaitEvent(s Stream, e Event) error

	// MemcpyBatchAsync enqueues copies on s, all in direction dir
	// (cuMemcpyBatchAsync, or cuMemcpyAsync per copy where the driver lacks
	// batching). Every range is validated before anything is enqueued.
	// copies is the caller's again once the call returns.
	MemcpyBatchAsync(copies []Copy, dir Direction, s Stream) error

	// LaunchHostFunc enqueues fn on s (cuLaunchHostFunc). fn must not call
	// back into the Device.
	LaunchHostFunc(s Stream, fn func()) error

	// Close releases what the handle created.
	Close() error
}

// FormatUUID writes a CUuuid as NVML does: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
func FormatUUID(b [16]byte) string {
	h := hex.EncodeToString(b[:])
	return "GPU-" + h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// SimulatedUUID is the UUID of simulated GPU index, "GPU-sim-%08d". The
// simulator's devices and internal/gpu's simulated GPUs (the agent's plan in
// standalone mode or with --simulate-gpus) both use it, so a client on
// simulated device i names the agent's simulated GPU i.
func SimulatedUUID(index int) string { return fmt.Sprintf("GPU-sim-%08d", index) }

// Error is a failed CUDA call: the call's name and the driver's error.
type Error struct {
	Call string // e.g. "cuMemcpyBatchAsync"
	Code int    // CUresult
	Name string // e.g. "CUDA_ERROR_INVALID_VALUE"
	Msg  string // the driver's description, or detail from the simulator
}

func (e *Error) Error() string {
	if e.Msg == "" {
		return fmt.Sprintf("%s: %s (%d)", e.Call, e.Name, e.Code)
	}
	return fmt.Sprintf("%s: %s (%d): %s", e.Call, e.Name, e.Code, e.Msg)
}

// Is matches errors with the same Code, so errors.Is(err, ErrInvalidValue)
// works for both backends.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Call == "" && t.Code == e.Code
}

// CUresult codes this package names. Sentinels carry no call and match any
// *Error with the same code.
var (
	ErrInvalidValue      = &Error{Code: 1, Name: "CUDA_ERROR_INVALID_VALUE"}
	ErrOutOfMemory       = &Error{Code: 2, Name: "CUDA_ERROR_OUT_OF_MEMORY"}
	ErrNoDevice          = &Error{Code: 100, Name: "CUDA_ERROR_NO_DEVICE"}
	ErrInvalidDevice     = &Error{Code: 101, Name: "CUDA_ERROR_INVALID_DEVICE"}
	ErrInvalidHandle     = &Error{Code: 400, Name: "CUDA_ERROR_INVALID_HANDLE"}
	ErrNotReady          = &Error{Code: 600, Name: "CUDA_ERROR_NOT_READY"}
	ErrHostRegistered    = &Error{Code: 712, Name: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"}
	ErrHostNotRegistered = &Error{Code: 713, Name: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"}
	ErrNotSupported      = &Error{Code: 801, Name: "CUDA_ERROR_NOT_SUPPORTED"}
)

func callErr(call string, kind *Error, format string, args ...any) error {
	return &Error{Call: call, Code: kind.Code, Name: kind.Name, Msg: fmt.Sprintf(format, args...)}
}

// ErrNoDriver is returned when no CUDA driver can be loaded.
var ErrNoDriver = errors.New("cudart: CUDA driver not available")
