package node

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
)

// v1Unlimited: cgroup v1 writes "no limit" as a page-rounded 2^63-1; any
// value this large means unlimited.
const v1Unlimited = 1 << 62

// readCgroup finds the process's memory cgroup from root/proc/self/cgroup
// and root/proc/self/mountinfo. A v1 memory controller wins over v2 (hybrid
// hosts mount cgroup2 without the memory controller).
func readCgroup(root string) (Cgroup, error) {
	none := Cgroup{Limit: Unlimited, Usage: -1}
	data, err := os.ReadFile(filepath.Join(root, "proc/self/cgroup"))
	if errors.Is(err, os.ErrNotExist) {
		return none, nil
	}
	if err != nil {
		return none, fmt.Errorf("node: %w", err)
	}
	var v1Path, v2Path string
	haveV1, haveV2 := false, false
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[0] == "0" && parts[1] == "" {
			v2Path, haveV2 = parts[2], true
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			if c == "memory" {
				v1Path, haveV1 = parts[2], true
			}
		}
	}
	mounts, err := readMountinfo(filepath.Join(root, "proc/self/mountinfo"))
	if err != nil {
		return none, err
	}
	if haveV1 {
		for _, m := range mounts {
			if m.fstype == "cgroup" && hasOpt(m.super, "memory") {
				return limitOf(root, m, v1Path, 1, "memory.limit_in_bytes", "memory.usage_in_bytes")
			}
		}
	}
	if haveV2 {
		for _, m := range mounts {
			if m.fstype == "cgroup2" {
				cg, err := limitOf(root, m, v2Path, 2, "memory.max", "memory.current")
				if err != nil {
					return none, err
				}
				// Without the memory controller enabled there, memory.max
				// is absent everywhere: no limit from this hierarchy.
				if cg.Version == 0 {
					continue
				}
				return cg, nil
			}
		}
	}
	return none, nil
}

type mount struct {
	root, point, fstype, super string
}

func readMountinfo(p string) ([]mount, error) {
	data, err := os.ReadFile(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	return parseMountinfo(data), nil
}

// parseMountinfo reads /proc/<pid>/mountinfo lines; malformed lines are
// skipped.
func parseMountinfo(data []byte) []mount {
	var ms []mount
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		// id parent maj:min root point opts [optional...] - fstype source super
		f := strings.Fields(sc.Text())
		sep := -1
		for i, x := range f {
			if x == "-" && i >= 6 {
				sep = i
				break
			}
		}
		if sep < 0 || len(f) < sep+4 {
			continue
		}
		ms = append(ms, mount{root: unescape(f[3]), point: unescape(f[4]), fstype: f[sep+1], super: f[sep+3]})
	}
	return ms
}

// unescape undoes mountinfo's octal escapes (\040 for space).
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func hasOpt(opts, want string) bool {
	for _, o := range strings.Split(opts, ",") {
		if o == want {
			return true
		}
	}
	return false
}

// limitOf resolves the cgroup's directory in mount m and takes the tightest
// limit from it up to the mount point.
func limitOf(root string, m mount, cgPath string, version int, limitFile, usageFile string) (Cgroup, error) {
	cg := Cgroup{Limit: Unlimited, Usage: -1}
	// The mount shows the hierarchy from m.root down; inside a cgroup
	// namespace /proc/self/cgroup is relative to the namespace root,
	// which is then the mount's root.
	rel := path.Clean("/" + cgPath)
	if r := path.Clean(m.root); r != "/" {
		if rel == r {
			rel = "/"
		} else if strings.HasPrefix(rel, r+"/") {
			rel = strings.TrimPrefix(rel, r)
		}
	}
	top := filepath.Join(root, m.point)
	dir := filepath.Join(top, rel)
	if _, err := os.Stat(dir); err != nil {
		dir = top // the path is not visible in this mount namespace
	}
	found := false
	for d := dir; ; d = filepath.Dir(d) {
		b, err := os.ReadFile(filepath.Join(d, limitFile))
		switch {
		case err == nil:
			found = true
			s := strings.TrimSpace(string(b))
			if s != "max" {
				n, err := strconv.ParseInt(s, 10, 64)
				if err != nil || n < 0 {
					return cg, fmt.Errorf("node: %s: bad memory limit %q", filepath.Join(d, limitFile), s)
				}
				if n < v1Unlimited && (cg.Limit == Unlimited || n < cg.Limit) {
					cg.Limit = n
				}
			}
		case !errors.Is(err, os.ErrNotExist):
			return cg, fmt.Errorf("node: %w", err)
		}
		if d == top || len(d) <= len(top) {
			break
		}
	}
	if !found {
		return Cgroup{Limit: Unlimited, Usage: -1}, nil
	}
	cg.Version, cg.Dir = version, dir
	if n, err := readInt(filepath.Join(dir, usageFile)); err == nil {
		cg.Usage = n
	}
	return cg, nil
}
