package cudart

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
)

// MinDriverVersion is the oldest CUDA driver the real backend accepts
// (12.0: the first with cuGetProcAddress_v2, which resolves every entry
// point by version).
const MinDriverVersion = 12000

// DefaultLibrary is the driver library the real backend loads.
const DefaultLibrary = "libcuda.so.1"

// LibraryEnv, when set, names the driver library to load instead of
// DefaultLibrary (an absolute path, or a name the dynamic loader searches).
const LibraryEnv = "KVPOOL_CUDA_LIBRARY"

// KernelEnv, when "off", keeps every copy on the copy engine, as
// Options.NoKernel does ("on" or empty: the default).
const KernelEnv = "KVPOOL_COPY_KERNEL"

// ErrDriverTooOld is returned when the loaded driver is older than
// MinDriverVersion or lacks an entry point kvpool needs.
var ErrDriverTooOld = errors.New("cudart: CUDA driver too old")

// Backend names accepted by Options.Backend.
const (
	BackendAuto = "auto"
	BackendCUDA = "cuda"
	BackendSim  = "sim"
)

// Options selects and configures a backend.
type Options struct {
	// Backend is "auto" (the default when empty), "cuda" or "sim". Auto
	// picks the real driver when it loads and at least one device answers,
	// and the simulator otherwise; "cuda" fails instead of falling back.
	Backend string
	// Library is the driver library; empty means $KVPOOL_CUDA_LIBRARY, then
	// DefaultLibrary.
	Library string
	// NoBatch makes the real backend skip cuMemcpyBatchAsync and issue one
	// cuMemcpyAsync per merged run, as on drivers older than 12.8: an
	// escape hatch should a driver's batch path misbehave.
	NoBatch bool
	// NoKernel keeps every copy on the copy engine. By default the real
	// backend copies a batch's small runs (32 KiB and less) with a kernel
	// of its own, which reads or writes the registered host pages in place
	// and is enqueued in a few launches where the copy engine needs the
	// driver to enqueue each copy (docs/gpu.md, "The copy kernel").
	// $KVPOOL_COPY_KERNEL=off does the same.
	NoKernel bool
	// Sim configures the simulator when it is chosen.
	Sim SimOptions
	// Logger receives the one line that says which backend was chosen and
	// why; nil means slog.Default().
	Logger *slog.Logger
}

// Choice says which backend Load picked and why.
type Choice struct {
	Backend string // "cuda" or "sim"
	// Reason is why: "driver 13.0, 1 device (NVIDIA H200)", "asked for",
	// or why the real driver could not be used.
	Reason string
	// Library is the driver library that was tried ("" when none was).
	Library string
	// DriverVersion is the driver's CUDA version (e.g. 13000), 0 when
	// unknown.
	DriverVersion int
	// Devices is the number of devices of the chosen backend.
	Devices int
	// BatchABI is the bound cuMemcpyBatchAsync variant (12080, 13000) or 0
	// when copies fall back to cuMemcpyAsync per merged run.
	BatchABI int
}

func (c Choice) String() string { return c.Backend + ": " + c.Reason }

// FormatVersion writes a CUDA version number such as 12080 as "12.8".
func FormatVersion(v int) string { return fmt.Sprintf("%d.%d", v/1000, v%1000/10) }

// Load returns the driver of the chosen backend and logs one line saying
// which and why. With Backend "cuda" every failure is returned: a missing
// library (wrapping ErrNoDriver), a driver older than MinDriverVersion
// (ErrDriverTooOld), or a failed CUDA call (*Error, naming the call and the
// driver's error string). With "auto" those failures select the simulator
// and become the Choice's Reason.
func Load(o Options) (Driver, Choice, error) {
	log := o.Logger
	if log == nil {
		log = slog.Default()
	}
	lib := o.Library
	if lib == "" {
		lib = os.Getenv(LibraryEnv)
	}
	if lib == "" {
		lib = DefaultLibrary
	}
	backend := o.Backend
	if backend == "" {
		backend = BackendAuto
	}
	noKernel := o.NoKernel
	switch v := os.Getenv(KernelEnv); v {
	case "", "on":
	case "off":
		noKernel = true
	default:
		return nil, Choice{}, fmt.Errorf("cudart: %s=%q: want \"on\" or \"off\"", KernelEnv, v)
	}
	sim := func(reason string, lib string) (Driver, Choice, error) {
		s := NewSim(o.Sim)
		n, _ := s.DeviceCount()
		c := Choice{Backend: BackendSim, Reason: reason, Library: lib, Devices: n}
		log.Info("cudart: using the simulator", "reason", reason, "devices", n)
		return s, c, nil
	}
	switch backend {
	case BackendSim:
		return sim("asked for", "")
	case BackendAuto, BackendCUDA:
	default:
		return nil, Choice{}, fmt.Errorf("cudart: unknown backend %q (want %q, %q or %q)", o.Backend, BackendAuto, BackendCUDA, BackendSim)
	}
	d, c, err := loadCUDA(lib, o.NoBatch, noKernel)
	if err != nil {
		if backend == BackendCUDA {
			return nil, c, fmt.Errorf("backend %q: %w", BackendCUDA, err)
		}
		return sim(err.Error(), lib)
	}
	log.Info("cudart: using the CUDA driver", "reason", c.Reason, "library", lib,
		"driver", FormatVersion(c.DriverVersion), "devices", c.Devices, "batch_abi", c.BatchABI,
		"copy_kernel", d.(*cudaDriver).kernelState())
	return d, c, nil
}

func loadCUDA(lib string, noBatch, noKernel bool) (Driver, Choice, error) {
	c := Choice{Backend: BackendCUDA, Library: lib}
	d, err := openCUDA(lib, noBatch, noKernel)
	if err != nil {
		return nil, c, err
	}
	c.DriverVersion = d.Version()
	c.BatchABI = d.BatchABI()
	n, err := d.DeviceCount()
	if err != nil {
		return nil, c, err
	}
	if n == 0 {
		return nil, c, callErr("cuDeviceGetCount", ErrNoDevice, "driver %s answers but reports no devices", FormatVersion(c.DriverVersion))
	}
	c.Devices = n
	plural := "s"
	if n == 1 {
		plural = ""
	}
	c.Reason = fmt.Sprintf("driver %s, %d device%s", FormatVersion(c.DriverVersion), n, plural)
	if name := d.deviceName(0); name != "" {
		c.Reason += " (" + name + ")"
	}
	return d, c, nil
}
