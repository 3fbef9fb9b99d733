package hostmem

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Adopt maps a chunk that an earlier agent made and the keeper kept: f
// already holds its size bytes of pages, resident. With lock it locks them
// as they are faulted into this mapping (mlock2 MLOCK_ONFAULT), which
// takes no time whatever the size; a plain mlock would fault every page in
// first, about 0.3-0.6 s a GiB (docs/benchmarks.md), all of it before the
// restarted agent serves. FaultIn then faults the pages in (and so locks
// them) while the agent serves. A lock refused is an error unless
// lockFallback, where the chunk stays unlocked with a warning, as at Alloc.
// node is the NUMA node the pages were bound to (-1: unbound).
func Adopt(f *os.File, info FileInfo, node int, lock, lockFallback bool) (*Chunk, error) {
	mem, err := Map(f, info.Size)
	if err != nil {
		return nil, err
	}
	c := kept(f, info, node)
	c.Mem = mem
	if lock {
		if err := c.lock(Options{LockFallback: lockFallback}, true); err != nil {
			_ = munmap(mem)
			return nil, err
		}
	}
	return c, nil
}

// AdoptKept takes over a chunk whose pages the keeper holds locked in its
// own mapping (keeper.Item.Locked): the agent maps nothing, which takes no
// time at all and leaves nothing for its death to unmap.
func AdoptKept(f *os.File, info FileInfo, node int) *Chunk {
	c := kept(f, info, node)
	c.Locked, c.Kept = true, true
	return c
}

// kept is a kept chunk's description from what its file says.
func kept(f *os.File, info FileInfo, node int) *Chunk {
	return &Chunk{File: f, Size: info.Size, PageSize: info.PageSize, Node: node, Sealed: info.Seals&Seals == Seals}
}

// FileInfo is what a kept chunk's memfd says of itself.
type FileInfo struct {
	Size     int64 // bytes
	PageSize int64 // a hugetlb memfd's huge page size, else the OS page size
	Seals    int   // F_GET_SEALS
}

// Inspect reads a chunk memfd's size, page size and seals: one fstat and
// one fcntl, each a few microseconds. A restart takes them from the keeper
// for sealed chunks (keeper.Item.PageSize) rather than pay them for each of
// thousands.
func Inspect(f *os.File) (FileInfo, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return FileInfo{}, fmt.Errorf("fstat: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return FileInfo{}, errors.New("the fd is not a regular (memory) file")
	}
	info := FileInfo{Size: st.Size, PageSize: int64(os.Getpagesize())}
	if st.Blksize > 0 {
		info.PageSize = int64(st.Blksize)
	}
	seals, err := unix.FcntlInt(f.Fd(), unix.F_GET_SEALS, 0)
	if err != nil {
		return info, fmt.Errorf("F_GET_SEALS: %w", err)
	}
	info.Seals = seals
	return info, nil
}

// FaultInStep is the most FaultIn should be given at once, so that a
// caller can stop between steps (a chunk dropped meanwhile).
const FaultInStep = fallocateStep

// FaultIn faults part of an adopted chunk's mapping in, reading nothing and
// writing nothing (MADV_POPULATE_READ: the file's pages are mapped as they
// are), so that a lock on fault (Adopt) locks every page. A kernel without
// MADV_POPULATE_READ (before 5.14) locks part with a plain mlock instead,
// which faults it in too. Neither touches the memory from user space, so a
// range unmapped meanwhile is an error, never a fault of the agent.
func FaultIn(part []byte) error {
	if len(part) == 0 {
		return nil
	}
	err := unix.Madvise(part, unix.MADV_POPULATE_READ)
	if errors.Is(err, unix.EINVAL) {
		err = unix.Mlock(part)
	}
	if err != nil {
		return fmt.Errorf("hostmem: fault in %d bytes of an adopted chunk: %w", len(part), explainFault(err))
	}
	return nil
}
