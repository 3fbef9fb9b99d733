package sizing

import (
	"runtime"
	"slices"
	"testing"

	"github.com/kvpool/kvpool/internal/node"
)

func TestNodeWorkers(t *testing.T) {
	info := &node.Info{NUMANodes: []node.NUMANode{
		{ID: 0, CPUs: "0-31"}, {ID: 1, CPUs: "32-35"}, {ID: 2, CPUs: "7"}, {ID: 3, CPUs: "x-1"}, {ID: 4, CPUs: ""},
	}}
	def := max(1, min(runtime.NumCPU()/2, 8))
	w := NodeWorkers(info)
	for _, tc := range []struct {
		numa, n int
		cpus    []int
	}{
		{numa: 0, n: 8, cpus: seq(0, 31)}, // half of 32, bounded by 8
		{numa: 1, n: 2, cpus: seq(32, 35)},
		{numa: 2, n: 1, cpus: []int{7}},
		{numa: 3, n: def}, // unreadable CPU list: unbound
		{numa: 4, n: def}, // a node without CPUs: unbound
		{numa: 9, n: def}, // not on this node
		{numa: -1, n: def},
	} {
		n, cpus := w(tc.numa)
		if n != tc.n || !slices.Equal(cpus, tc.cpus) {
			t.Errorf("node %d: %d workers on %v, want %d on %v", tc.numa, n, cpus, tc.n, tc.cpus)
		}
	}
	if n, cpus := NodeWorkers(nil)(0); n != def || cpus != nil {
		t.Errorf("no node info: %d workers on %v", n, cpus)
	}
}

func seq(lo, hi int) []int {
	var s []int
	for i := lo; i <= hi; i++ {
		s = append(s, i)
	}
	return s
}
