package hostmem

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// thpDir is where the kernel says how it gives transparent huge pages.
const thpDir = "/sys/kernel/mm/transparent_hugepage"

// thpSetting is the choice in force in the THP setting at path: the word
// in brackets of "always [madvise] never"; "" where the file is missing or
// says none.
func thpSetting(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	s := string(b)
	i, j := strings.IndexByte(s, '['), strings.IndexByte(s, ']')
	if i < 0 || j < i {
		return ""
	}
	return s[i+1 : j]
}

// AnonTHP is how the kernel gives 2 MiB transparent huge pages to
// anonymous memory: "always", "madvise" or "never" ("" where it does not
// say, or its huge page is not 2 MiB).
func AnonTHP() string { return anonTHP(thpDir) }

// anonTHP is AnonTHP for the settings under dir. Since Linux 6.8 each size
// has its own setting, which may defer to the top one ("inherit").
func anonTHP(dir string) string {
	if b, _ := os.ReadFile(filepath.Join(dir, "hpage_pmd_size")); strings.TrimSpace(string(b)) != strconv.Itoa(hugePage2M) {
		return ""
	}
	if m := thpSetting(filepath.Join(dir, "hugepages-2048kB/enabled")); m != "" && m != "inherit" {
		return m
	}
	return thpSetting(filepath.Join(dir, "enabled"))
}

// shmemTHP reports whether shared-memory transparent huge pages may back
// a chunk that asks for them (MADV_HUGEPAGE): the global setting, or that
// of any size, is other than never or deny; false where the kernel has no
// such setting. The settings are read again at most every shmemTHPEvery:
// the administrator may change them while the agent runs, and a fill
// reads them for every chunk (read each time, a pool of 16,384 chunks
// globbed sysfs and read ten files for each on Linux 6.18: about 60 KB
// of garbage a chunk, 1.2 GB of heap for a standalone fill, which runs
// with the collector off).
func shmemTHP() bool {
	c := &shmemTHPCache
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.at.IsZero() || time.Since(c.at) >= shmemTHPEvery {
		c.on, c.at = readShmemTHP(thpDir), time.Now()
	}
	return c.on
}

// shmemTHPEvery is how long shmemTHP answers from what it last read.
const shmemTHPEvery = time.Second

// shmemTHPCache is what shmemTHP last read, and when.
var shmemTHPCache struct {
	mu sync.Mutex
	at time.Time
	on bool
}

// readShmemTHP reads shmemTHP's answer from the settings under dir (a
// variable for tests).
var readShmemTHP = func(dir string) bool {
	paths, _ := filepath.Glob(dir + "/hugepages-*kB/shmem_enabled")
	for _, p := range append([]string{dir + "/shmem_enabled"}, paths...) {
		switch thpSetting(p) {
		case "always", "within_size", "advise", "force":
			return true
		}
	}
	return false
}
