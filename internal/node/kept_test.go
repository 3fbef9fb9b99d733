package node

import (
	"os"
	"reflect"
	"testing"
)

func TestWithKept(t *testing.T) {
	const gib, mib2 = int64(1 << 30), int64(2 << 20)
	page := int64(os.Getpagesize())
	base := func() *Info {
		return &Info{
			MemTotal: 64 * gib, MemAvailable: 10 * gib,
			HugePages: []HugePool{{PageSize: mib2, Total: 1024, Free: 100}, {PageSize: gib, Total: 8, Free: 0}},
			NUMANodes: []NUMANode{
				{ID: 0, HugePages: []HugePool{{PageSize: mib2, Total: 512, Free: 50}, {PageSize: gib, Total: 4, Free: 0}}},
				{ID: 1, HugePages: []HugePool{{PageSize: mib2, Total: 512, Free: 50}, {PageSize: gib, Total: 4, Free: 0}}},
			},
		}
	}
	for _, c := range []struct {
		name string
		kept []Kept
		want func(*Info)
	}{
		{"nothing kept", nil, func(*Info) {}},
		{"ordinary pages", []Kept{{NUMA: 0, PageSize: page, Bytes: 4 * gib}, {NUMA: -1, PageSize: page, Bytes: 2 * gib}},
			func(in *Info) { in.MemAvailable = 16 * gib }},
		{"ordinary pages never past MemTotal", []Kept{{NUMA: 0, PageSize: page, Bytes: 60 * gib}},
			func(in *Info) { in.MemAvailable = 64 * gib }},
		{"2 MiB pages on node 1", []Kept{{NUMA: 1, PageSize: mib2, Bytes: 300 * mib2}},
			func(in *Info) { in.HugePages[0].Free = 400; in.NUMANodes[1].HugePages[0].Free = 350 }},
		{"1 GiB pages on an unknown node: system-wide only", []Kept{{NUMA: -1, PageSize: gib, Bytes: 3 * gib}},
			func(in *Info) { in.HugePages[1].Free = 3 }},
		{"never more free than reserved", []Kept{{NUMA: 0, PageSize: gib, Bytes: 9 * gib}},
			func(in *Info) { in.HugePages[1].Free = 8; in.NUMANodes[0].HugePages[1].Free = 4 }},
		{"a size the node has no pool of", []Kept{{NUMA: 0, PageSize: 16 << 20, Bytes: 64 << 20}}, func(*Info) {}},
		{"empty chunks", []Kept{{NUMA: 0, PageSize: page, Bytes: 0}, {NUMA: 0, PageSize: mib2, Bytes: -mib2}}, func(*Info) {}},
	} {
		t.Run(c.name, func(t *testing.T) {
			in := base()
			got := in.WithKept(c.kept)
			want := base()
			c.want(want)
			if !reflect.DeepEqual(got, want) {
				t.Errorf("WithKept:\n got %+v\nwant %+v", got, want)
			}
			if !reflect.DeepEqual(in, base()) {
				t.Errorf("WithKept changed its receiver: %+v", in)
			}
		})
	}
	if got := KeptBytes([]Kept{{Bytes: 3}, {Bytes: 4}}); got != 7 {
		t.Errorf("KeptBytes = %d, want 7", got)
	}
}
