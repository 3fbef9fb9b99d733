package cudart

import (
	"sort"
)

// RegisterDeviceMemory makes mem, memory the caller owns (a CPU tensor, a
// numpy array, any host buffer), device memory of simulated device ordinal
// at its own address: copies to and from DevicePtr(address of mem's first
// byte) and onwards read and write mem itself. This is how a process that
// holds its KV cache in host memory (the Python client's tests, a C program)
// runs the real address arithmetic, batching and fences on the simulator.
//
// The range must not overlap device memory of the device, allocated or
// registered. It does not count against SimOptions.MemoryBytes. The caller
// keeps mem alive and unmoved until UnregisterDeviceMemory (the simulator
// copies into it from stream goroutines): memory outside the Go heap, or
// pinned, is what this is for.
func (s *Sim) RegisterDeviceMemory(ordinal int, mem []byte) (DevicePtr, error) {
	const call = "simRegisterDeviceMemory"
	d, err := s.simDev(call, ordinal)
	if err != nil {
		return 0, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen(call); err != nil {
		return 0, err
	}
	if len(mem) == 0 {
		return 0, callErr(call, ErrInvalidValue, "empty range")
	}
	base := addr(mem)
	end := base + uintptr(len(mem))
	if end < base {
		return 0, callErr(call, ErrInvalidValue, "range %#x+%d wraps", base, len(mem))
	}
	if d.overlap(base, end) >= 0 {
		return 0, callErr(call, ErrInvalidValue, "range %#x+%d overlaps device memory", base, len(mem))
	}
	d.insertAlloc(devAlloc{base: base, mem: mem, external: true})
	return DevicePtr(base), nil
}

// UnregisterDeviceMemory ends a registration made by RegisterDeviceMemory.
// Copies already enqueued that touch the range still run: synchronize the
// streams that use it first.
func (s *Sim) UnregisterDeviceMemory(ordinal int, p DevicePtr) error {
	const call = "simUnregisterDeviceMemory"
	d, err := s.simDev(call, ordinal)
	if err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen(call); err != nil {
		return err
	}
	i := sort.Search(len(d.allocs), func(i int) bool { return d.allocs[i].base >= uintptr(p) })
	if i == len(d.allocs) || d.allocs[i].base != uintptr(p) || !d.allocs[i].external {
		return callErr(call, ErrInvalidValue, "%#x is not the start of registered device memory", uintptr(p))
	}
	d.allocs = append(d.allocs[:i], d.allocs[i+1:]...)
	return nil
}

func (s *Sim) simDev(call string, ordinal int) (*simDevice, error) {
	if ordinal < 0 || ordinal >= len(s.devs) {
		return nil, callErr(call, ErrInvalidDevice, "ordinal %d, have %d simulated devices", ordinal, len(s.devs))
	}
	return s.devs[ordinal], nil
}

// overlap returns the index of a device range overlapping [base, end), or -1.
func (d *simDevice) overlap(base, end uintptr) int {
	i := sort.Search(len(d.allocs), func(i int) bool { return d.allocs[i].base >= base })
	if i < len(d.allocs) && d.allocs[i].base < end {
		return i
	}
	if i > 0 && d.allocs[i-1].base+uintptr(len(d.allocs[i-1].mem)) > base {
		return i - 1
	}
	return -1
}

// skipExternal moves a MemAlloc address past registered caller memory that
// [base, base+n) would overlap.
func (d *simDevice) skipExternal(base uintptr, n uint64) uintptr {
	for {
		i := d.overlap(base, base+uintptr(n))
		if i < 0 {
			return base
		}
		a := d.allocs[i]
		base = (a.base+uintptr(len(a.mem))+simAlign-1)/simAlign*simAlign + 64<<10
	}
}

// insertAlloc adds a to d.allocs, which stays sorted by base.
func (d *simDevice) insertAlloc(a devAlloc) {
	i := sort.Search(len(d.allocs), func(i int) bool { return d.allocs[i].base >= a.base })
	d.allocs = append(d.allocs, devAlloc{})
	copy(d.allocs[i+1:], d.allocs[i:])
	d.allocs[i] = a
}
