package hostmem

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A kept chunk adopted by a new agent: mapped and locked on fault at once
// (nothing of it in the new mapping yet), then faulted in a step at a time:
// every page in place and locked, and every byte what the earlier agent's
// tenants wrote (FaultIn reads and writes nothing). The earlier agent's
// own mapping stands for the keeper, which holds the file meanwhile.
func TestAdoptThenFaultIn(t *testing.T) {
	const size = 3*FaultInStep/2 + 64<<10 // a step and a half and a bit: a short last step
	old, err := Alloc(Options{Size: size, Prefault: true, Lock: true, LockFallback: true})
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, size)
	_, _ = rand.NewChaCha8([32]byte{25}).Read(want) // never fails
	copy(old.Mem, want)
	kept, err := dupFile(old.File)
	if err != nil {
		t.Fatal(err)
	}
	if err := old.Close(); err != nil { // the earlier agent is gone; the keeper's fd holds the pages
		t.Fatal(err)
	}

	info, err := Inspect(kept)
	if err != nil || info != (FileInfo{Size: size, PageSize: int64(os.Getpagesize()), Seals: Seals}) {
		t.Fatalf("the kept memfd: %+v, %v; want %d bytes of %d-byte pages, seals %#x", info, err, size, os.Getpagesize(), Seals)
	}
	c, err := Adopt(kept, info, -1, true, false)
	if errors.Is(err, ErrMemlock) {
		t.Skipf("cannot lock here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if !c.Locked || !c.Sealed || c.Size != size || c.PageSize != int64(os.Getpagesize()) {
		t.Fatalf("adopted chunk %+v: want locked, sealed, %d bytes of %d-byte pages", c, size, os.Getpagesize())
	}
	if rss, _ := resident(t, c.Mem); rss > size/4 {
		t.Errorf("Adopt faulted %d of %d bytes in itself; it should leave that to FaultIn", rss, size)
	}
	for off := 0; off < size; off += FaultInStep {
		if err := FaultIn(c.Mem[off:min(off+FaultInStep, size)]); err != nil {
			t.Fatal(err)
		}
	}
	if rss, locked := resident(t, c.Mem); rss != size || locked != size {
		t.Errorf("after FaultIn: Rss %d, Locked %d, want %d each", rss, locked, size)
	}
	if !bytes.Equal(c.Mem, want) {
		t.Fatal("the adopted chunk's bytes differ from what was written before")
	}
	if err := FaultIn(nil); err != nil {
		t.Errorf("FaultIn of nothing: %v", err)
	}
}

// Adopt refuses what it cannot map, and leaves nothing mapped.
func TestAdoptRefuses(t *testing.T) {
	f, err := os.Open("/dev/null")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := Inspect(f); err == nil || !strings.Contains(err.Error(), "not a regular (memory) file") {
		t.Fatalf("inspecting /dev/null as a memfd: %v, want it refused as no regular file", err)
	}
	// A regular file that no memory file system holds (a file of tmpfs
	// has seals, F_SEAL_SEAL, as a memfd does).
	plain, err := os.Open("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if _, err := Inspect(plain); err == nil || !strings.Contains(err.Error(), "F_GET_SEALS") {
		t.Fatalf("inspecting a file that is no memfd: %v, want its seals refused", err)
	}
	if c, err := Adopt(f, FileInfo{Size: 1 << 20}, -1, false, false); err == nil {
		c.Close()
		t.Fatal("adopted /dev/null")
	}
	c, err := Alloc(Options{Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if a, err := Adopt(c.File, FileInfo{}, -1, false, false); err == nil {
		a.Close()
		t.Fatal("adopted a chunk of 0 bytes")
	}
}

func dupFile(f *os.File) (*os.File, error) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}

// A mapping of several unmap steps goes whole, and the chunk handed off to
// the keeper maps nothing until it is mapped again (and locked on fault).
func TestHandOffUnmapMapAgain(t *testing.T) {
	size := int64(unmapStep*2 + unmapStep/2) // sparse: no page is touched
	fd, err := unix.MemfdCreate("handoff", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "handoff")
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	c, err := Adopt(f, FileInfo{Size: size, PageSize: 4096}, -1, false, false)
	if err != nil {
		t.Fatal(err)
	}
	if !mapped(t, uintptr(unsafe.Pointer(&c.Mem[size-4096]))) {
		t.Fatal("the adopted chunk's last page is not mapped")
	}
	mem := c.HandOff()
	if c.Mem != nil || !c.Kept || len(mem) != int(size) {
		t.Fatalf("handed off: mem %d bytes, kept %v", len(c.Mem), c.Kept)
	}
	if err := Unmap(mem); err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, unmapStep, size - 4096} {
		if mapped(t, uintptr(unsafe.Pointer(&mem[off]))) {
			t.Fatalf("still mapped at %d after Unmap", off)
		}
	}
	// A chunk handed off again (a new keeper took its lock) has nothing
	// left to unmap.
	if err := Unmap(c.HandOff()); err != nil {
		t.Fatalf("unmap of no mapping: %v", err)
	}
	if err := c.MapAgain(true); err != nil || c.Mem == nil || c.Kept {
		t.Fatalf("map again: %v (mapped %v, kept %v)", err, c.Mem != nil, c.Kept)
	}
	if err := c.MapAgain(true); err == nil {
		t.Fatal("a mapped chunk mapped again")
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
}

// mapped reports whether a mapping of this process covers addr
// (/proc/self/maps).
func mapped(t *testing.T, addr uintptr) bool {
	t.Helper()
	data, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(data), "\n") {
		var lo, hi uintptr
		if n, _ := fmt.Sscanf(l, "%x-%x", &lo, &hi); n == 2 && addr >= lo && addr < hi {
			return true
		}
	}
	return false
}

// Unmap lets go of its slice and nothing else: a mapping made meanwhile in
// a range an earlier step freed (the agent allocates chunks while it hands
// others off) stays.
func TestUnmapOnlyItsSlice(t *testing.T) {
	size := int64(unmapStep * 2)
	newFile := func() *os.File {
		fd, err := unix.MemfdCreate("unmap", unix.MFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		f := os.NewFile(uintptr(fd), "unmap")
		t.Cleanup(func() { f.Close() })
		if err := f.Truncate(size); err != nil {
			t.Fatal(err)
		}
		return f
	}
	a, err := Map(newFile(), size)
	if err != nil {
		t.Fatal(err)
	}
	if err := Unmap(a[:unmapStep]); err != nil {
		t.Fatal(err)
	}
	// Another mapping exactly where the first step was.
	bf := newFile()
	p, err := unix.MmapPtr(int(bf.Fd()), 0, unsafe.Pointer(&a[0]), unmapStep, unix.PROT_READ, unix.MAP_SHARED|unix.MAP_FIXED_NOREPLACE)
	if err != nil {
		t.Skipf("cannot map at a chosen address here: %v", err)
	}
	b := unsafe.Slice((*byte)(p), unmapStep)
	defer Unmap(b)
	if err := Unmap(a[unmapStep:]); err != nil {
		t.Fatal(err)
	}
	if !mapped(t, uintptr(p)) || !mapped(t, uintptr(p)+unmapStep-1) {
		t.Fatal("Unmap of the rest of a mapping unmapped another one made where its first step was")
	}
	if mapped(t, uintptr(unsafe.Pointer(&a[unmapStep]))) {
		t.Fatal("the rest of the first mapping is still mapped")
	}
}
