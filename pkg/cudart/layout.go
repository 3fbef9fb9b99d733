package cudart

import (
	"fmt"
	"math"
	"slices"
)

// Region describes one array of pages in device memory, in whatever layout
// the engine chose: page i occupies [Base+i*Stride, Base+i*Stride+PageBytes).
// A layout where every layer has its own KV tensor is one Region per layer
// (and per K and V when they are separate); a layout that keeps all layers
// of a page together is one Region.
type Region struct {
	Base      DevicePtr
	Stride    uint64 // bytes between the starts of consecutive pages
	PageBytes uint64 // bytes of each page that move (at most Stride)
	Pages     int    // pages in the region
}

// Layout is the device side of a KV cache: the regions one page index
// selects a page in. One host page holds a device page of every region,
// back to back in region order, so it is HostPageBytes long and a page of
// each region reaches the link as one descriptor.
type Layout struct {
	Regions []Region
}

// HostPageBytes is the size of one host page: the sum of PageBytes.
func (l Layout) HostPageBytes() uint64 {
	var n uint64
	for _, r := range l.Regions {
		n += r.PageBytes
	}
	return n
}

// Validate reports the first thing wrong with the layout.
func (l Layout) Validate() error {
	if len(l.Regions) == 0 {
		return fmt.Errorf("cudart: layout has no regions")
	}
	var total uint64
	for i, r := range l.Regions {
		switch {
		case r.PageBytes == 0:
			return fmt.Errorf("cudart: region %d: zero bytes per page", i)
		case r.Stride < r.PageBytes:
			return fmt.Errorf("cudart: region %d: stride %d is less than the %d bytes per page", i, r.Stride, r.PageBytes)
		case r.Pages <= 0:
			return fmt.Errorf("cudart: region %d: %d pages", i, r.Pages)
		case r.Base == 0:
			return fmt.Errorf("cudart: region %d: zero base address", i)
		case uint64(r.Pages-1) > (math.MaxUint64-uint64(r.Base)-r.PageBytes)/r.Stride:
			return fmt.Errorf("cudart: region %d: %d pages of stride %d from %#x overflow the address space", i, r.Pages, r.Stride, uintptr(r.Base))
		}
		if total+r.PageBytes < total {
			return fmt.Errorf("cudart: region %d: host page size overflows", i)
		}
		total += r.PageBytes
	}
	return nil
}

// Copies returns the transfers that move device pages devPages to or from
// host pages whose first bytes are at hostPages (registered host memory,
// HostPageBytes each): device page devPages[i] pairs with hostPages[i].
// The copies are ordered region by region and, within a region, in the
// order given, so that runs adjacent on both sides merge (see MergeRuns).
// A device page may appear once; every index must be in range in every
// region.
func (l Layout) Copies(dir Direction, devPages []int, hostPages []uintptr) ([]Copy, error) {
	return l.AppendCopies(nil, dir, devPages, hostPages)
}

// AppendCopies is Copies appending to dst, for a caller that reuses its
// buffer (nil on error).
func (l Layout) AppendCopies(dst []Copy, dir Direction, devPages []int, hostPages []uintptr) ([]Copy, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	if dir != HostToDevice && dir != DeviceToHost {
		return nil, fmt.Errorf("cudart: bad direction %v", dir)
	}
	if len(devPages) != len(hostPages) {
		return nil, fmt.Errorf("cudart: %d device pages but %d host pages", len(devPages), len(hostPages))
	}
	if len(devPages) == 0 {
		return nil, fmt.Errorf("cudart: no pages")
	}
	limit := l.Regions[0].Pages
	for _, r := range l.Regions[1:] {
		limit = min(limit, r.Pages)
	}
	for i, p := range devPages {
		if p < 0 || p >= limit {
			return nil, fmt.Errorf("cudart: device page %d (position %d) is out of range [0, %d)", p, i, limit)
		}
		if hostPages[i] == 0 {
			return nil, fmt.Errorf("cudart: host page at position %d has address 0", i)
		}
	}
	if p, ok := duplicate(devPages); ok {
		return nil, fmt.Errorf("cudart: device page %d appears twice", p)
	}
	out := slices.Grow(dst, len(devPages)*len(l.Regions))
	var off uintptr
	for _, r := range l.Regions {
		for i, p := range devPages {
			d := uintptr(r.Base) + uintptr(p)*uintptr(r.Stride)
			h := hostPages[i] + off
			c := Copy{Dst: d, Src: h, Bytes: r.PageBytes}
			if dir == DeviceToHost {
				c.Dst, c.Src = h, d
			}
			out = append(out, c)
		}
		off += uintptr(r.PageBytes)
	}
	return out, nil
}

// duplicate returns a page that appears twice in pages. It is on every
// batch's path, so it allocates nothing for short lists (the usual batch)
// and one sorted copy for long ones, instead of a map; up to 256 pages the
// copy lives on the stack.
func duplicate(pages []int) (int, bool) {
	if len(pages) <= 48 {
		for i := 1; i < len(pages); i++ {
			for _, q := range pages[:i] {
				if q == pages[i] {
					return q, true
				}
			}
		}
		return 0, false
	}
	var small [256]int
	s := append(small[:0], pages...)
	slices.Sort(s)
	for i := 1; i < len(s); i++ {
		if s[i] == s[i-1] {
			return s[i], true
		}
	}
	return 0, false
}
