package pool

import (
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A session's page links (Session.next) take 4 bytes for every page of
// its capacity, most of them never written: the pages from fresh up are
// free without a link. Made in the Go heap, the table was zeroed where it
// was made, on every open and on every session a restore rebuilt, and so
// made resident in full: 16 MiB for a session of 4 Mi pages, taken out of
// the heap the restore had warmed for its tables, which then faulted
// their own pages in (a restart at the agent's stream bound in a pool of
// 16 Mi pages rebuilt in 76-111 ms where one of 1 Mi pages took 32-35).
// A large session's links therefore live in an anonymous mapping of their
// own, whose pages the kernel zeroes when first touched: the links take
// memory for the pages the session has handed out, not for its capacity,
// and the hot paths index one flat table as before.

// mapLinksFrom is the capacity from which a session's links are mapped;
// a smaller table is made in the heap (a mapping's least is a page, and
// zeroing a few KiB costs nothing).
const mapLinksFrom = 1 << 14

// links is a session's mapped link table, unmapped when the session is
// closed (releaseLinks) or, for one dropped open (a restore that failed),
// when the session is collected.
type links struct {
	mem     []byte
	cleanup runtime.Cleanup
}

// makeLinks gives s a link table for its capacity.
func (s *Session) makeLinks() {
	if s.capacity < mapLinksFrom {
		s.next = make([]int32, s.capacity)
		return
	}
	mem, err := unix.Mmap(-1, 0, s.capacity*4, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		// No room for the mapping: the heap's table works the same.
		s.next = make([]int32, s.capacity)
		return
	}
	s.next = unsafe.Slice((*int32)(unsafe.Pointer(unsafe.SliceData(mem))), s.capacity)
	s.links = &links{mem: mem}
	// The cleanup's argument is the mapping alone: one that held the
	// session would keep it reachable for ever.
	s.links.cleanup = runtime.AddCleanup(s, func(mem []byte) { _ = unix.Munmap(mem) }, mem)
}

// releaseLinks drops a closed session's link table; s.mu is held, and
// every use of next is under it and after a check that the session is
// open. A mapped table is unmapped beside the caller, off the session's
// and the pool's locks (64 MiB of written links took 3.4 ms to unmap).
func (s *Session) releaseLinks() {
	s.next = nil
	if l := s.links; l != nil {
		s.links = nil
		l.cleanup.Stop() // s is reachable here: the cleanup has not been queued
		go func() { _ = unix.Munmap(l.mem) }()
	}
}
