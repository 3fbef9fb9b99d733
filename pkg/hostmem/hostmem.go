// Package hostmem allocates the pool's chunks: shareable memory files that
// the agent maps and passes to clients by file descriptor.
package hostmem

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Chunk is one shareable memory region: a memory file and the agent's
// mapping of it.
type Chunk struct {
	File *os.File // memfd (or hugetlbfs file); pass File.Fd() by SCM_RIGHTS
	Mem  []byte   // the agent's shared mapping
	Size int64
}

// Options says how to allocate a chunk.
type Options struct {
	Size int64  // bytes; must be a positive multiple of the OS page size
	Name string // shown in /proc/<pid>/fd and maps
}

// Alloc creates a memfd of o.Size bytes and maps it shared.
func Alloc(o Options) (*Chunk, error) {
	if o.Size <= 0 || o.Size%int64(os.Getpagesize()) != 0 {
		return nil, fmt.Errorf("hostmem: chunk size %d is not a positive multiple of the page size %d", o.Size, os.Getpagesize())
	}
	name := o.Name
	if name == "" {
		name = "kvpool-chunk"
	}
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("hostmem: memfd_create %q: %w", name, err)
	}
	f := os.NewFile(uintptr(fd), name)
	if err := f.Truncate(o.Size); err != nil {
		f.Close()
		return nil, fmt.Errorf("hostmem: size memfd %q to %d bytes: %w", name, o.Size, err)
	}
	mem, err := Map(f, o.Size)
	if err != nil {
		f.Close()
		return nil, err
	}
	return &Chunk{File: f, Mem: mem, Size: o.Size}, nil
}

// Map maps size bytes of f shared, read-write. Clients use it on the fds they
// receive.
func Map(f *os.File, size int64) ([]byte, error) {
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("hostmem: mmap %s (%d bytes): %w", f.Name(), size, err)
	}
	return mem, nil
}

// Zero clears the chunk, so that a chunk leaving one allocation carries no
// bytes to the next.
func (c *Chunk) Zero() { clear(c.Mem) }

// Close unmaps the chunk and closes its file; the memory is freed once no
// other process maps it or holds its fd.
func (c *Chunk) Close() error {
	var err error
	if c.Mem != nil {
		err = unix.Munmap(c.Mem)
		c.Mem = nil
	}
	if cerr := c.File.Close(); err == nil {
		err = cerr
	}
	return err
}
