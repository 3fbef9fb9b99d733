package node

import "os"

// Kept is memory the pool already holds when the agent starts: a chunk an
// earlier agent made, which the keeper kept across the restart. Its pages
// are resident and locked, so MemAvailable no longer counts them (ordinary
// pages), or they are no longer free (huge pages), yet they are the pool's
// own: the plan must see them as available or a restart plans a smaller
// pool than the one it is about to adopt.
type Kept struct {
	NUMA     int   // the node its pages are bound to; -1 when unknown
	PageSize int64 // the OS page size for ordinary pages
	Bytes    int64
}

// WithKept returns a copy of in in which the kept memory counts as
// available: ordinary pages are added to MemAvailable (never past MemTotal); huge pages to the
// free pages of their size, on their NUMA node and system-wide. in is not
// changed. Huge pages of a size the node has no pool of (which cannot
// happen on the node that made them) are ignored.
func (in *Info) WithKept(kept []Kept) *Info {
	if len(kept) == 0 {
		return in
	}
	out := *in
	out.HugePages = clonePools(in.HugePages)
	out.NUMANodes = make([]NUMANode, len(in.NUMANodes))
	for i, n := range in.NUMANodes {
		n.HugePages = clonePools(n.HugePages)
		out.NUMANodes[i] = n
	}
	base := int64(os.Getpagesize())
	for _, k := range kept {
		if k.Bytes <= 0 {
			continue
		}
		if k.PageSize <= base {
			out.MemAvailable = min(out.MemAvailable+k.Bytes, out.MemTotal)
			continue
		}
		pages := k.Bytes / k.PageSize
		freePages(out.HugePages, k.PageSize, pages)
		for i := range out.NUMANodes {
			if out.NUMANodes[i].ID == k.NUMA {
				freePages(out.NUMANodes[i].HugePages, k.PageSize, pages)
			}
		}
	}
	return &out
}

func clonePools(p []HugePool) []HugePool {
	if p == nil {
		return nil
	}
	return append([]HugePool(nil), p...)
}

// freePages counts pages of size pageSize in pools as free again, never
// more than the pool holds.
func freePages(pools []HugePool, pageSize, pages int64) {
	for i := range pools {
		if pools[i].PageSize == pageSize {
			pools[i].Free = min(pools[i].Free+pages, pools[i].Total)
		}
	}
}

// KeptBytes is the total of kept.
func KeptBytes(kept []Kept) int64 {
	var b int64
	for _, k := range kept {
		b += k.Bytes
	}
	return b
}
