package node

import (
	"strings"
	"testing"
)

func FuzzParseKB(f *testing.F) {
	f.Add([]byte("MemTotal: 100 kB\nMemAvailable: 50 kB\nHugePages_Total: 3\n"), "")
	f.Add([]byte("Node 1 MemTotal: 100 kB\nNode 1 MemFree: 7 kB\n"), "Node 1 ")
	f.Fuzz(func(t *testing.T, data []byte, prefix string) {
		for k, v := range parseKB(data, prefix) {
			if v < 0 {
				t.Fatalf("%s = %d < 0", k, v)
			}
		}
	})
}

func FuzzParseMountinfo(f *testing.F) {
	f.Add([]byte("35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"))
	f.Add([]byte("1039 1030 0:27 /kubepods/a /sys/fs/cgroup ro shared:5 master:1 - cgroup2 cgroup rw\n"))
	f.Add([]byte("1 2 3 /a\\040b /x - - -\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, m := range parseMountinfo(data) {
			if m.fstype == "" || m.super == "" || strings.ContainsAny(m.fstype, " \n") {
				t.Fatalf("bad mount %+v", m)
			}
		}
	})
}
