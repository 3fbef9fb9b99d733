//go:build cgo

package cudart

// #include <stdlib.h>
// #include "cuda_shim.h"
import "C"

import (
	_ "embed"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"unsafe"
)

// The copy kernel moves a batch's small runs with the GPU's own threads,
// reading or writing the registered host pages in place, where the copy
// engine's path pays the driver about a microsecond to enqueue each copy:
// on an H200, 4,096 copies of 4 KiB took 1.6-3.6 ms to enqueue and moved
// 0.08-0.19 of a 1 GiB pinned copy's bandwidth, the kernel 0.88-0.92
// (docs/benchmarks.md, "The copy kernel"). Runs over 32 KiB stay with the
// copy engine, which moves 64 KiB and more at 0.97-1.00 of that floor.

//go:embed copyruns.ptx
var copyRunsPTX string

const (
	// copyKernelRuns is how many runs one launch carries in its parameter
	// (runs[32640] in copyruns.ptx: 24 bytes a run, under the 32,764-byte
	// limit of CUDA 12.1 and Volta on).
	copyKernelRuns = 1360
	// copyKernelMaxRun is the largest run the kernel copies; larger ones
	// go to the copy engine.
	copyKernelMaxRun = 32 << 10
	// copyKernelAlign: the kernel moves 16-byte vectors, so a run's
	// addresses and length must be multiples of it.
	copyKernelAlign = 16
	// maxRanges bounds the device allocations the kernel remembers (an
	// engine's KV cache is a few, or one per layer).
	maxRanges = 1024
)

// kernelState says, for Load's log line, whether the copy kernel may be
// used ("on": it is loaded at a device's first batch with small runs) or
// why not.
func (d *cudaDriver) kernelState() string {
	if d.kernelOff != nil {
		return "off: " + d.kernelOff.Error()
	}
	return "on"
}

// copyKernel is a device's copy kernel: loaded at the first batch that has
// runs for it, and the device allocations its runs were checked against.
type copyKernel struct {
	mu     sync.Mutex
	tried  bool
	module unsafe.Pointer
	fn     unsafe.Pointer
	err    error // why the kernel is not used (nil once loaded)
	ranges []devRange
	epoch  uint64 // of the batch being split
}

// devRange is a device allocation, as cuMemGetAddressRange reports it, and
// the batch in which the driver last confirmed it.
type devRange struct {
	base, end uint64
	epoch     uint64
}

// load loads the kernel's module once; callers hold k.mu.
func (k *copyKernel) load(d *cudaDevice) bool {
	if k.tried {
		return k.fn != nil
	}
	k.tried = true
	src := C.CString(copyRunsPTX)
	defer C.free(unsafe.Pointer(src))
	name := C.CString("kv_copy_runs")
	defer C.free(unsafe.Pointer(name))
	var mod, fn unsafe.Pointer
	if r := C.kv_load_kernel(d.drv.api, d.ctx, src, name, &mod, &fn); r != 0 {
		k.err = fmt.Errorf("load the copy kernel: %w", d.err("cuModuleLoadData", r))
		return false
	}
	k.module, k.fn = mod, fn
	return true
}

// unload releases the module; callers hold the device's lock for Close.
func (k *copyKernel) unload(d *cudaDevice) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.module == nil {
		return nil
	}
	r := C.kv_unload_kernel(d.drv.api, d.ctx, k.module)
	k.module, k.fn = nil, nil
	k.err = errors.New("device closed")
	if r != 0 {
		return d.err("cuModuleUnload", r)
	}
	return nil
}

// state reports whether the kernel is loaded and, when it is not, why
// (nil before the first batch with small runs tried to load it).
func (k *copyKernel) state() (bool, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.fn != nil, k.err
}

// split returns the runs the kernel may copy and the rest, each in the
// order given (the rest is runs itself when the kernel gets none). A run
// goes to the kernel when it is small (copyKernelMaxRun), 16-byte aligned
// on both sides and its device side lies in one allocation the driver
// confirmed during this batch (the host side was checked as registered
// memory): the kernel must never touch an address the copy engine would
// have refused, since a fault in a kernel ends the process's CUDA context
// where a refused copy only fails.
func (k *copyKernel) split(d *cudaDevice, runs []Copy, dir Direction) (kern, ce []Copy) {
	if d.drv.kernelOff != nil || !slices.ContainsFunc(runs, kernelSized) {
		return nil, runs
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.load(d) {
		return nil, runs
	}
	k.epoch++
	last := -1 // the allocation of the previous run: most runs share one
	for _, c := range runs {
		dev := uint64(c.Dst)
		if dir == DeviceToHost {
			dev = uint64(c.Src)
		}
		ok := false
		if kernelSized(c) {
			if last >= 0 && dev >= k.ranges[last].base && dev+c.Bytes <= k.ranges[last].end && dev+c.Bytes > dev {
				ok = true // confirmed in this batch already
			} else {
				last, ok = k.inAllocation(d, dev, c.Bytes)
			}
		}
		if ok {
			kern = append(kern, c)
		} else {
			ce = append(ce, c)
		}
	}
	return kern, ce
}

func kernelSized(c Copy) bool {
	return c.Bytes <= copyKernelMaxRun && (uint64(c.Dst)|uint64(c.Src)|c.Bytes)%copyKernelAlign == 0
}

// inAllocation reports whether [p, p+n) lies in one device allocation,
// asking the driver about each allocation once a batch: the first time it
// is seen, and again in every later batch that uses it (it may have been
// freed since). It returns the allocation's index in k.ranges (-1 when p
// is in none), confirmed for this batch.
func (k *copyKernel) inAllocation(d *cudaDevice, p, n uint64) (int, bool) {
	i := sort.Search(len(k.ranges), func(i int) bool { return k.ranges[i].base > p }) - 1
	if i >= 0 && p < k.ranges[i].end && k.ranges[i].epoch != k.epoch {
		// Seen before: confirm it for this batch.
		base, size, ok := d.addressRange(k.ranges[i].base)
		if ok && base == k.ranges[i].base && base+size == k.ranges[i].end {
			k.ranges[i].epoch = k.epoch
		} else {
			k.ranges = append(k.ranges[:i], k.ranges[i+1:]...)
			i = -1
		}
	}
	if i < 0 || p >= k.ranges[i].end {
		base, size, ok := d.addressRange(p)
		if !ok {
			return -1, false
		}
		i = k.insert(devRange{base: base, end: base + size, epoch: k.epoch})
	}
	return i, p+n <= k.ranges[i].end && p+n > p
}

// insert adds r, dropping the ranges it overlaps (allocations freed and
// their addresses reused), and returns its index. A list at maxRanges
// also drops every range this batch has not confirmed (each is asked
// about again when next used), so that a process that allocates and frees
// without end does not grow it without end.
func (k *copyKernel) insert(r devRange) int {
	full := len(k.ranges) >= maxRanges
	kept := k.ranges[:0]
	for _, x := range k.ranges {
		if (x.end <= r.base || x.base >= r.end) && (!full || x.epoch == r.epoch) {
			kept = append(kept, x)
		}
	}
	i := sort.Search(len(kept), func(i int) bool { return kept[i].base > r.base })
	kept = append(kept, devRange{})
	copy(kept[i+1:], kept[i:])
	kept[i] = r
	k.ranges = kept
	return i
}

// addressRange asks the driver for the allocation that holds p.
func (d *cudaDevice) addressRange(p uint64) (base, size uint64, ok bool) {
	var b C.kv_dptr
	var s C.size_t
	if C.kv_address_range(d.drv.api, d.ctx, C.kv_dptr(p), &b, &s) != 0 {
		return 0, 0, false
	}
	return uint64(b), uint64(s), true
}

// launch enqueues the kernel on s for runs, copyKernelRuns a launch. On
// failure it returns the index of the first run of the launch that failed.
func (k *copyKernel) launch(d *cudaDevice, runs []Copy, s Stream) (int, error) {
	k.mu.Lock()
	fn := k.fn
	k.mu.Unlock()
	var idx C.size_t
	if r := C.kv_launch_runs(d.drv.api, d.ctx, fn, (*C.kv_copy)(unsafe.Pointer(&runs[0])), C.size_t(len(runs)),
		copyKernelRuns, cstream(s), &idx); r != 0 {
		return int(idx), d.err("cuLaunchKernel", r)
	}
	return 0, nil
}
