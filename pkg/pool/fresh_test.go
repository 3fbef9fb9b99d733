package pool

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

// TestFreshPages: a session hands out its freed pages first, then the
// pages it never handed out, in ascending order; a restored session keeps
// the pages above the last one its image holds untouched and hands them
// out the same way; and it can be filled to its capacity either way.
func TestFreshPages(t *testing.T) {
	p := testPool(t)
	must(t, p.Grant("A", []string{"gpu0-c0"}))
	const capacity = 64
	s, err := p.Open("A", Spec{GPU: 0, PageSize: 1 << 10, DevicePages: 16, MaxPages: capacity})
	must(t, err)
	offload := func(s *Session, rid string, n int) []int32 {
		t.Helper()
		dev := make([]int32, n)
		for i := range dev {
			dev[i] = int32(i)
		}
		pages, err := s.Offload(rid, "k", dev, Meta{}, nil)
		must(t, err)
		must(t, s.Check())
		return pages
	}
	if got := offload(s, "a", 3); !slices.Equal(got, []int32{0, 1, 2}) {
		t.Fatalf("a fresh session handed out %v, want [0 1 2]", got)
	}
	if got := offload(s, "b", 2); !slices.Equal(got, []int32{3, 4}) {
		t.Fatalf("then %v, want [3 4]", got)
	}
	if _, err := s.RemoveRequest("a"); err != nil {
		t.Fatal(err)
	}
	// The three freed pages first, then the untouched ones from 5.
	if got := offload(s, "c", 5); !slices.Equal(got, []int32{0, 1, 2, 5, 6}) {
		t.Fatalf("after a removal: %v, want [0 1 2 5 6]", got)
	}
	if s.fresh != 7 {
		t.Fatalf("untouched from %d, want 7", s.fresh)
	}
	if _, err := s.RemoveRequest("b"); err != nil {
		t.Fatal(err)
	}

	_, _, r := restoreFirst(t, p)
	if r.fresh != 7 || r.NumFreePages() != capacity-5 {
		t.Fatalf("restored: untouched from %d with %d free, want 7 with %d", r.fresh, r.NumFreePages(), capacity-5)
	}
	// Below the last page held, the holes (3 and 4), ascending; then 7 up.
	if got := offload(r, "d", 4); !slices.Equal(got, []int32{3, 4, 7, 8}) {
		t.Fatalf("restored session handed out %v, want [3 4 7 8]", got)
	}
	for _, x := range []*Session{s, r} {
		var all []int32
		for i := 0; x.NumFreePages() > 0; i++ {
			all = append(all, offload(x, fmt.Sprintf("fill-%d", i), min(16, x.NumFreePages()))...)
		}
		if _, err := x.Offload("over", "k", []int32{0}, Meta{}, nil); err == nil {
			t.Fatal("an offload into a full session was taken")
		}
		slices.Sort(all)
		if len(slices.Compact(all)) != len(all) {
			t.Fatalf("a page handed out twice: %v", all)
		}
		if int(x.fresh) != capacity {
			t.Fatalf("full, untouched from %d, want %d", x.fresh, capacity)
		}
	}
}

// TestCheckFindsBrokenFreePages: Check refuses a session whose free pages
// do not add up, each way they can fail.
func TestCheckFindsBrokenFreePages(t *testing.T) {
	cases := []struct {
		name  string
		spoil func(s *Session)
		want  string
	}{
		{"untouched past the capacity", func(s *Session) { s.fresh = int32(s.capacity + 1) }, "outside"},
		{"untouched below zero", func(s *Session) { s.fresh = -1 }, "outside"},
		{"a held page counted untouched", func(s *Session) { s.fresh--; s.nfree++ }, "on two lists"},
		{"fewer free pages than untouched ones", func(s *Session) { s.nfree = 0 }, "fewer than"},
		{"a listed free page lost", func(s *Session) { s.nfree-- }, "recorded"},
		{"an untouched page lost", func(s *Session) { s.fresh++ }, "recorded"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := misuseSession(t)
			_, err := s.RemoveRequest("r1") // pages 0-4 onto the free list
			must(t, err)
			must(t, s.Check())
			c.spoil(s)
			if err := s.Check(); err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Check: %v, want an error saying %q", err, c.want)
			}
		})
	}
}
