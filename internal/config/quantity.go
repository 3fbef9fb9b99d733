package config

import (
	"encoding/json"
	"fmt"
	"math"
	"math/big"
	"strings"
	"time"

	"github.com/kvpool/kvpool/internal/bytesize"
)

// Bytes is a size in bytes. In YAML, JSON, flags and the environment it is
// written as a plain integer ("1073741824") or a Kubernetes-style quantity:
// binary suffixes Ki, Mi, Gi, Ti, Pi, Ei (powers of 1024) or decimal
// suffixes k, M, G, T, P, E (powers of 1000), with an optional fraction
// ("1.5Gi") as long as the result is a whole number of bytes.
type Bytes int64

// Common sizes.
const (
	KiB Bytes = 1 << 10
	MiB Bytes = 1 << 20
	GiB Bytes = 1 << 30
	TiB Bytes = 1 << 40
)

var suffixes = map[string]int64{
	"":   1,
	"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
	"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
}

// ParseBytes parses a quantity such as "64Gi", "512Mi", "1.5G" or "4096".
// Negative values, exponents, unknown suffixes, fractions of a byte and
// values above 2^63-1 are errors.
//
// It is not apimachinery's resource.ParseQuantity on purpose: that parser
// reads "Gi" and "." as zero, takes milli units and exponents, and its
// exact int64 conversion (AsInt64) refuses sizes from 4Ei up; a config
// value needs whole bytes and a clear error. Where both accept a value they
// agree (TestParseBytesAgreesWithQuantity).
func ParseBytes(s string) (Bytes, error) {
	t := strings.TrimSpace(s)
	if t == "" {
		return 0, fmt.Errorf("quantity is empty")
	}
	i := 0
	dots := 0
	for i < len(t) && (t[i] >= '0' && t[i] <= '9' || t[i] == '.') {
		if t[i] == '.' {
			dots++
		}
		i++
	}
	num, suf := t[:i], t[i:]
	if num == "" || num == "." || dots > 1 {
		return 0, fmt.Errorf("quantity %q: want a non-negative number with an optional suffix (Ki, Mi, Gi, Ti, k, M, G, T), e.g. 64Gi", s)
	}
	mult, ok := suffixes[suf]
	if !ok {
		return 0, fmt.Errorf("quantity %q: unknown suffix %q (use Ki, Mi, Gi, Ti, Pi, Ei or k, M, G, T, P, E)", s, suf)
	}
	r, ok := new(big.Rat).SetString(num)
	if !ok {
		return 0, fmt.Errorf("quantity %q: bad number %q", s, num)
	}
	r.Mul(r, new(big.Rat).SetInt64(mult))
	if !r.IsInt() {
		return 0, fmt.Errorf("quantity %q is not a whole number of bytes", s)
	}
	if r.Num().Cmp(big.NewInt(math.MaxInt64)) > 0 {
		return 0, fmt.Errorf("quantity %q is too large (more than 2^63-1 bytes)", s)
	}
	return Bytes(r.Num().Int64()), nil
}

// String writes b with the largest binary suffix that divides it exactly
// ("64Gi", "512Mi", "1000").
func (b Bytes) String() string { return bytesize.Exact(int64(b)) }

// MarshalJSON writes b as a quantity string.
func (b Bytes) MarshalJSON() ([]byte, error) { return json.Marshal(b.String()) }

// UnmarshalJSON reads a quantity string or a non-negative integer.
func (b *Bytes) UnmarshalJSON(data []byte) error {
	var s string
	if len(data) > 0 && data[0] == '"' {
		if err := json.Unmarshal(data, &s); err != nil {
			return err
		}
	} else {
		s = string(data)
		if s == "null" {
			return fmt.Errorf("quantity is null")
		}
	}
	v, err := ParseBytes(s)
	if err != nil {
		return err
	}
	*b = v
	return nil
}

// Duration is a time.Duration written as a Go duration string ("2m",
// "10s", "1h30m") in YAML, JSON, flags and the environment.
type Duration struct{ time.Duration }

// ParseDuration parses a Go duration string; negative durations are errors.
func ParseDuration(s string) (Duration, error) {
	d, err := time.ParseDuration(strings.TrimSpace(s))
	if err != nil {
		return Duration{}, fmt.Errorf("duration %q: want a value such as 2m or 10s", s)
	}
	if d < 0 {
		return Duration{}, fmt.Errorf("duration %q is negative", s)
	}
	return Duration{d}, nil
}

// MarshalJSON writes d as a duration string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(d.String()) }

// UnmarshalJSON reads a duration string.
func (d *Duration) UnmarshalJSON(data []byte) error {
	var s string
	if err := json.Unmarshal(data, &s); err != nil {
		return fmt.Errorf("duration must be a string such as \"2m\", got %s", data)
	}
	v, err := ParseDuration(s)
	if err != nil {
		return err
	}
	*d = v
	return nil
}
