package hostmem

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
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
// such setting. Read for every chunk (a few small files; the administrator
// may change the setting while the agent runs).
func shmemTHP() bool {
	paths, _ := filepath.Glob(thpDir + "/hugepages-*kB/shmem_enabled")
	for _, p := range append([]string{thpDir + "/shmem_enabled"}, paths...) {
		switch thpSetting(p) {
		case "always", "within_size", "advise", "force":
			return true
		}
	}
	return false
}
