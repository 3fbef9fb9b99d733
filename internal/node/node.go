// Package node reads the host capacity the pool is sized from: memory from
// /proc/meminfo, the agent's own memory cgroup limit (v1 or v2), NUMA nodes
// and huge page pools from sysfs. Every path is read under a root directory
// ("/" on a node) so tests run against a fake tree.
package node

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// Info is what the node offers.
type Info struct {
	MemTotal     int64 // bytes, /proc/meminfo MemTotal
	MemAvailable int64 // bytes, /proc/meminfo MemAvailable
	Cgroup       Cgroup
	// NUMANodes lists the online NUMA nodes in order; empty when the kernel
	// exposes no NUMA topology.
	NUMANodes []NUMANode
	// HugePages lists the system-wide huge page pools, one per size.
	HugePages []HugePool
}

// Cgroup is the agent's own memory cgroup.
type Cgroup struct {
	Version int    // 1 or 2; 0 when no memory cgroup was found
	Dir     string // the cgroup's directory (under root)
	// Limit is the tightest memory limit on the cgroup and its ancestors
	// visible in the mount, in bytes; -1 when unlimited.
	Limit int64
	Usage int64 // bytes charged now; -1 when unknown
}

// NUMANode is one NUMA node.
type NUMANode struct {
	ID        int
	MemTotal  int64 // bytes
	MemFree   int64 // bytes
	CPUs      string
	HugePages []HugePool
}

// HugePool is one size of huge pages, on one NUMA node or system-wide.
type HugePool struct {
	PageSize int64 // bytes
	Total    int64 // pages reserved
	Free     int64 // pages not in use
}

// Unlimited is Cgroup.Limit when no limit applies.
const Unlimited = -1

// Read gathers Info under root. A missing memory cgroup or NUMA tree is not
// an error (Version 0, no nodes); unreadable or malformed files are.
func Read(root string) (*Info, error) {
	in := &Info{}
	var err error
	if in.MemTotal, in.MemAvailable, err = readMeminfo(filepath.Join(root, "proc/meminfo")); err != nil {
		return nil, err
	}
	if in.Cgroup, err = readCgroup(root); err != nil {
		return nil, err
	}
	if in.NUMANodes, err = readNUMA(root); err != nil {
		return nil, err
	}
	if in.HugePages, err = readHugePools(filepath.Join(root, "sys/kernel/mm/hugepages")); err != nil {
		return nil, err
	}
	return in, nil
}

// HugeFree returns the free huge pages of pageSize on NUMA node numa (or
// system-wide when numa < 0 or the node is unknown), in pages.
func (in *Info) HugeFree(numa int, pageSize int64) int64 {
	pools := in.HugePages
	if numa >= 0 {
		for _, n := range in.NUMANodes {
			if n.ID == numa {
				pools = n.HugePages
			}
		}
	}
	for _, p := range pools {
		if p.PageSize == pageSize {
			return p.Free
		}
	}
	return 0
}

func readMeminfo(path string) (total, avail int64, err error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, 0, fmt.Errorf("node: %w", err)
	}
	f := parseKB(data, "")
	var ok1, ok2 bool
	total, ok1 = f["MemTotal"]
	avail, ok2 = f["MemAvailable"]
	if !ok1 || !ok2 {
		return 0, 0, fmt.Errorf("node: %s lacks MemTotal or MemAvailable (kernel older than 3.14?)", path)
	}
	return total, avail, nil
}

// parseKB reads "Key:   123 kB" lines (after an optional prefix such as
// "Node 0 ") into bytes; lines without kB are kept as plain numbers.
func parseKB(data []byte, prefix string) map[string]int64 {
	m := map[string]int64{}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := strings.TrimPrefix(sc.Text(), prefix)
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		fs := strings.Fields(v)
		if len(fs) == 0 {
			continue
		}
		n, err := strconv.ParseInt(fs[0], 10, 64)
		if err != nil || n < 0 {
			continue
		}
		if len(fs) > 1 && fs[1] == "kB" {
			n *= 1024
		}
		m[strings.TrimSpace(k)] = n
	}
	return m
}

func readNUMA(root string) ([]NUMANode, error) {
	dir := filepath.Join(root, "sys/devices/system/node")
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	var nodes []NUMANode
	for _, e := range ents {
		id, err := strconv.Atoi(strings.TrimPrefix(e.Name(), "node"))
		if !strings.HasPrefix(e.Name(), "node") || err != nil || id < 0 {
			continue
		}
		d := filepath.Join(dir, e.Name())
		n := NUMANode{ID: id}
		if data, err := os.ReadFile(filepath.Join(d, "meminfo")); err == nil {
			m := parseKB(data, fmt.Sprintf("Node %d ", id))
			n.MemTotal, n.MemFree = m["MemTotal"], m["MemFree"]
		} else if !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("node: %w", err)
		}
		if b, err := os.ReadFile(filepath.Join(d, "cpulist")); err == nil {
			n.CPUs = strings.TrimSpace(string(b))
		}
		if n.HugePages, err = readHugePools(filepath.Join(d, "hugepages")); err != nil {
			return nil, err
		}
		nodes = append(nodes, n)
	}
	sort.Slice(nodes, func(i, j int) bool { return nodes[i].ID < nodes[j].ID })
	return nodes, nil
}

// readHugePools reads dir/hugepages-<size>kB/{nr_hugepages,free_hugepages};
// a missing dir means no huge page support (no pools).
func readHugePools(dir string) ([]HugePool, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	var pools []HugePool
	for _, e := range ents {
		s, ok := strings.CutPrefix(e.Name(), "hugepages-")
		if !ok {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(s, "kB"), 10, 64)
		if !strings.HasSuffix(s, "kB") || err != nil || kb <= 0 {
			return nil, fmt.Errorf("node: %s: bad huge page directory name %q", dir, e.Name())
		}
		p := HugePool{PageSize: kb << 10}
		if p.Total, err = readInt(filepath.Join(dir, e.Name(), "nr_hugepages")); err != nil {
			return nil, err
		}
		if p.Free, err = readInt(filepath.Join(dir, e.Name(), "free_hugepages")); err != nil {
			return nil, err
		}
		pools = append(pools, p)
	}
	sort.Slice(pools, func(i, j int) bool { return pools[i].PageSize < pools[j].PageSize })
	return pools, nil
}

func readInt(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("node: %w", err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("node: %s: want a non-negative integer, got %q", path, strings.TrimSpace(string(b)))
	}
	return n, nil
}
