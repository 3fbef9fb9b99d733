package cudart

import (
	"bytes"
	"errors"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// callerMemory is memory outside the Go heap, as a C or Python caller's
// buffer would be.
func callerMemory(t *testing.T, n int) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(b) })
	return b
}

func TestSimRegisterDeviceMemoryCopies(t *testing.T) {
	sim := NewSim(SimOptions{Devices: 2, CopyDelay: 0})
	dev, _ := sim.Open(1)
	mem := callerMemory(t, 8*4096)
	p, err := sim.RegisterDeviceMemory(1, mem)
	if err != nil {
		t.Fatal(err)
	}
	if uintptr(p) != uintptr(unsafe.Pointer(&mem[0])) {
		t.Fatalf("device pointer %#x is not the memory's address %p", uintptr(p), &mem[0])
	}
	// An allocation made after it lands elsewhere and the table stays sorted.
	q, err := dev.MemAlloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	host := make([]byte, 4096)
	if err := dev.HostRegister(host); err != nil {
		t.Fatal(err)
	}
	s, _ := dev.StreamCreate()
	src := randBytes(4096, 7)
	copy(host, src)
	// Host to the caller's memory at page 3, then caller's page 3 to the
	// allocation, then back to the host.
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(dev.MemcpyBatchAsync([]Copy{{Dst: uintptr(p) + 3*4096, Src: addr(host), Bytes: 4096}}, HostToDevice, s))
	must(dev.StreamSynchronize(s))
	if !bytes.Equal(mem[3*4096:4*4096], src) {
		t.Fatal("copy to registered device memory did not land in the caller's memory")
	}
	clear(host)
	must(dev.MemcpyBatchAsync([]Copy{{Dst: addr(host), Src: uintptr(p) + 3*4096, Bytes: 4096}}, DeviceToHost, s))
	must(dev.StreamSynchronize(s))
	if !bytes.Equal(host, src) {
		t.Fatal("copy from registered device memory read wrong bytes")
	}
	// Past the end is outside device memory.
	err = dev.MemcpyBatchAsync([]Copy{{Dst: addr(host), Src: uintptr(p) + 7*4096 + 1, Bytes: 4096}}, DeviceToHost, s)
	if !errors.Is(err, ErrInvalidValue) {
		t.Fatalf("copy past the registered range: %v", err)
	}
	must(dev.MemFree(q))
	must(sim.UnregisterDeviceMemory(1, p))
	err = dev.MemcpyBatchAsync([]Copy{{Dst: addr(host), Src: uintptr(p), Bytes: 4096}}, DeviceToHost, s)
	if !errors.Is(err, ErrInvalidValue) {
		t.Fatalf("copy after unregister: %v", err)
	}
}

func TestSimRegisterDeviceMemoryMisuse(t *testing.T) {
	sim := NewSim(SimOptions{Devices: 1})
	dev, _ := sim.Open(0)
	mem := callerMemory(t, 4*4096)
	p, err := sim.RegisterDeviceMemory(0, mem[4096:3*4096])
	if err != nil {
		t.Fatal(err)
	}
	alloc, err := dev.MemAlloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		do   func() error
		want error
	}{
		{"bad ordinal", func() error { _, err := sim.RegisterDeviceMemory(1, mem); return err }, ErrInvalidDevice},
		{"negative ordinal", func() error { _, err := sim.RegisterDeviceMemory(-1, mem); return err }, ErrInvalidDevice},
		{"empty", func() error { _, err := sim.RegisterDeviceMemory(0, mem[:0]); return err }, ErrInvalidValue},
		{"overlap from below", func() error { _, err := sim.RegisterDeviceMemory(0, mem[:4097]); return err }, ErrInvalidValue},
		{"overlap from above", func() error { _, err := sim.RegisterDeviceMemory(0, mem[3*4096-1:]); return err }, ErrInvalidValue},
		{"same range twice", func() error { _, err := sim.RegisterDeviceMemory(0, mem[4096:3*4096]); return err }, ErrInvalidValue},
		{"MemFree of registered memory", func() error { return dev.MemFree(p) }, ErrInvalidValue},
		{"unregister an allocation", func() error { return sim.UnregisterDeviceMemory(0, alloc) }, ErrInvalidValue},
		{"unregister inside the range", func() error { return sim.UnregisterDeviceMemory(0, p+1) }, ErrInvalidValue},
		{"unregister on another ordinal", func() error { return sim.UnregisterDeviceMemory(3, p) }, ErrInvalidDevice},
	} {
		if err := c.do(); !errors.Is(err, c.want) {
			t.Errorf("%s: got %v, want %v", c.name, err, c.want)
		}
	}
	// Nothing above changed the registration: it still copies, and the
	// neighbours on either side are still free to register.
	host := make([]byte, 4096)
	dev.HostRegister(host)
	if err := dev.MemcpyHtoD(p+4096, host); err != nil {
		t.Fatalf("registration lost after refused calls: %v", err)
	}
	if _, err := sim.RegisterDeviceMemory(0, mem[:4096]); err != nil {
		t.Fatalf("adjacent range below: %v", err)
	}
	if _, err := sim.RegisterDeviceMemory(0, mem[3*4096:]); err != nil {
		t.Fatalf("adjacent range above: %v", err)
	}
	dev.Close()
	if _, err := sim.RegisterDeviceMemory(0, mem); !errors.Is(err, ErrInvalidHandle) {
		t.Fatalf("register on a closed device: %v", err)
	}
}
