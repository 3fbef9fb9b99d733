package e2e

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// TestChunkFilesSeeTheMappedMemory checks the reclaim scenario's probe
// without a node: it finds a process's chunk memfds by chunk ID through
// /proc/<pid>/fd, its writes land in the memory the process has mapped
// without resizing the file, and it sees that memory zeroed.
func TestChunkFilesSeeTheMappedMemory(t *testing.T) {
	const size = 1 << 20
	fds := map[string]int{}
	maps := map[string][]byte{}
	for _, id := range []string{"gpu0-numaX-3", "gpu1-numa0-13"} {
		fd, err := unix.MemfdCreate("kvpool-"+id, unix.MFD_CLOEXEC)
		if err != nil {
			t.Skipf("memfd_create: %v", err)
		}
		t.Cleanup(func() { unix.Close(fd) })
		if err := unix.Ftruncate(fd, size); err != nil {
			t.Fatal(err)
		}
		m, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Munmap(m) })
		fds[id], maps[id] = fd, m
	}
	// An ID that is a suffix of another chunk's ID must not match it.
	files := chunkFiles(t, os.Getpid(), []string{"gpu0-numaX-3", "gpu1-numa0-13", "numa0-13", "gpu1-numa0-1"})
	if len(files) != 2 || files["gpu0-numaX-3"] == "" || files["gpu1-numa0-13"] == "" {
		t.Fatalf("chunkFiles = %v, want exactly the two chunks", files)
	}
	for id, f := range files {
		if n := nonZero(t, f); n != 0 {
			t.Fatalf("%s: fresh memfd has %d non-zero bytes", id, n)
		}
		dirty(t, id, f)
		m := maps[id]
		if m[0] != 0xA5 || m[size-1] != 0xA5 {
			t.Fatalf("%s: the write did not reach the mapping", id)
		}
		var st unix.Stat_t
		if err := unix.Fstat(fds[id], &st); err != nil || st.Size != size {
			t.Fatalf("%s: size after dirty = %d (%v), want %d", id, st.Size, err, size)
		}
		if n := nonZero(t, f); n != 2*4096 {
			t.Fatalf("%s: %d non-zero bytes after dirty, want %d", id, n, 2*4096)
		}
		clear(m)
		if n := nonZero(t, f); n != 0 {
			t.Fatalf("%s: %d non-zero bytes after zeroing the mapping", id, n)
		}
	}
}
