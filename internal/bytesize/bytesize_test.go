package bytesize_test

import (
	"bytes"
	"log/slog"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/kvpool/kvpool/internal/bytesize"
)

func TestExact(t *testing.T) {
	for in, want := range map[int64]string{
		0:                     "0",
		1:                     "1",
		1000:                  "1000",
		1023:                  "1023",
		1024:                  "1Ki",
		1536:                  "1536",
		3 << 10:               "3Ki",
		2 << 20:               "2Mi",
		1536 << 20:            "1536Mi",
		64 << 30:              "64Gi",
		(64 << 30) + 4096:     "67108868Ki",
		1 << 40:               "1Ti",
		5 << 50:               "5Pi",
		7 << 60:               "7Ei",
		-(2 << 20):            "-2Mi",
		-1000:                 "-1000",
		math.MaxInt64:         "9223372036854775807",
		math.MinInt64:         "-8Ei",
		(1 << 30) + (1 << 20): "1025Mi",
	} {
		if got := bytesize.Exact(in); got != want {
			t.Errorf("Exact(%d) = %q, want %q", in, got, want)
		}
	}
}

// Exact is the canonical form Kubernetes writes for a BinarySI quantity, and
// it reads back to the same number of bytes.
func TestExactIsTheKubernetesQuantity(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i := range 5000 {
		// Mostly multiples of a binary unit, the sizes the agent deals in.
		n := r.Int64N(1<<20) << (10 * r.IntN(5))
		if i%2 == 1 {
			n = -n
		}
		got := bytesize.Exact(n)
		if want := resource.NewQuantity(n, resource.BinarySI).String(); got != want {
			t.Fatalf("Exact(%d) = %q, resource.Quantity writes %q", n, got, want)
		}
		if n < 0 {
			continue // sizes are not negative (and Quantity.Value misreads some large negative ones)
		}
		q, err := resource.ParseQuantity(got)
		if err != nil || q.Value() != n {
			t.Fatalf("Exact(%d) = %q reads back as %v (%v)", n, got, q.Value(), err)
		}
	}
}

func TestApprox(t *testing.T) {
	for in, want := range map[int64]string{
		0:                     "0",
		1023:                  "1023",
		1024:                  "1Ki",
		1536:                  "1.5Ki",
		2 << 20:               "2Mi",
		1536 << 20:            "1.5Gi",
		64 << 30:              "64Gi",
		(64 << 30) + 4096:     "64.0Gi",
		23 << 30 / 10 * 9:     "20.7Gi",
		3 << 40:               "3Ti",
		(1 << 50) + (1 << 49): "1.5Pi",
		-(1536 << 20):         "-1.5Gi",
		math.MinInt64:         "-8Ei",
		math.MaxInt64:         "8.0Ei",
	} {
		if got := bytesize.Approx(in); got != want {
			t.Errorf("Approx(%d) = %q, want %q", in, got, want)
		}
	}
}

func TestAttr(t *testing.T) {
	var buf bytes.Buffer
	slog.New(slog.NewTextHandler(&buf, nil)).Info("pool ready", bytesize.Attr("bytes", 96<<30), bytesize.Attr("pageSize", 4096))
	if got := buf.String(); !strings.Contains(got, "bytes=96Gi pageSize=4Ki") {
		t.Errorf("log line %q does not carry the sizes as quantities", got)
	}
}
