package node

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

const (
	kib = 1 << 10
	mib = 1 << 20
	gib = 1 << 30
)

func TestReadTrees(t *testing.T) {
	cases := []struct {
		tree string
		want Info
	}{
		{"v2-two-numa", Info{
			MemTotal: 528_000_000 * kib, MemAvailable: 480_000_000 * kib,
			Cgroup: Cgroup{Version: 2, Dir: "testdata/v2-two-numa/sys/fs/cgroup/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope",
				Limit: 300 * gib, Usage: 200 * mib},
			NUMANodes: []NUMANode{
				{ID: 0, MemTotal: 264_000_000 * kib, MemFree: 200_000_000 * kib, CPUs: "0-31,64-95",
					HugePages: []HugePool{{2 * mib, 512, 500}, {gib, 0, 0}}},
				{ID: 1, MemTotal: 264_000_000 * kib, MemFree: 230_000_000 * kib, CPUs: "32-63,96-127",
					HugePages: []HugePool{{2 * mib, 512, 500}, {gib, 4, 4}}},
			},
			HugePages: []HugePool{{2 * mib, 1024, 1000}, {gib, 4, 4}},
		}},
		{"v1-hybrid", Info{
			MemTotal: 24_683_652 * kib, MemAvailable: 22_419_356 * kib,
			Cgroup: Cgroup{Version: 1, Dir: "testdata/v1-hybrid/sys/fs/cgroup/memory/process_api/4eae",
				Limit: 16 * gib, Usage: 147886080},
			NUMANodes: []NUMANode{{ID: 0, MemTotal: 24_683_652 * kib, MemFree: 11_000_000 * kib, CPUs: "0-1"}},
		}},
		{"v2-namespace", Info{
			MemTotal: 65_000_000 * kib, MemAvailable: 60_000_000 * kib,
			Cgroup:    Cgroup{Version: 2, Dir: "testdata/v2-namespace/sys/fs/cgroup", Limit: 8 * gib, Usage: 64 * mib},
			HugePages: []HugePool{{2 * mib, 64, 64}},
		}},
		{"bare", Info{
			MemTotal: 8_000_000 * kib, MemAvailable: 6_000_000 * kib,
			Cgroup: Cgroup{Limit: Unlimited, Usage: -1},
		}},
	}
	for _, c := range cases {
		t.Run(c.tree, func(t *testing.T) {
			got, err := Read(filepath.Join("testdata", c.tree))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(*got, c.want) {
				t.Errorf("Read =\n%+v\nwant\n%+v", *got, c.want)
			}
		})
	}
}

func TestHugeFree(t *testing.T) {
	in, err := Read("testdata/v2-two-numa")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		numa int
		size int64
		want int64
	}{
		{0, 2 * mib, 500}, {0, gib, 0}, {1, gib, 4}, {-1, 2 * mib, 1000}, {-1, gib, 4},
		{7, 2 * mib, 1000}, // unknown node: system-wide
		{0, 16 * gib, 0},   // no such size
	} {
		if got := in.HugeFree(c.numa, c.size); got != c.want {
			t.Errorf("HugeFree(%d, %d) = %d, want %d", c.numa, c.size, got, c.want)
		}
	}
}

// TestReadThisMachine reads the real /proc and /sys: whatever the host, the
// numbers must be coherent.
func TestReadThisMachine(t *testing.T) {
	in, err := Read("/")
	if err != nil {
		t.Fatal(err)
	}
	if in.MemTotal <= 0 || in.MemAvailable <= 0 || in.MemAvailable > in.MemTotal {
		t.Errorf("MemTotal %d MemAvailable %d", in.MemTotal, in.MemAvailable)
	}
	if in.Cgroup.Limit != Unlimited && in.Cgroup.Limit <= 0 {
		t.Errorf("cgroup limit %d", in.Cgroup.Limit)
	}
	t.Logf("%+v", in)
}

// copyTree copies testdata/<name> to a temp dir for a test to break.
func copyTree(t *testing.T, name string) string {
	t.Helper()
	dst := t.TempDir()
	src := filepath.Join("testdata", name)
	err := filepath.Walk(src, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		if fi.IsDir() {
			return os.MkdirAll(filepath.Join(dst, rel), 0o755)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dst, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	return dst
}

func TestReadErrors(t *testing.T) {
	cases := []struct {
		name, tree, file, body, want string
	}{
		{"no meminfo", "bare", "proc/meminfo", "", "no such file"},
		{"no MemAvailable", "bare", "proc/meminfo", "MemTotal: 100 kB\n", "lacks MemTotal or MemAvailable"},
		{"bad v1 limit", "v1-hybrid", "sys/fs/cgroup/memory/process_api/4eae/memory.limit_in_bytes", "lots\n", `bad memory limit "lots"`},
		{"bad v2 limit", "v2-namespace", "sys/fs/cgroup/memory.max", "-5\n", `bad memory limit "-5"`},
		{"bad huge count", "v2-two-numa", "sys/devices/system/node/node1/hugepages/hugepages-2048kB/free_hugepages", "x\n", `want a non-negative integer, got "x"`},
		{"bad huge dir", "v2-namespace", "sys/kernel/mm/hugepages/hugepages-2MB/nr_hugepages", "1\n", `bad huge page directory name "hugepages-2MB"`},
		{"missing free count", "v2-namespace", "sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages", "1\n", "free_hugepages"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			root := copyTree(t, c.tree)
			p := filepath.Join(root, c.file)
			if c.body == "" {
				os.Remove(p)
			} else {
				os.MkdirAll(filepath.Dir(p), 0o755)
				os.WriteFile(p, []byte(c.body), 0o644)
			}
			got, err := Read(root)
			if err == nil {
				t.Fatalf("Read = %+v, want an error", got)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %q does not contain %q", err, c.want)
			}
		})
	}
}

func TestCgroupFallbacks(t *testing.T) {
	// v1 line without a mounted memory controller, and a cgroup2 mount
	// without memory.max anywhere (controller not enabled): unlimited.
	root := copyTree(t, "v1-hybrid")
	os.WriteFile(filepath.Join(root, "proc/self/mountinfo"), []byte(
		"41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"), 0o644)
	in, err := Read(root)
	if err != nil {
		t.Fatal(err)
	}
	if in.Cgroup.Version != 0 || in.Cgroup.Limit != Unlimited {
		t.Errorf("cgroup %+v, want none", in.Cgroup)
	}
	// A path that the mount does not show: the mount point's own limit.
	root = copyTree(t, "v2-namespace")
	os.WriteFile(filepath.Join(root, "proc/self/cgroup"), []byte("0::/elsewhere/x\n"), 0o644)
	in, err = Read(root)
	if err != nil {
		t.Fatal(err)
	}
	if in.Cgroup.Limit != 8*gib {
		t.Errorf("cgroup %+v, want the mount point's 8Gi", in.Cgroup)
	}
}

func TestUnescape(t *testing.T) {
	for in, want := range map[string]string{`/a\040b`: "/a b", `/plain`: "/plain", `/x\134y`: `/x\y`, `/bad\9`: `/bad\9`} {
		if got := unescape(in); got != want {
			t.Errorf("unescape(%q) = %q, want %q", in, got, want)
		}
	}
}
