package agent

import (
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
)

func TestAllocations(t *testing.T) {
	gpus := [][]string{{"g0-0", "g0-1", "g0-2"}, {"g1-0", "g1-1", "g1-2"}}
	alloc, chunks, err := Allocations([]string{"a", "b"}, gpus, nil)
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string]string{"a": AllocationName("a"), "b": AllocationName("b")}; !reflect.DeepEqual(alloc, want) {
		t.Errorf("allocations %v, want %v", alloc, want)
	}
	if AllocationName("a") == AllocationName("b") || !strings.HasPrefix(AllocationName("a"), "standalone-") || strings.Contains(AllocationName("a-secret"), "secret") {
		t.Errorf("allocation names %q %q %q", AllocationName("a"), AllocationName("b"), AllocationName("a-secret"))
	}
	// Round robin in the order of the allocation names.
	first, second := "a", "b"
	if alloc["b"] < alloc["a"] {
		first, second = "b", "a"
	}
	want := map[string][]string{first: {"g0-0", "g0-2", "g1-0", "g1-2"}, second: {"g0-1", "g1-1"}}
	if !reflect.DeepEqual(chunks, want) {
		t.Errorf("chunks %v, want %v", chunks, want)
	}
	// Another order of the same tokens: the same allocations, the same
	// chunks (issue 23: by position, tenant A's chunks went to tenant B).
	alloc2, chunks2, err := Allocations([]string{"b", "a"}, gpus, nil)
	if err != nil || !reflect.DeepEqual(alloc2, alloc) || !reflect.DeepEqual(chunks2, chunks) {
		t.Errorf("reordered tokens: %v %v %v, want %v %v", alloc2, chunks2, err, alloc, chunks)
	}
	// Allocations kept from before a restart keep their chunks; the other
	// tokens share the rest.
	kept := map[string][]string{AllocationName("b"): {"g0-2", "g1-0"}, "standalone-gone": {"g0-0"}}
	_, chunks3, err := Allocations([]string{"c", "b", "a"}, gpus, kept)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(chunks3["b"], []string{"g0-2", "g1-0"}) || len(chunks3["a"])+len(chunks3["c"]) != 4 ||
		slices.Contains(append(chunks3["a"], chunks3["c"]...), "g0-2") || slices.Contains(append(chunks3["a"], chunks3["c"]...), "g1-0") {
		t.Errorf("with kept allocations: %v", chunks3)
	}

	bad := []struct {
		name   string
		tokens []string
		want   string
	}{
		{"none", nil, "no tokens"},
		{"empty", []string{"a", ""}, "non-empty"},
		{"repeated", []string{"a", "a"}, "distinct"},
		{"comma", []string{"a,b"}, "without spaces or commas"},
		{"space", []string{"a b"}, "without spaces or commas"},
		{"more tokens than chunks", []string{"a", "b", "c", "d"}, "4 standalone tokens need at least as many chunks per GPU; GPU 0 has 3"},
	}
	for _, c := range bad {
		t.Run(c.name, func(t *testing.T) {
			alloc, chunks, err := Allocations(c.tokens, gpus, nil)
			if err == nil || !strings.Contains(err.Error(), c.want) || alloc != nil || chunks != nil {
				t.Fatalf("got %v, %v, %v; want nothing and an error containing %q", alloc, chunks, err, c.want)
			}
		})
	}
}

func TestCheckSocketDir(t *testing.T) {
	root := t.TempDir()
	mk := func(name string, mode os.FileMode) string {
		p := filepath.Join(root, name)
		if err := os.Mkdir(p, mode); err != nil {
			t.Fatal(err)
		}
		os.Chmod(p, mode) // past the umask
		return p
	}
	own := mk("own", 0o700)
	shared := mk("shared", 0o755)
	world := mk("world", 0o777)
	group := mk("group", 0o770)
	sticky := mk("sticky", 0o1777)
	file := filepath.Join(root, "file")
	os.WriteFile(file, nil, 0o600)
	link := filepath.Join(root, "link")
	os.Symlink(own, link)
	other := mk("other", 0o700)
	chowned := os.Chown(other, 65534, 65534) == nil

	for _, c := range []struct {
		dir, want string
	}{
		{filepath.Join(root, "absent"), ""},
		{own, ""},
		{shared, ""},
		{world, "mode 0777: group or others may write it"},
		{group, "mode 0770"},
		{sticky, "mode 0777"},
		{file, "is not a directory"},
		{link, "is not a directory (L"},
	} {
		err := CheckSocketDir(c.dir)
		if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("CheckSocketDir(%s) = %v, want %q", filepath.Base(c.dir), err, c.want)
		}
	}
	if chowned && os.Getuid() != 65534 {
		if err := CheckSocketDir(other); err == nil || !strings.Contains(err.Error(), "is owned by uid 65534") {
			t.Errorf("directory of another user: %v", err)
		}
	}
}
