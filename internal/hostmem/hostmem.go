// Package hostmem allocates the pool's chunks: shareable memory files that
// the agent maps and passes to clients by file descriptor. A chunk can be
// backed by huge pages, bound to a NUMA node before its first touch,
// pre-faulted by several goroutines and locked in memory.
package hostmem

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/internal/bytesize"
)

// Chunk is one shareable memory region: a memory file and the agent's
// mapping of it.
type Chunk struct {
	File *os.File // memfd (or hugetlb memfd); pass File.Fd() by SCM_RIGHTS
	Mem  []byte   // the agent's shared mapping; nil while Kept
	Size int64

	PageSize int64 // the page size actually used
	Node     int   // the NUMA node the memory is bound to; -1 when unbound
	Locked   bool  // mlock succeeded (in the agent's mapping, or the keeper's: Kept)
	// Kept: the keeper's mapping holds every page locked and the agent
	// maps nothing (HandOff, AdoptKept), so that the agent's death unmaps
	// nothing.
	Kept bool
	// Sealed: the memfd carries F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL, so
	// no holder of the fd can change its size (always true for a chunk
	// Alloc returns).
	Sealed bool
	// Warnings lists the fallbacks taken (4 KiB pages instead of huge
	// pages, no NUMA binding, not locked), one sentence each.
	Warnings []string
}

// Options says how to allocate a chunk. The zero value of every field but
// Size gives a plain, lazily faulted, unbound, unlocked memfd.
type Options struct {
	Size int64  // bytes; a positive multiple of the page size used
	Name string // shown in /proc/<pid>/fd and maps

	// PageSize is 0 (or the OS page size) for ordinary pages, or 2 MiB or
	// 1 GiB for a hugetlb memfd from the kernel's reserved pool.
	PageSize int64
	// HugeFallback: when huge pages cannot be had (none reserved, too few
	// free), use ordinary pages and add a warning instead of failing.
	HugeFallback bool

	// Bind binds the memory to NUMA node Node (mbind MPOL_BIND) before the
	// first touch. Where the kernel has no NUMA support or the process may
	// not set memory policy, the chunk stays unbound with a warning; a node
	// that does not exist is an error.
	Bind bool
	Node int

	// Prefault touches every page before Alloc returns, with Workers
	// goroutines (at least 1) each populating a part of the chunk. Where
	// CPUs is set (the CPUs of the chunk's NUMA node), each worker runs on
	// an OS thread of its own bound to those CPUs, so the kernel zeroes the
	// pages from the node they belong to.
	Prefault bool
	Workers  int
	CPUs     []int

	// Lock locks the chunk in memory (mlock). A failure is an error
	// explaining the memlock limit, unless LockFallback is set, in which
	// case the chunk stays unlocked with a warning (safe: a client pins
	// what it registers with CUDA).
	Lock         bool
	LockFallback bool
}

// Errors that callers may test with errors.Is.
var (
	// ErrHugePages: the requested huge pages could not be had.
	ErrHugePages = errors.New("huge pages unavailable")
	// ErrMemlock: the chunk could not be locked in memory.
	ErrMemlock = errors.New("cannot lock memory")
)

const (
	hugePage2M = 2 << 20
	hugePage1G = 1 << 30
)

// Alloc creates a memfd of o.Size bytes and maps it shared, then binds,
// pre-faults and locks it as o asks. On error nothing is left allocated.
func Alloc(o Options) (*Chunk, error) {
	base := int64(os.Getpagesize())
	ps := o.PageSize
	if ps == 0 {
		ps = base
	}
	name := o.Name
	if name == "" {
		name = "kvpool-chunk"
	}
	switch {
	case ps != base && ps != hugePage2M && ps != hugePage1G:
		return nil, fmt.Errorf("hostmem: page size %d is not %d, 2 MiB or 1 GiB", ps, base)
	case o.Size <= 0 || o.Size%ps != 0:
		return nil, fmt.Errorf("hostmem: chunk size %d is not a positive multiple of the page size %d", o.Size, ps)
	case o.Workers < 0:
		return nil, fmt.Errorf("hostmem: %d workers", o.Workers)
	case o.Bind && (o.Node < 0 || o.Node >= 1024):
		return nil, fmt.Errorf("hostmem: NUMA node %d out of range", o.Node)
	}
	for _, cpu := range o.CPUs {
		if cpu < 0 || cpu >= maxCPU {
			return nil, fmt.Errorf("hostmem: CPU %d out of range", cpu)
		}
	}
	c := &Chunk{Size: o.Size, PageSize: ps, Node: -1}
	err := c.create(name, ps)
	if err != nil && errors.Is(err, ErrHugePages) && o.HugeFallback {
		c.Warnings = append(c.Warnings, fmt.Sprintf("%v; using %d KiB pages", err, base>>10))
		c.PageSize = base
		err = c.create(name, base)
	}
	if err != nil {
		return nil, err
	}
	if err := c.setup(o); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// Seals is what Alloc seals every chunk's memfd with before it returns:
// the size can neither shrink (a tenant's ftruncate would make the agent's
// own mapping fault with SIGBUS) nor grow (ftruncate or fallocate beyond the
// end would charge memory to the agent that outlives the tenant), and the
// seals themselves are final. Writes stay allowed: that is what a chunk is for.
const Seals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// create makes the memfd, sizes it, seals it and maps it.
func (c *Chunk) create(name string, ps int64) error {
	flags := unix.MFD_CLOEXEC | unix.MFD_ALLOW_SEALING
	switch ps {
	case hugePage2M:
		flags |= unix.MFD_HUGETLB | unix.MFD_HUGE_2MB
	case hugePage1G:
		flags |= unix.MFD_HUGETLB | unix.MFD_HUGE_1GB
	}
	huge := flags&unix.MFD_HUGETLB != 0
	fd, err := unix.MemfdCreate(name, flags)
	if err != nil {
		if huge {
			return fmt.Errorf("hostmem: memfd_create %q with %s huge pages: %w (%w)", name, bytesize.Exact(int64(ps)), err, ErrHugePages)
		}
		return fmt.Errorf("hostmem: memfd_create %q: %w", name, err)
	}
	f := os.NewFile(uintptr(fd), name)
	if err := f.Truncate(c.Size); err != nil {
		f.Close()
		return fmt.Errorf("hostmem: size memfd %q to %d bytes: %w", name, c.Size, err)
	}
	if err := seal(f); err != nil {
		f.Close()
		return fmt.Errorf("hostmem: seal memfd %q: %w", name, err)
	}
	c.Sealed = true
	mem, err := Map(f, c.Size)
	if err != nil {
		f.Close()
		if huge && errors.Is(err, unix.ENOMEM) {
			return fmt.Errorf("hostmem: %s chunk needs %d free %s huge pages (see /proc/sys/vm/nr_hugepages): %w", bytesize.Exact(c.Size), c.Size/ps, bytesize.Exact(int64(ps)), ErrHugePages)
		}
		return err
	}
	c.File, c.Mem = f, mem
	return nil
}

// setup binds, pre-faults and locks the chunk. Locking comes first where
// the chunk is also pre-faulted: mlock2(MLOCK_ONFAULT) marks the mapping
// locked without touching it, so that each page is locked as the
// pre-fault maps it, in one pass (a plain mlock after the pre-fault walks
// every page a second time: about a sixth of what pinning took).
func (c *Chunk) setup(o Options) error {
	if o.Bind {
		if err := c.bind(o.Node); err != nil {
			return err
		}
	}
	if c.PageSize == int64(os.Getpagesize()) {
		// Transparent huge pages for the chunk where the node's
		// administrator allows them for shared memory ("advise" in
		// /sys/kernel/mm/transparent_hugepage/shmem_enabled): 2 MiB pages
		// pin many times faster. Elsewhere (the default "never") nothing
		// changes, and the error is of no consequence.
		_ = unix.Madvise(c.Mem, unix.MADV_HUGEPAGE)
	}
	onFault := o.Lock && o.Prefault
	if onFault {
		if err := c.lock(o, true); err != nil {
			return err
		}
	}
	if o.Prefault {
		// Ordinary pages are allocated in the file first (fallocate: the
		// kernel fills the file without a fault per page), then mapped:
		// about a tenth faster than faulting them in. Huge pages fault
		// in 2 MiB or 1 GiB at a time and gain nothing, and where
		// shared-memory THP may apply the faults are what get them (a
		// fallocate, which has no mapping to see MADV_HUGEPAGE, would
		// fill the file with ordinary pages first).
		var file *os.File
		if c.PageSize == int64(os.Getpagesize()) && !shmemTHP() {
			file = c.File
		}
		if err := populate(c.Mem, file, c.PageSize, max(o.Workers, 1), o.CPUs); err != nil {
			return err
		}
	}
	if o.Lock && !onFault {
		return c.lock(o, false)
	}
	return nil
}

func (c *Chunk) bind(node int) error {
	switch err := mbind(c.Mem, node); {
	case err == nil:
		c.Node = node
	case errors.Is(err, unix.ENOSYS):
		c.Warnings = append(c.Warnings, fmt.Sprintf("not bound to NUMA node %d: the kernel has no NUMA support", node))
	case errors.Is(err, unix.EPERM):
		c.Warnings = append(c.Warnings, fmt.Sprintf("not bound to NUMA node %d: mbind not permitted (the container needs CAP_SYS_NICE or a seccomp profile allowing mbind)", node))
	case errors.Is(err, unix.EINVAL):
		return fmt.Errorf("hostmem: bind to NUMA node %d: %w (is the node online? see /sys/devices/system/node)", node, err)
	default:
		return fmt.Errorf("hostmem: bind to NUMA node %d: %w", node, err)
	}
	return nil
}

// lock locks the chunk: onFault, pages as they are faulted in (mlock2
// MLOCK_ONFAULT; a kernel before 4.4 without it locks with a plain mlock
// instead, which faults the pages in itself), else every page now.
func (c *Chunk) lock(o Options, onFault bool) error {
	var err error
	if onFault {
		err = mlock2(c.Mem, unix.MLOCK_ONFAULT)
	}
	if !onFault || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EINVAL) {
		err = unix.Mlock(c.Mem)
	}
	if err != nil {
		err = fmt.Errorf("hostmem: mlock %s: %w (%w): the agent needs CAP_IPC_LOCK or a memlock limit (ulimit -l, RLIMIT_MEMLOCK) above the pool size", bytesize.Exact(c.Size), err, ErrMemlock)
		if !o.LockFallback {
			return err
		}
		c.Warnings = append(c.Warnings, err.Error()+"; left unlocked")
		return nil
	}
	c.Locked = true
	return nil
}

// LockOnFault locks mem's pages as they are faulted in (mlock2
// MLOCK_ONFAULT), which takes no time whatever the size: the keeper's lock
// of a chunk it holds (FaultIn then faults the pages in).
func LockOnFault(mem []byte) error { return mlock2(mem, unix.MLOCK_ONFAULT) }

func mlock2(mem []byte, flags int) error {
	_, _, e := unix.Syscall(unix.SYS_MLOCK2, uintptr(unsafe.Pointer(&mem[0])), uintptr(len(mem)), uintptr(flags))
	if e != 0 {
		return e
	}
	return nil
}

// mbind sets MPOL_BIND to node on mem's range.
func mbind(mem []byte, node int) error {
	mask := make([]uint64, node/64+1)
	mask[node/64] = 1 << (node % 64)
	_, _, e := unix.Syscall6(unix.SYS_MBIND, uintptr(unsafe.Pointer(&mem[0])), uintptr(len(mem)),
		uintptr(unix.MPOL_BIND), uintptr(unsafe.Pointer(&mask[0])), uintptr(len(mask)*64+1), 0)
	if e != 0 {
		return e
	}
	return nil
}

// maxCPU bounds the CPU numbers Options.CPUs may name (unix.CPUSet's size).
const maxCPU = len(unix.CPUSet{}) * 64

// populate faults mem in with workers goroutines, each taking a contiguous
// share (whole pages), each on an OS thread bound to cpus when cpus is set.
// Where file is set (mem maps it from offset 0), each worker allocates
// its share in the file (fallocate; the kernel runs one at a time per
// file) and maps it, a step at a time. It maps with
// MADV_POPULATE_WRITE, or writes a byte per page on kernels without it
// (before 5.14).
func populate(mem []byte, file *os.File, pageSize int64, workers int, cpus []int) error {
	pages := int64(len(mem)) / pageSize
	workers = int(min(int64(workers), pages))
	per := (pages + int64(workers) - 1) / int64(workers)
	var set unix.CPUSet
	for _, cpu := range cpus {
		set.Set(cpu)
	}
	var wg sync.WaitGroup
	errs := make([]error, workers)
	for w := 0; w < workers; w++ {
		lo, hi := int64(w)*per*pageSize, min(int64(w+1)*per, pages)*pageSize
		if lo >= hi {
			continue
		}
		wg.Add(1)
		go func(w int, lo int64, part []byte) {
			defer wg.Done()
			if len(cpus) > 0 {
				// The thread keeps its binding and ends with this
				// goroutine (locked, never unlocked): no other
				// goroutine runs on it afterwards.
				runtime.LockOSThread()
				_ = unix.SchedSetaffinity(0, &set) // unbound where refused: only slower
			}
			// A step at a time, so that the workers' fallocates (one at
			// a time per file) interleave with their mapping.
			for off := int64(0); off < int64(len(part)) && errs[w] == nil; off += fallocateStep {
				step := part[off:min(off+fallocateStep, int64(len(part)))]
				if err := allocatePart(file, lo+off, int64(len(step))); err != nil {
					errs[w] = fmt.Errorf("hostmem: allocate %s of the file: %w", bytesize.Exact(int64(len(step))), explainFault(err))
				} else if err := populatePart(step, pageSize); err != nil {
					errs[w] = fmt.Errorf("hostmem: pre-fault %s: %w", bytesize.Exact(int64(len(step))), explainFault(err))
				}
			}
		}(w, lo, mem[lo:hi])
	}
	wg.Wait()
	return errors.Join(errs...)
}

// fallocateStep is how much of a file one fallocate call allocates: the
// kernel gives up a call that a signal interrupts (EINTR, undoing it), so
// a call must be short enough to finish between signals.
const fallocateStep = 64 << 20

// allocatePart allocates n bytes of f from off (nothing where f is nil),
// a step at a time, retrying a step that a signal interrupted; a file
// system without fallocate leaves it to the faults.
func allocatePart(f *os.File, off, n int64) error {
	if f == nil {
		return nil
	}
	for end := off + n; off < end; {
		step := min(fallocateStep, end-off)
		err := unix.Fallocate(int(f.Fd()), 0, off, step)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS):
			return nil
		case err != nil:
			return err
		}
		off += step
	}
	return nil
}

func populatePart(part []byte, pageSize int64) error {
	err := unix.Madvise(part, unix.MADV_POPULATE_WRITE)
	if errors.Is(err, unix.EINVAL) {
		for i := 0; i < len(part); i += int(pageSize) {
			part[i] = 0
		}
		err = nil
	}
	return err
}

func explainFault(err error) error {
	switch {
	case errors.Is(err, unix.ENOMEM):
		return fmt.Errorf("%w (out of memory: the agent's cgroup limit or the node's memory is too small for the pool)", err)
	case errors.Is(err, unix.EFAULT):
		return fmt.Errorf("%w (no huge page or page could be faulted in)", err)
	}
	return err
}

// Map maps size bytes of f shared, read-write. Clients use it on the fds they
// receive.
func Map(f *os.File, size int64) ([]byte, error) {
	// Not unix.Mmap: a mapping it makes can only be unmapped whole, and
	// Unmap lets a chunk's mapping go a step at a time.
	p, err := unix.MmapPtr(int(f.Fd()), 0, nil, uintptr(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("hostmem: mmap %s (%d bytes): %w", f.Name(), size, err)
	}
	return unsafe.Slice((*byte)(p), size), nil
}

// seal adds Seals to f. Kernels since 3.17 seal memfds and since 4.16
// hugetlb memfds as well; there is no fallback: a chunk that a tenant could
// resize is refused.
func seal(f *os.File) error {
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, Seals); err != nil {
		if errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("%w (the kernel cannot seal this kind of memfd; hugetlb memfds need Linux 4.16 or later)", err)
		}
		return err
	}
	got, err := unix.FcntlInt(f.Fd(), unix.F_GET_SEALS, 0)
	if err != nil {
		return err
	}
	if got&Seals != Seals {
		return fmt.Errorf("seals %#x after adding %#x", got, Seals)
	}
	return nil
}

// Drop retires a chunk that tenants had: the agent's mapping goes first
// (the agent never touches tenant memory again, so nothing a tenant did to it
// can fault the agent), then every page of the file is released at once
// (FALLOC_FL_PUNCH_HOLE, allowed under the size seals), so the memory is
// back before a fresh chunk takes its place, whoever still maps the file or
// holds its fd. Pages a device driver still pins are freed when it lets go.
// A process that kept a mapping sees zeros, or what it writes itself, in
// memory no other tenant is ever given. The file is closed after closeAfter,
// so that a descriptor number a concurrent reply may still be sending is
// not reused for another file in the meantime.
func (c *Chunk) Drop(closeAfter time.Duration) error {
	var err error
	if c.Mem != nil {
		err = munmap(c.Mem)
		c.Mem = nil
	}
	f := c.File
	c.File = nil
	if f == nil {
		return err
	}
	if perr := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, c.Size); perr != nil && err == nil {
		err = fmt.Errorf("hostmem: release the pages of %s: %w", f.Name(), perr)
	}
	if closeAfter <= 0 {
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	} else {
		time.AfterFunc(closeAfter, func() { f.Close() })
	}
	return err
}

// HandOff gives up the agent's mapping once the keeper holds every page
// locked: the chunk is Kept from then on, and the caller unmaps what it
// returns (Unmap) outside its locks.
func (c *Chunk) HandOff() []byte {
	mem := c.Mem
	c.Mem, c.Kept = nil, true
	return mem
}

// MapAgain maps a Kept chunk again and locks it on fault, for the agent
// to fault in (FaultIn) where no keeper holds its lock any longer.
func (c *Chunk) MapAgain(lockFallback bool) error {
	if c.Mem != nil || c.File == nil {
		return fmt.Errorf("hostmem: map chunk again: mapped already or dropped")
	}
	mem, err := Map(c.File, c.Size)
	if err != nil {
		return err
	}
	c.Mem, c.Kept, c.Locked = mem, false, false
	return c.lock(Options{LockFallback: lockFallback}, true)
}

// unmapStep is how much of a mapping Unmap unmaps at once: the process's
// memory map stays locked while the kernel unmaps (about 0.07 s a GiB of
// locked 4 KiB pages), and page faults of the process's other threads
// wait for it.
const unmapStep = 64 << 20

// Unmap unmaps mem (a mapping Map made) a step at a time.
func Unmap(mem []byte) error {
	if len(mem) == 0 {
		return nil
	}
	for off := 0; off < len(mem); off += unmapStep {
		if err := munmap(mem[off:min(len(mem), off+unmapStep)]); err != nil {
			return fmt.Errorf("hostmem: unmap: %w", err)
		}
	}
	return nil
}

// munmap unmaps mem, a mapping Map made or a part of one.
func munmap(mem []byte) error {
	return unix.MunmapPtr(unsafe.Pointer(unsafe.SliceData(mem)), uintptr(len(mem)))
}

// Close unmaps the chunk and closes its file; the memory is freed once no
// other process maps it or holds its fd.
func (c *Chunk) Close() error {
	var err error
	if c.Mem != nil {
		err = munmap(c.Mem)
		c.Mem = nil
	}
	if c.File != nil {
		if cerr := c.File.Close(); err == nil {
			err = cerr
		}
		c.File = nil
	}
	return err
}
