package hostmem

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"
)

// Resident reports how much of the process's mapping that starts at mem
// is resident and how much of that is locked, in bytes, as the kernel
// counts them (/proc/self/smaps: Rss, Locked). Slow (it reads every
// mapping's entry): for tests and diagnostics, not for a hot path.
func Resident(mem []byte) (rss, locked int64, err error) {
	if len(mem) == 0 {
		return 0, 0, fmt.Errorf("hostmem: resident: no mapping")
	}
	data, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		return 0, 0, fmt.Errorf("hostmem: resident: %w", err)
	}
	start := fmt.Sprintf("%x-", uintptr(unsafe.Pointer(&mem[0])))
	in, found := false, 0
	for _, l := range strings.Split(string(data), "\n") {
		f := strings.Fields(l)
		switch {
		case len(f) > 0 && strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":"):
			in = strings.HasPrefix(l, start)
		case in && len(f) == 3 && (f[0] == "Rss:" || f[0] == "Locked:"):
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				return 0, 0, fmt.Errorf("hostmem: resident: %q: %w", l, err)
			}
			if f[0] == "Rss:" {
				rss = kb << 10
			} else {
				locked = kb << 10
			}
			found++
		}
	}
	if found != 2 {
		return 0, 0, fmt.Errorf("hostmem: resident: no mapping at %s with Rss and Locked in /proc/self/smaps", start)
	}
	return rss, locked, nil
}
