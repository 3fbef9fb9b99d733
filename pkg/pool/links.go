package pool

import (
	"fmt"
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
// 8 Mi pages rebuilt in 76-111 ms where one of 512 Ki pages took 32-35).
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

// The page links are the one part of the agent's memory that grows with
// the pages of the sessions rather than with their streams, and a session's
// page size is the tenant's choice: the socket server's smallest host page
// (256 bytes) makes them a 64th of the pool, 4 GiB for 256 GiB, and 4 KiB
// pages 1 GiB a TiB. A pool therefore bounds the pages of its open
// sessions together (their capacities), so that the agent's memory
// (docs/sizing.md, "Agent memory") holds their links whatever the tenants
// choose.

// LinkBytes is the most one page of a session's capacity costs the agent.
const LinkBytes = 4

// DefaultPageBytes and MinDefaultPages make the default bound on the
// sessions' pages (DefaultMaxPages): pages of 4 KiB or more over the whole
// pool, and at least 4 Mi pages (16 MiB of links) in a small pool.
const (
	DefaultPageBytes = 4 << 10
	MinDefaultPages  = 1 << 22
)

// DefaultMaxPages is the bound on the open sessions' pages of a pool of
// poolBytes, unless SetMaxPages sets another.
func DefaultMaxPages(poolBytes int64) int64 {
	return max(poolBytes/DefaultPageBytes, MinDefaultPages)
}

// PageBoundError is an open refused because the session's pages, with the
// open sessions', would pass the pool's bound (SetMaxPages). It changed
// nothing.
type PageBoundError struct {
	Allocation string
	GPU        int
	Pages      int64 // the pages the session would have held
	PageSize   int64
	Held       int64 // the open sessions' pages
	Bound      int64
}

func (e *PageBoundError) Error() string {
	room := max(e.Bound-e.Held, 0)
	return fmt.Sprintf("open on %s for GPU %d: %d pages of %d bytes would bring the open sessions' host pages to %d, over the agent's bound of %d "+
		"(each costs it %d bytes of memory); %d more fit: ask for at most that many pages, or larger ones",
		e.Allocation, e.GPU, e.Pages, e.PageSize, e.Held+e.Pages, e.Bound, LinkBytes, room)
}

// SetMaxPages bounds the host pages of every open session together (each
// session's capacity); n 0 restores the default, DefaultMaxPages of the
// bytes of the pool's chunks. An open past it fails with a
// *PageBoundError. Sessions a restore brings back are never refused, and
// a lower bound closes none: it refuses opens until they fit again.
func (p *Pool) SetMaxPages(n int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.maxPages = max(n, 0)
}

// Pages is the host pages of every open session together, and the bound
// on them (SetMaxPages).
func (p *Pool) Pages() (held, bound int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pagesLocked()
}

func (p *Pool) pagesLocked() (held, bound int64) {
	for _, a := range p.allocs {
		for s := range a.sessions {
			held += int64(s.capacity)
		}
	}
	if bound = p.maxPages; bound == 0 {
		var b int64
		for _, ch := range p.order {
			b += ch.Size
		}
		bound = DefaultMaxPages(b)
	}
	return held, bound
}
