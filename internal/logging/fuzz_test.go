package logging

import (
	"log/slog"
	"strings"
	"testing"
)

// ParseLevel accepts exactly the four names (any case, surrounding space)
// and round-trips the level it returns.
func FuzzParseLevel(f *testing.F) {
	for _, s := range []string{"", "info", "DEBUG", " warn ", "warning", "error", "trace", "-4", "info\x00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		lvl, err := ParseLevel(s)
		norm := strings.ToLower(strings.TrimSpace(s))
		valid := map[string]slog.Level{"": slog.LevelInfo, "info": slog.LevelInfo, "debug": slog.LevelDebug,
			"warn": slog.LevelWarn, "warning": slog.LevelWarn, "error": slog.LevelError}
		want, ok := valid[norm]
		if ok != (err == nil) {
			t.Fatalf("ParseLevel(%q) = %v, %v", s, lvl, err)
		}
		if ok && lvl != want {
			t.Fatalf("ParseLevel(%q) = %v, want %v", s, lvl, want)
		}
		if ok {
			back, err := ParseLevel(lvl.String())
			if err != nil || back != lvl {
				t.Fatalf("round trip of %v: %v, %v", lvl, back, err)
			}
		}
	})
}
