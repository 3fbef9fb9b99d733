package hostmem

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestAnonTHP(t *testing.T) {
	for _, c := range []struct {
		name  string
		files map[string]string
		want  string
	}{
		{"no THP at all", nil, ""},
		{"madvise, one setting (before Linux 6.8)", map[string]string{"hpage_pmd_size": "2097152\n", "enabled": "always [madvise] never\n"}, "madvise"},
		{"always", map[string]string{"hpage_pmd_size": "2097152\n", "enabled": "[always] madvise never\n"}, "always"},
		{"the 2 MiB size defers to the top", map[string]string{"hpage_pmd_size": "2097152\n", "enabled": "always [madvise] never\n",
			"hugepages-2048kB/enabled": "always [inherit] madvise never\n"}, "madvise"},
		{"the 2 MiB size says never over a top madvise", map[string]string{"hpage_pmd_size": "2097152\n", "enabled": "always [madvise] never\n",
			"hugepages-2048kB/enabled": "always inherit madvise [never]\n"}, "never"},
		{"the 2 MiB size says madvise over a top never", map[string]string{"hpage_pmd_size": "2097152\n", "enabled": "always madvise [never]\n",
			"hugepages-2048kB/enabled": "always inherit [madvise] never\n"}, "madvise"},
		{"a huge page that is not 2 MiB (64 KiB base pages)", map[string]string{"hpage_pmd_size": "536870912\n", "enabled": "always [madvise] never\n"}, ""},
		{"a setting without brackets", map[string]string{"hpage_pmd_size": "2097152\n", "enabled": "madvise\n"}, ""},
	} {
		dir := t.TempDir()
		for name, body := range c.files {
			path := filepath.Join(dir, name)
			if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if got := anonTHP(dir); got != c.want {
			t.Errorf("%s: anonTHP = %q, want %q", c.name, got, c.want)
		}
	}
}

// TestTHPSetting: the choice in force is the bracketed word, whichever
// setting file it is (shmem_enabled has more words than enabled).
func TestTHPSetting(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct{ body, want string }{
		{"always within_size [advise] never deny force\n", "advise"},
		{"always within_size advise [never] deny force\n", "never"},
		{"[always] madvise never\n", "always"},
		{"never\n", ""},
		{"] never [\n", ""},
		{"", ""},
	} {
		path := filepath.Join(dir, "setting")
		if err := os.WriteFile(path, []byte(c.body), 0o644); err != nil {
			t.Fatal(err)
		}
		if got := thpSetting(path); got != c.want {
			t.Errorf("%q: thpSetting = %q, want %q", c.body, got, c.want)
		}
	}
	if got := thpSetting(filepath.Join(dir, "missing")); got != "" {
		t.Errorf("a missing file: thpSetting = %q, want none", got)
	}
}

// The shared-memory THP settings: on where the global setting or any
// size's allows them; read again only every shmemTHPEvery, not for each
// chunk of a fill.
func TestShmemTHP(t *testing.T) {
	dir := t.TempDir()
	write := func(rel, s string) {
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(s+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	read := readShmemTHP
	if read(dir) {
		t.Fatal("no settings: shared-memory THP on")
	}
	write("shmem_enabled", "always within_size advise [never] deny force")
	write("hugepages-64kB/shmem_enabled", "always inherit within_size advise [never]")
	if read(dir) {
		t.Fatal("every setting never: shared-memory THP on")
	}
	write("hugepages-2048kB/shmem_enabled", "always inherit within_size [advise] never")
	if !read(dir) {
		t.Fatal("a size's setting advise: shared-memory THP off")
	}

	reads := 0
	readShmemTHP = func(string) bool { reads++; return reads%2 == 1 }
	shmemTHPCache.at = time.Time{}
	t.Cleanup(func() { readShmemTHP, shmemTHPCache.at = read, time.Time{} })
	for range 16384 {
		if !shmemTHP() {
			t.Fatal("shmemTHP changed its answer without a new read")
		}
	}
	if reads != 1 {
		t.Fatalf("16,384 chunks read the settings %d times, want once", reads)
	}
	shmemTHPCache.at = time.Now().Add(-shmemTHPEvery)
	if shmemTHP() || reads != 2 {
		t.Fatalf("after %v: %d reads, want the settings read again", shmemTHPEvery, reads)
	}
}
