package main

import (
	"encoding/binary"
	"testing"
)

// FuzzSpansOf: whatever the regions, the spans registered with the
// simulator are sorted, do not overlap, and each region's bytes lie inside
// exactly one of them; invalid regions are refused.
func FuzzSpansOf(f *testing.F) {
	f.Add([]byte{0x10, 0, 0, 0, 64, 32, 4, 0x10, 0x20, 0, 0, 64, 32, 4})
	f.Add([]byte{1, 0, 0, 0, 16, 16, 1})
	f.Fuzz(func(t *testing.T, data []byte) {
		var rs []regionArg
		for len(data) >= 7 && len(rs) < 16 {
			base := uint64(binary.LittleEndian.Uint32(data[0:4])) << 4
			rs = append(rs, regionArg{base: base, stride: uint64(data[4]), page: uint64(data[5]), pages: uint64(data[6] % 32)})
			data = data[7:]
		}
		if len(rs) == 0 {
			return
		}
		spans, err := spansOf(0, toRegions(rs))
		valid := true
		for _, r := range rs {
			if r.base == 0 || r.pages == 0 || r.page == 0 || r.stride < r.page {
				valid = false
			}
		}
		if !valid {
			if err == nil {
				t.Fatalf("invalid regions %+v accepted", rs)
			}
			return
		}
		if err != nil {
			t.Fatalf("valid regions %+v: %v", rs, err)
		}
		for i := 1; i < len(spans); i++ {
			if spans[i-1].base+spans[i-1].size > spans[i].base {
				t.Fatalf("spans %d and %d overlap: %+v", i-1, i, spans)
			}
		}
		for _, r := range rs {
			end := r.base + (r.pages-1)*r.stride + r.page
			n := 0
			for _, s := range spans {
				if r.base >= s.base && end <= s.base+s.size {
					n++
				}
			}
			if n != 1 {
				t.Fatalf("region %+v lies in %d spans of %+v", r, n, spans)
			}
		}
	})
}
