package plugin

import (
	"slices"
	"strings"
	"testing"
)

func FuzzDecodeCheckpoint(f *testing.F) {
	good, _ := EncodeCheckpoint(sampleRecords())
	f.Add(good)
	// A claim's record (the DRA door), as version 3 writes it.
	withClaim, _ := EncodeCheckpoint(v3Records())
	f.Add(withClaim)
	f.Add([]byte(`{"version":1,"checksum":"","records":[]}`))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		recs, err := DecodeCheckpoint(data)
		if err != nil {
			if recs != nil {
				t.Fatal("records returned with an error")
			}
			return
		}
		// Whatever decodes re-encodes to something that decodes the same.
		again, err := EncodeCheckpoint(recs)
		if err != nil {
			t.Fatal(err)
		}
		recs2, err := DecodeCheckpoint(again)
		if err != nil || !sameRecords(recs2, recs) {
			t.Fatalf("round trip: %v", err)
		}
	})
}

func FuzzPrefer(f *testing.F) {
	f.Add("gpu0-numa0-0,gpu0-numa0-1,gpu1-numa1-0,gpu1-numa1-1", "gpu1-numa1-1", 2)
	f.Add("gpu0-numa0-0,x,gpu0-numaX-3", "", 3)
	f.Fuzz(func(t *testing.T, avail, must string, size int) {
		a := strings.Split(avail, ",")
		var m []string
		if must != "" {
			m = strings.Split(must, ",")
		}
		got, err := Prefer(a, m, size, nil)
		if err != nil {
			return
		}
		if len(got) != size {
			t.Fatalf("returned %d devices, size %d", len(got), size)
		}
		seen := map[string]bool{}
		for _, id := range got {
			if !slices.Contains(a, id) || seen[id] {
				t.Fatalf("returned %q: not available or repeated (%v)", id, got)
			}
			seen[id] = true
		}
		for _, id := range m {
			if !seen[id] {
				t.Fatalf("must-include %q missing from %v", id, got)
			}
		}
	})
}
