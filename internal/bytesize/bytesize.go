// Package bytesize writes byte counts in binary units (Ki, Mi, Gi, ...), the
// suffixes of a Kubernetes quantity. It is the one byte formatter of the
// agent: the config file, the plan, the /status table, events and logs all
// write sizes through it.
//
// Exact writes the canonical quantity ("64Gi", "1536Mi", "1000"): a value
// that reads back to the same number of bytes, what resource.Quantity's
// BinarySI form writes. Approx writes the largest unit not above the value,
// whole when exact and to one decimal otherwise ("1.5Gi", "21.4Gi"), for
// people reading a log or a plan. Attr puts Approx in a slog attribute.
package bytesize

import (
	"log/slog"
	"strconv"
)

// The binary units, largest first.
var units = [...]struct {
	suffix string
	size   int64
}{
	{"Ei", 1 << 60}, {"Pi", 1 << 50}, {"Ti", 1 << 40},
	{"Gi", 1 << 30}, {"Mi", 1 << 20}, {"Ki", 1 << 10},
}

// Exact writes n with the largest binary suffix that divides it exactly,
// or as a plain integer when 1Ki does not divide it: "64Gi", "1536Mi",
// "1000", "0". The result parses back to n (config.ParseBytes, or
// resource.ParseQuantity).
func Exact(n int64) string {
	if n == 0 {
		return "0"
	}
	for _, u := range units {
		if n%u.size == 0 {
			return strconv.FormatInt(n/u.size, 10) + u.suffix
		}
	}
	return strconv.FormatInt(n, 10)
}

// Approx writes n in the largest binary unit not above it: whole when
// exact ("64Gi", "2Mi"), else to one decimal ("1.5Gi", "21.4Gi"). Below
// 1Ki it is the plain number of bytes. Negative values keep their sign.
func Approx(n int64) string {
	if n < 0 {
		if n == -n { // math.MinInt64 has no positive twin
			return "-8Ei"
		}
		return "-" + Approx(-n)
	}
	for _, u := range units {
		if n >= u.size {
			if n%u.size == 0 {
				return strconv.FormatInt(n/u.size, 10) + u.suffix
			}
			return strconv.FormatFloat(float64(n)/float64(u.size), 'f', 1, 64) + u.suffix
		}
	}
	return strconv.FormatInt(n, 10)
}

// Attr is a slog attribute holding n as Approx writes it, so that every log
// line reports sizes in the same form ("bytes=64Gi pageSize=2Mi").
func Attr(key string, n int64) slog.Attr { return slog.String(key, Approx(n)) }
