package cudart

// MaxRegisterBytes is the largest range one cuMemHostRegister call is given;
// HostRegister splits larger ranges. Some drivers (R580 and later) fail a
// single registration of 512 GiB or more.
const MaxRegisterBytes = 64 << 30

// MergeRuns returns copies with each copy that continues the previous one on
// both sides folded into it, so that scattered pages that happen to be
// adjacent move as one large transfer. It never reorders: the order is the
// caller's. The input is not modified.
func MergeRuns(copies []Copy) []Copy {
	out := make([]Copy, 0, len(copies))
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
