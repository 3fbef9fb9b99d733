package gpu

import (
	"strings"
	"testing"
)

// FuzzSysfsBusID: any NVML bus ID string decodes without panicking to a
// lower-case string with no NUL, and the decoder is idempotent.
func FuzzSysfsBusID(f *testing.F) {
	f.Add([]byte("00000000:3B:00.0"))
	f.Add([]byte("0000:3b:00.0"))
	f.Fuzz(func(t *testing.T, raw []byte) {
		in := make([]int8, len(raw))
		for i, b := range raw {
			in[i] = int8(b)
		}
		got := sysfsBusID(in)
		if strings.ContainsRune(got, 0) || got != strings.ToLower(got) {
			t.Fatalf("sysfsBusID(%q) = %q", raw, got)
		}
		again := make([]int8, len(got))
		for i := 0; i < len(got); i++ {
			again[i] = int8(got[i])
		}
		if g2 := sysfsBusID(again); g2 != got {
			t.Fatalf("not idempotent: %q -> %q -> %q", raw, got, g2)
		}
	})
}
