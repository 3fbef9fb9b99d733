package config

import (
	"reflect"
	"testing"
)

// FuzzParseBytes: any accepted quantity is non-negative and prints to a
// string that parses back to the same value.
func FuzzParseBytes(f *testing.F) {
	for _, s := range []string{"64Gi", "512Mi", "1.5Gi", "4096", "1e9", "-1", "8Ei", ".5Ki"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		b, err := ParseBytes(s)
		if err != nil {
			return
		}
		if b < 0 {
			t.Fatalf("ParseBytes(%q) = %d < 0", s, b)
		}
		b2, err := ParseBytes(b.String())
		if err != nil || b2 != b {
			t.Fatalf("ParseBytes(%q) = %d prints %q which parses to %d, %v", s, b, b.String(), b2, err)
		}
	})
}

// FuzzParse: Parse never panics, and any config it accepts is valid and
// survives Marshal and Parse unchanged.
func FuzzParse(f *testing.F) {
	f.Add([]byte(head + "sizing:\n  poolBytes: 64Gi\n"))
	f.Add([]byte(head + "standalone:\n  tokens: [a, b]\n"))
	f.Add([]byte("apiVersion: x\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse(data)
		if err != nil {
			if c != nil {
				t.Fatal("config returned with an error")
			}
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("Parse accepted an invalid config: %v", err)
		}
		out, err := Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		c2, err := Parse(out)
		if err != nil {
			t.Fatalf("Parse(Marshal(c)): %v\n%s", err, out)
		}
		if !reflect.DeepEqual(c, c2) {
			t.Fatalf("round trip changed the config\n%s", out)
		}
	})
}
