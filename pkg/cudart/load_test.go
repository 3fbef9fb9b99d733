package cudart

import (
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
)

// These cases hold with and without cgo; cuda_test.go drives the real
// loader through a fake libcuda.
func TestLoadWithoutDriver(t *testing.T) {
	cases := []struct {
		name, backend string
		want          string // backend, or "" for an error
		reason        string
		is            error
	}{
		{"auto falls back", "", "sim", "/nonexistent/libcuda.so.1", nil},
		{"forced fails", "cuda", "", "/nonexistent/libcuda.so.1", ErrNoDriver},
		{"sim asked for", "sim", "sim", "asked for", nil},
		{"unknown", "rocm", "", `unknown backend "rocm"`, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d, ch, err := Load(Options{Backend: c.backend, Library: "/nonexistent/libcuda.so.1", Logger: quietLog(), Sim: SimOptions{Devices: 3}})
			if c.want == "" {
				if err == nil || !strings.Contains(err.Error(), c.reason) || (c.is != nil && !errors.Is(err, c.is)) {
					t.Fatalf("Load = %v, %v; want an error containing %q", ch, err, c.reason)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if d.Name() != c.want || ch.Backend != c.want || !strings.Contains(ch.Reason, c.reason) {
				t.Errorf("Load chose %v, want %s because of %q", ch, c.want, c.reason)
			}
			if n, _ := d.DeviceCount(); n != 3 || ch.Devices != 3 {
				t.Errorf("simulator has %d devices (choice says %d), want the 3 asked for", n, ch.Devices)
			}
		})
	}
}

func TestFormatVersion(t *testing.T) {
	for v, want := range map[int]string{12000: "12.0", 12080: "12.8", 12090: "12.9", 13000: "13.0", 11080: "11.8", 13010: "13.1"} {
		if got := FormatVersion(v); got != want {
			t.Errorf("FormatVersion(%d) = %q, want %q", v, got, want)
		}
	}
}

func TestErrorFormat(t *testing.T) {
	e := &Error{Call: "cuMemcpyBatchAsync", Code: 1, Name: "CUDA_ERROR_INVALID_VALUE", Msg: "invalid argument"}
	if got, want := e.Error(), "cuMemcpyBatchAsync: CUDA_ERROR_INVALID_VALUE (1): invalid argument"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	if !errors.Is(e, ErrInvalidValue) || errors.Is(e, ErrOutOfMemory) {
		t.Error("errors.Is does not match by code")
	}
	e.Msg = ""
	if got, want := e.Error(), "cuMemcpyBatchAsync: CUDA_ERROR_INVALID_VALUE (1)"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
}

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }
