package standalone

import (
	"reflect"
	"strings"
	"testing"
)

func TestAllocations(t *testing.T) {
	gpus := [][]string{{"g0-0", "g0-1", "g0-2"}, {"g1-0", "g1-1", "g1-2"}}
	alloc, chunks, err := Allocations([]string{"a", "b"}, gpus)
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string]string{"a": "standalone-0", "b": "standalone-1"}; !reflect.DeepEqual(alloc, want) {
		t.Errorf("allocations %v, want %v", alloc, want)
	}
	want := map[string][]string{"a": {"g0-0", "g0-2", "g1-0", "g1-2"}, "b": {"g0-1", "g1-1"}}
	if !reflect.DeepEqual(chunks, want) {
		t.Errorf("chunks %v, want %v", chunks, want)
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
			alloc, chunks, err := Allocations(c.tokens, gpus)
			if err == nil || !strings.Contains(err.Error(), c.want) || alloc != nil || chunks != nil {
				t.Fatalf("got %v, %v, %v; want nothing and an error containing %q", alloc, chunks, err, c.want)
			}
		})
	}
}
