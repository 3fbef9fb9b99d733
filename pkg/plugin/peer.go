package plugin

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/kvpool/kvpool/pkg/contract"
)

// Pod binding: in cluster mode a token works only from the pod its
// allocation was made for. The client's process (SO_PEERCRED) is mapped to
// its pod UID through /proc/<pid>/cgroup; kubelet's PodResources names the
// pod (namespace/name) that holds the allocation's devices; kubelet's pod log
// directory, <podLogsDir>/<namespace>_<name>_<uid>, ties that name to the UID
// (PodResources carries no UID; the log directory is created by kubelet for
// every pod it runs and is writable only by root).

// Defaults of the pod binding.
const (
	DefaultProcRoot = "/proc"
	// maxCgroupFile bounds what is read of /proc/<pid>/cgroup.
	maxCgroupFile = 64 << 10
)

// Errors of AuthorizePeer, for errors.Is.
var (
	// ErrPeerUnknown: the client's process cannot be identified (peer pid
	// 0: the agent does not share the host's PID namespace, or the process
	// is gone).
	ErrPeerUnknown = errors.New("client process not identifiable")
	// ErrWrongPod: the client runs outside the pod its token was
	// allocated to.
	ErrWrongPod = errors.New("token used outside the pod it was allocated to")
)

// PodUIDFromCgroup finds the Kubernetes pod UID in the contents of a
// /proc/<pid>/cgroup file: cgroup v1 ("N:controllers:/path") or v2
// ("0::/path") lines, with the cgroupfs driver (".../kubepods/<qos>/pod<uid>/...")
// or the systemd driver (".../kubepods-<qos>-pod<uid_with_underscores>.slice/...").
// Paths may be relative to the reader's cgroup namespace ("/../../kubepods...").
// A process outside any pod, or one whose lines name different pods, is an
// error.
func PodUIDFromCgroup(data []byte) (string, error) {
	if len(data) > maxCgroupFile {
		return "", fmt.Errorf("cgroup file of %d bytes", len(data))
	}
	uid := ""
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 4096), maxCgroupFile)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			return "", fmt.Errorf("cgroup line %q is not id:controllers:path", line)
		}
		u, err := podUIDFromPath(parts[2])
		if err != nil {
			return "", err
		}
		if u == "" {
			continue
		}
		if uid != "" && u != uid {
			return "", fmt.Errorf("cgroup lines name two pods, %s and %s", uid, u)
		}
		uid = u
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	if uid == "" {
		return "", errors.New("not in a Kubernetes pod's cgroup (no kubepods path)")
	}
	return uid, nil
}

// podUIDFromPath returns the pod UID a cgroup path names ("" for a path
// outside kubepods).
func podUIDFromPath(path string) (string, error) {
	segs := strings.Split(path, "/")
	inKubepods := false
	for _, s := range segs {
		switch {
		case s == "kubepods" || strings.HasPrefix(s, "kubepods.") || strings.HasPrefix(s, "kubepods-"):
			inKubepods = true
		}
		if !inKubepods {
			continue
		}
		// cgroupfs: pod<uid>
		if rest, ok := strings.CutPrefix(s, "pod"); ok {
			if !ValidUID(rest) {
				return "", fmt.Errorf("cgroup path %q: %q is not a pod UID", path, s)
			}
			return rest, nil
		}
		// systemd: kubepods[-<qos>]-pod<uid with _ for ->.slice
		if strings.HasPrefix(s, "kubepods") && strings.HasSuffix(s, ".slice") {
			name := strings.TrimSuffix(s, ".slice")
			if i := strings.LastIndex(name, "-pod"); i >= 0 {
				u := strings.ReplaceAll(name[i+len("-pod"):], "_", "-")
				if !ValidUID(u) {
					return "", fmt.Errorf("cgroup path %q: %q does not name a pod UID", path, s)
				}
				return u, nil
			}
		}
	}
	return "", nil
}

// ValidUID accepts a UUID in its canonical text form, as Kubernetes makes
// pod UIDs (lower-case hex; static pods' UIDs are hashes of 32 hex digits
// without dashes, accepted too).
func ValidUID(u string) bool {
	hex := func(s string) bool {
		for _, c := range s {
			if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
				return false
			}
		}
		return true
	}
	if len(u) == 32 {
		return hex(u)
	}
	if len(u) != 36 {
		return false
	}
	for i, c := range u {
		if i == 8 || i == 13 || i == 18 || i == 23 {
			if c != '-' {
				return false
			}
		} else if !hex(string(c)) {
			return false
		}
	}
	return true
}

// AuthorizePeer is Authorize for a client whose process ID (as the agent
// sees it, from SO_PEERCRED) is pid. With Options.BindPods it also checks
// that the process runs in the pod that holds the allocation's devices.
// Like Authorize, it returns poolerr.ErrNotReady for a restored allocation
// whose chunks have not joined the pool yet (after the pod check).
func (p *Plugin) AuthorizePeer(ctx context.Context, token string, pid int32) (string, error) {
	if _, err := p.authorizePeer(ctx, token, pid); err != nil {
		return "", err
	}
	// Revoked meanwhile: contract.ErrUnknownToken; not granted yet: ErrNotReady.
	return p.l.authorize(token)
}

func (p *Plugin) authorizePeer(ctx context.Context, token string, pid int32) (string, error) {
	id, pod, devs, claimPods, ok := p.l.lookup(token)
	if !ok {
		return "", contract.ErrUnknownToken
	}
	if !p.o.BindPods {
		return id, nil
	}
	if pid <= 0 {
		return "", fmt.Errorf("%w: the agent sees peer pid %d; it must share the host's PID namespace (hostPID: true) to check which pod a client is in", ErrPeerUnknown, pid)
	}
	data, err := readLimited(filepath.Join(p.o.ProcRoot, strconv.Itoa(int(pid)), "cgroup"), maxCgroupFile)
	if err != nil {
		return "", fmt.Errorf("%w: pid %d: %v", ErrPeerUnknown, pid, err)
	}
	uid, err := PodUIDFromCgroup(data)
	if err != nil {
		return "", fmt.Errorf("%w: pid %d: %v", ErrWrongPod, pid, err)
	}
	if claimPods != nil {
		// A ResourceClaim's token: the pods the claim is reserved for, as
		// kubelet's Prepare gave them (their UIDs, no name to look up).
		if slices.Contains(claimPods, uid) {
			return id, nil
		}
		return "", fmt.Errorf("%w: the claim's allocation is reserved for pods %v; the client (pid %d) runs in pod UID %s", ErrWrongPod, claimPods, pid, uid)
	}
	if pod != "" && p.podHasUID(pod, uid) {
		return id, nil
	}
	// The pod kubelet lists now: the first connection of a new pod comes
	// before the next reconcile has seen it.
	if p.o.Holders == nil {
		return "", fmt.Errorf("%w: no PodResources service to say which pod holds the allocation", ErrWrongPod)
	}
	held, err := p.o.Holders.Held(ctx, p.o.ResourceName)
	if err != nil {
		return "", fmt.Errorf("%w: asking kubelet which pod holds the allocation: %v", ErrWrongPod, err)
	}
	holder := ""
	for _, d := range devs {
		if h, ok := held[d]; ok {
			holder = h
			break
		}
	}
	switch {
	case holder == "":
		return "", fmt.Errorf("%w: kubelet lists no pod holding the allocation's devices", ErrWrongPod)
	case !p.podHasUID(holder, uid):
		return "", fmt.Errorf("%w: the allocation belongs to pod %s; the client (pid %d) runs in pod UID %s", ErrWrongPod, holder, pid, uid)
	}
	return id, nil
}

// podHasUID says whether the pod "namespace/name" has UID uid, by kubelet's
// pod log directory.
func (p *Plugin) podHasUID(pod, uid string) bool {
	ns, name, ok := strings.Cut(pod, "/")
	// Kubernetes names have neither '/' nor '_'; refuse anything else
	// rather than build a path from it.
	if !ok || ns == "" || name == "" || name == "." || name == ".." || ns == "." || ns == ".." ||
		strings.ContainsAny(ns+name, "/_\x00") {
		return false
	}
	fi, err := os.Stat(filepath.Join(p.o.PodLogsDir, ns+"_"+name+"_"+uid))
	return err == nil && fi.IsDir()
}

func readLimited(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, limit)
	}
	return b, nil
}
