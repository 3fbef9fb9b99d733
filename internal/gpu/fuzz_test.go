package gpu

import (
	"errors"
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

// FuzzResolve: any name resolves to one of the node's devices or fails
// with ErrUnknownDevice; a target's key resolves to the same target, and so
// does the key with a replica suffix.
func FuzzResolve(f *testing.F) {
	devs := []Device{
		{Index: 0, UUID: "GPU-0a0a0a0a-0000-0000-0000-000000000000", NUMA: 0},
		{Index: 3, UUID: "GPU-3b3b3b3b-0000-0000-0000-000000000000", NUMA: 1,
			MIG: []MIG{{UUID: "MIG-3c3c3c3c-0000-0000-0000-000000000001", GI: 1}, {UUID: "MIG-GPU-3b3b3b3b-0000-0000-0000-000000000000/2/0", GI: 2}}},
	}
	r := NewResolver(devs)
	for _, s := range []string{"GPU-0a0a0a0a-0000-0000-0000-000000000000", "MIG-3c3c3c3c-0000-0000-0000-000000000001::2",
		"GPU-3C3C3C3C-0000-0000-0000-000000000001", "3", "3:1", "::", "x::1", "MIG-GPU-3b3b3b3b-0000-0000-0000-000000000000/2/0"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		tg, err := r.Resolve(name)
		if err != nil {
			if !errors.Is(err, ErrUnknownDevice) {
				t.Fatalf("Resolve(%q): %v is not ErrUnknownDevice", name, err)
			}
			return
		}
		if tg.GPU.Index != 0 && tg.GPU.Index != 3 {
			t.Fatalf("Resolve(%q) = GPU %d", name, tg.GPU.Index)
		}
		for _, again := range []string{tg.Key(), tg.Key() + "::7"} {
			t2, err := r.Resolve(again)
			if err != nil || t2.Key() != tg.Key() || t2.GPU.Index != tg.GPU.Index {
				t.Fatalf("Resolve(%q) = %+v but Resolve(%q) = %+v, %v", name, tg, again, t2, err)
			}
		}
	})
}
