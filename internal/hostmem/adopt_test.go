package hostmem

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"os"
	"testing"

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

	c, err := Adopt(kept, size, -1, true, false)
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
	if c, err := Adopt(f, 1<<20, -1, false, false); err == nil {
		c.Close()
		t.Fatal("adopted /dev/null")
	}
	c, err := Alloc(Options{Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if a, err := Adopt(c.File, 0, -1, false, false); err == nil {
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
