// Package cpulist parses the kernel's CPU lists ("0-3,8-11"), as sysfs
// gives them for NUMA nodes and online CPUs. The agent binds its pinning
// workers with it; the client kit counts the machine's CPUs with it.
package cpulist

import (
	"fmt"
	"strconv"
	"strings"
)

// MaxCPU bounds the CPU numbers Parse accepts (the kernel's
// NR_CPUS limit on x86-64 and arm64 is 8192).
const MaxCPU = 8192

// Parse parses a kernel CPU list (/sys/devices/system/node/nodeN/
// cpulist, /sys/devices/system/cpu/online: "0-3,8-11", "5", "" for a
// node without CPUs) into ascending,
// distinct CPU numbers. A malformed list is an error that quotes it.
func Parse(s string) ([]int, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, nil
	}
	seen := map[int]bool{}
	var cpus []int
	for part := range strings.SplitSeq(s, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := cpuNumber(lo)
		if err != nil {
			return nil, fmt.Errorf("CPU list %q: %w", s, err)
		}
		b := a
		if isRange {
			if b, err = cpuNumber(hi); err != nil {
				return nil, fmt.Errorf("CPU list %q: %w", s, err)
			}
			if b < a {
				return nil, fmt.Errorf("CPU list %q: range %d-%d runs backwards", s, a, b)
			}
		}
		for c := a; c <= b; c++ {
			if !seen[c] {
				seen[c] = true
				cpus = append(cpus, c)
			}
		}
	}
	for i := 1; i < len(cpus); i++ {
		if cpus[i] < cpus[i-1] {
			return nil, fmt.Errorf("CPU list %q: not in ascending order", s)
		}
	}
	return cpus, nil
}

func cpuNumber(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 || n >= MaxCPU || strings.HasPrefix(s, "+") {
		return 0, fmt.Errorf("%q is not a CPU number below %d", s, MaxCPU)
	}
	return n, nil
}
