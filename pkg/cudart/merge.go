package cudart

// MaxRegisterBytes is the largest range one cuMemHostRegister call is given;
// HostRegister splits larger ranges. Some drivers (R580 and later) fail a
// single registration of 512 GiB or more.
const MaxRegisterBytes = 64 << 30

// MergeRuns returns copies with each copy that continues the previous one on
// both sides folded into it, so that scattered pages that happen to be
// adjacent move as one large transfer. It never reorders: the order is the
// caller's. The input is not modified; when no two copies merge (a batch
// the client merged already) it is what MergeRuns returns, so that the
// driver binding allocates nothing for it.
func MergeRuns(copies []Copy) []Copy {
	for i := 1; i < len(copies); i++ {
		if p, c := copies[i-1], copies[i]; p.Dst+uintptr(p.Bytes) == c.Dst && p.Src+uintptr(p.Bytes) == c.Src {
			return appendMerged(make([]Copy, 0, len(copies)), copies)
		}
	}
	return copies
}

// MergeRunsInPlace is MergeRuns writing into copies itself: it returns the
// merged copies as a prefix of copies, whose later elements it may change.
// For a hot path that reuses its buffer.
func MergeRunsInPlace(copies []Copy) []Copy {
	return appendMerged(copies[:0], copies)
}

// appendMerged appends the merged copies to out; out may be copies[:0], as
// it never grows past the copy being read.
func appendMerged(out, copies []Copy) []Copy {
	for _, c := range copies {
		if n := len(out); n > 0 {
			p := &out[n-1]
			if p.Dst+uintptr(p.Bytes) == c.Dst && p.Src+uintptr(p.Bytes) == c.Src {
				p.Bytes += c.Bytes
				continue
			}
		}
		out = append(out, c)
	}
	return out
}
