package cpulist

import (
	"slices"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []int
		err  string
	}{
		{in: "", want: nil},
		{in: " 5\n", want: []int{5}},
		{in: "0-3,8-11", want: []int{0, 1, 2, 3, 8, 9, 10, 11}},
		{in: "0,2,4-6", want: []int{0, 2, 4, 5, 6}},
		{in: "0-2,1-3", want: []int{0, 1, 2, 3}},
		{in: "3-1", err: "runs backwards"},
		{in: "1,,2", err: `"" is not a CPU number`},
		{in: "x", err: `"x" is not a CPU number`},
		{in: "-1", err: `"" is not a CPU number`},
		{in: "+1", err: `"+1" is not a CPU number`},
		{in: "0-8192", err: `"8192" is not a CPU number below 8192`},
		{in: "4,1", err: "not in ascending order"},
	} {
		got, err := Parse(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) || got != nil {
				t.Errorf("%q: %v, %v; want error with %q", tc.in, got, err, tc.err)
			}
			continue
		}
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("%q: %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
}

func FuzzParse(f *testing.F) {
	for _, s := range []string{"0-3,8-11", "5", "", "0,2,4-6", "3-1", "1,,2", "x", "0-8191"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		cpus, err := Parse(s)
		if err != nil {
			if cpus != nil {
				t.Fatalf("%q: error %v with CPUs %v", s, err, cpus)
			}
			return
		}
		for i, c := range cpus {
			if c < 0 || c >= MaxCPU || (i > 0 && c <= cpus[i-1]) {
				t.Fatalf("%q: CPUs %v not ascending, distinct, in range", s, cpus)
			}
		}
	})
}
