package pool

import (
	"bufio"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"reflect"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"
)

// mapped says whether the process has a mapping that starts at addr
// (/proc/self/maps).
func mapped(t *testing.T, addr uintptr) bool {
	t.Helper()
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		t.Skipf("no /proc/self/maps: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		start, _, _ := strings.Cut(sc.Text(), "-")
		if a, err := strconv.ParseUint(start, 16, 64); err == nil && uintptr(a) == addr {
			return true
		}
	}
	must(t, sc.Err())
	return false
}

// linkBytes is the memory the session's page links hold outside the Go
// heap: the mapped table's pages below fresh, which are all it has
// touched (0 where the table is in the heap).
func (s *Session) linkBytes() int64 {
	if s.links == nil {
		return 0
	}
	pg := int64(os.Getpagesize())
	return (int64(s.fresh)*LinkBytes + pg - 1) / pg * pg
}

// linksAddr is where a session's mapped link table starts.
func linksAddr(s *Session) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(s.links.mem))) }

// TestMappedLinks: a large session's page links take memory for the pages
// it handed out, not for its capacity; the session behaves as its model
// says through offloads, reloads, fences and removals, exports and
// restores the same, and its mapping goes with a close, or with the
// collection of a session that was never closed.
func TestMappedLinks(t *testing.T) {
	const pages = 1 << 16 // 256 KiB of links in a table of the capacity
	p := New()
	must(t, p.AddChunk(Chunk{ID: "big", Size: pages * 64}))
	must(t, p.Grant("a", []string{"big"}))
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	s, err := p.Open("a", Spec{PageSize: 64, DevicePages: 40})
	must(t, err)
	runtime.ReadMemStats(&after)
	if s.links == nil || s.Capacity() != pages {
		t.Fatalf("a session of %d pages has no mapped links", s.Capacity())
	}
	if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew >= pages || s.linkBytes() != 0 {
		t.Fatalf("opening a session of %d pages took %d bytes of heap and %d of links", pages, grew, s.linkBytes())
	}
	addr := linksAddr(s)
	if !mapped(t, addr) {
		t.Fatalf("no mapping at %#x", addr)
	}

	d := &driver{t: t, rng: rand.New(rand.NewPCG(7, 8)), s: s, m: newModel(s.Capacity()), name: "mapped", dev: 40}
	for range 3000 {
		d.step()
		d.verify()
	}
	must(t, s.Check())
	if s.fresh == 0 || s.linkBytes() >= pages {
		t.Fatalf("%d pages handed out, %d bytes of links", s.fresh, s.linkBytes())
	}
	img := p.Export()
	q := New()
	ss, err := q.Restore(img)
	must(t, err)
	must(t, ss[0].Check())
	if ss[0].links == nil || !reflect.DeepEqual(q.Export(), img) {
		t.Fatal("the restored session exports differently, or has no mapped links")
	}
	d.s = ss[0] // the restored session goes on as the model says
	for range 1000 {
		d.step()
		d.verify()
	}
	must(t, ss[0].Check())

	p.Close(s)
	if s.links != nil || s.next != nil {
		t.Fatal("the closed session still holds its links")
	}
	p.Close(s) // twice: a no-op
	gone(t, addr, "the closed session's links", func() {})

	// The restored pool is dropped without a close: the collector unmaps.
	addr = linksAddr(ss[0])
	d.s = nil // the last hold on it: ss and q are not used again
	gone(t, addr, "the links of a session no one holds", runtime.GC)
}

// gone waits up to a second for the mapping at addr to go, calling nudge
// between looks.
func gone(t *testing.T, addr uintptr, what string, nudge func()) {
	t.Helper()
	for i := 0; mapped(t, addr); i++ {
		if i == 100 {
			t.Fatalf("%s are still mapped at %#x", what, addr)
		}
		nudge()
		time.Sleep(10 * time.Millisecond)
	}
}

// TestLinksOfSmallSessions: a session under mapLinksFrom pages keeps its
// links in the heap, and one at it maps them.
func TestLinksOfSmallSessions(t *testing.T) {
	for _, c := range []struct {
		pages  int
		mapped bool
	}{{mapLinksFrom - 1, false}, {mapLinksFrom, true}} {
		p := New()
		must(t, p.AddChunk(Chunk{ID: "c", Size: int64(c.pages) * 64}))
		must(t, p.Grant("a", []string{"c"}))
		s, err := p.Open("a", Spec{PageSize: 64, DevicePages: 4})
		must(t, err)
		if got := s.links != nil; got != c.mapped || len(s.next) != c.pages {
			t.Fatalf("%d pages: mapped %v, %d links", c.pages, got, len(s.next))
		}
		pages, err := s.Offload("r", "k", []int32{0, 1, 2, 3}, Meta{}, nil)
		must(t, err)
		if fmt.Sprint(pages) != "[0 1 2 3]" {
			t.Fatalf("%d pages: handed out %v", c.pages, pages)
		}
		must(t, s.Check())
		p.Close(s)
	}
}

// TestPageBound: the open sessions' pages together stay within the pool's
// bound (SetMaxPages, by default DefaultMaxPages of the pool's bytes); an
// open past it is refused with a *PageBoundError and changes nothing, a
// close makes room, and a restore brings back every session whatever the
// bound. The chunks are bookkeeping only here (no memory behind them), and
// a session's links are mapped without reserve, so the large capacities
// cost nothing.
func TestPageBound(t *testing.T) {
	const gib = int64(1) << 30
	p := New()
	for i := range 2 {
		must(t, p.AddChunk(Chunk{ID: fmt.Sprint("c", i), Size: 16 * gib}))
	}
	must(t, p.Grant("a", []string{"c0", "c1"}))
	if held, bound := p.Pages(); held != 0 || bound != 32*gib/DefaultPageBytes {
		t.Fatalf("pages %d of %d, want 0 of %d (a 32 GiB pool at 4 KiB pages)", held, bound, 32*gib/DefaultPageBytes)
	}
	var open []*Session
	for _, c := range []struct {
		name     string
		maxPages int64 // SetMaxPages before the open; -1: leave as it is
		spec     Spec
		near     Near
		refused  *PageBoundError
		closeAll bool // close every open session after the step
	}{
		{name: "1 KiB pages over the whole pool", maxPages: -1, spec: Spec{PageSize: 1 << 10, DevicePages: 8}, near: Near{Ranks: 1},
			refused: &PageBoundError{Allocation: "a", Pages: 32 << 20, PageSize: 1 << 10, Held: 0, Bound: 8 << 20}},
		{name: "1 KiB pages, as many as the bound", maxPages: -1, spec: Spec{PageSize: 1 << 10, DevicePages: 8, MaxPages: 8 << 20}, near: Near{Ranks: 1}, closeAll: true},
		{name: "4 KiB pages over half the pool", maxPages: -1, spec: Spec{PageSize: 4 << 10, DevicePages: 8}, near: Near{Ranks: 2}},
		{name: "1 KiB pages over the other half", maxPages: -1, spec: Spec{GPU: 1, PageSize: 1 << 10, DevicePages: 8}, near: Near{Ranks: 2},
			refused: &PageBoundError{Allocation: "a", GPU: 1, Pages: 16 << 20, PageSize: 1 << 10, Held: 4 << 20, Bound: 8 << 20}},
		{name: "4 KiB pages over the other half", maxPages: -1, spec: Spec{GPU: 1, PageSize: 4 << 10, DevicePages: 8}, near: Near{Ranks: 2}, closeAll: true},
		{name: "a bound set lower", maxPages: 1 << 20, spec: Spec{PageSize: 4 << 10, DevicePages: 8}, near: Near{Ranks: 1},
			refused: &PageBoundError{Allocation: "a", Pages: 8 << 20, PageSize: 4 << 10, Held: 0, Bound: 1 << 20}},
		{name: "within the lower bound", maxPages: -1, spec: Spec{PageSize: 4 << 10, DevicePages: 8, MaxPages: 1 << 20}, near: Near{Ranks: 1}, closeAll: true},
		{name: "the default again", maxPages: 0, spec: Spec{PageSize: 4 << 10, DevicePages: 8}, near: Near{Ranks: 1}},
	} {
		if c.maxPages >= 0 {
			p.SetMaxPages(c.maxPages)
		}
		before := p.Export()
		s, err := p.OpenNear("a", c.spec, c.near)
		if c.refused != nil {
			var pb *PageBoundError
			if !errors.As(err, &pb) || *pb != *c.refused {
				t.Fatalf("%s: got %v, want %+v", c.name, err, *c.refused)
			}
			if !reflect.DeepEqual(p.Export(), before) {
				t.Fatalf("%s: the refused open changed the pool", c.name)
			}
			continue
		}
		must(t, err)
		open = append(open, s)
		if held, bound := p.Pages(); held > bound {
			t.Fatalf("%s: %d pages open over the bound of %d", c.name, held, bound)
		}
		if c.closeAll {
			for _, s := range open {
				p.Close(s)
			}
			open = nil
			if held, _ := p.Pages(); held != 0 {
				t.Fatalf("%s: %d pages held with every session closed", c.name, held)
			}
		}
	}

	// A restore brings back a session past a lower bound, which then
	// refuses the next open until a close makes room.
	img := p.Export()
	q := New()
	q.SetMaxPages(1 << 20)
	ss, err := q.Restore(img)
	must(t, err)
	if held, bound := q.Pages(); len(ss) != 1 || held != 8<<20 || bound != 1<<20 {
		t.Fatalf("restored %d sessions holding %d pages of a bound of %d, want one of %d pages over a bound of %d", len(ss), held, bound, 8<<20, 1<<20)
	}
	q.Close(ss[0])
	if _, err := q.OpenNear("a", Spec{PageSize: 4 << 10, DevicePages: 8, MaxPages: 1 << 20}, Near{Ranks: 1}); err != nil {
		t.Fatalf("an open within the bound after the close: %v", err)
	}

	// A small pool still takes small pages: the bound is at least
	// MinDefaultPages.
	for _, c := range []struct {
		pageSize int64
		ok       bool
	}{{16, true}, {8, false}} {
		r := New()
		must(t, r.AddChunk(Chunk{ID: "small", Size: 64 << 20}))
		must(t, r.Grant("b", []string{"small"}))
		_, err := r.Open("b", Spec{PageSize: c.pageSize, DevicePages: 8})
		if c.ok != (err == nil) || !c.ok && !strings.Contains(err.Error(), "4194304 more fit") {
			t.Fatalf("pages of %d bytes in a 64 MiB pool: %v", c.pageSize, err)
		}
	}
}
