package plugin

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvpool/kvpool/pkg/contract"
)

const (
	uidA = "3f2b1c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
	uidB = "9a8b7c6d-5e4f-4321-8fed-cba987654321"
)

func TestPodUIDFromCgroup(t *testing.T) {
	sd := func(u string) string { return strings.ReplaceAll(u, "-", "_") }
	for _, c := range []struct {
		name, data, want, err string
	}{
		{"v1 cgroupfs", "12:memory:/kubepods/besteffort/pod" + uidA + "/0123abcd\n11:cpu,cpuacct:/kubepods/besteffort/pod" + uidA + "/0123abcd\n1:name=systemd:/kubepods/besteffort/pod" + uidA + "/0123abcd\n", uidA, ""},
		{"v1 guaranteed", "4:pids:/kubepods/pod" + uidA + "/ffee\n", uidA, ""},
		{"v1 systemd", "10:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + sd(uidA) + ".slice/cri-containerd-ab12.scope\n", uidA, ""},
		{"v2 systemd", "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + sd(uidA) + ".slice/cri-containerd-ab12.scope\n", uidA, ""},
		{"v2 systemd guaranteed", "0::/kubepods.slice/kubepods-pod" + sd(uidA) + ".slice/crio-ab12.scope\n", uidA, ""},
		{"v2 cgroupfs", "0::/kubepods/burstable/pod" + uidA + "/ab12\n", uidA, ""},
		{"v2 in a cgroup namespace", "0::/../../kubepods/burstable/pod" + uidA + "/ab12\n", uidA, ""},
		{"hybrid, one line outside", "1:name=systemd:/system.slice/containerd.service\n0::/kubepods/burstable/pod" + uidA + "/ab12\n", uidA, ""},
		{"static pod hash", "0::/kubepods/burstable/pod0123456789abcdef0123456789abcdef/ab12\n", "0123456789abcdef0123456789abcdef", ""},
		{"no trailing newline", "0::/kubepods/pod" + uidA, uidA, ""},
		{"host process", "0::/user.slice/user-0.slice/session-1.scope\n", "", "not in a Kubernetes pod"},
		{"pod word outside kubepods", "0::/system.slice/pod" + uidA + ".scope\n", "", "not in a Kubernetes pod"},
		{"empty", "", "", "not in a Kubernetes pod"},
		{"two pods", "1:memory:/kubepods/pod" + uidA + "/x\n0::/kubepods/pod" + uidB + "/y\n", "", "two pods"},
		{"bad uid", "0::/kubepods/burstable/podnot-a-uid/x\n", "", "not a pod UID"},
		{"upper-case uid", "0::/kubepods/pod" + strings.ToUpper(uidA) + "/x\n", "", "not a pod UID"},
		{"bad systemd uid", "0::/kubepods.slice/kubepods-pod1234.slice/x\n", "", "does not name a pod UID"},
		{"malformed line", "kubepods/pod" + uidA + "\n", "", "not id:controllers:path"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := PodUIDFromCgroup([]byte(c.data))
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("got %q, %v; want an error with %q", got, err, c.err)
				}
				return
			}
			if err != nil || got != c.want {
				t.Fatalf("got %q, %v; want %q", got, err, c.want)
			}
		})
	}
	if _, err := PodUIDFromCgroup(make([]byte, maxCgroupFile+1)); err == nil {
		t.Error("oversized cgroup file accepted")
	}
}

func FuzzPodUIDFromCgroup(f *testing.F) {
	f.Add([]byte("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + strings.ReplaceAll(uidA, "-", "_") + ".slice/cri-containerd-ab.scope\n"))
	f.Add([]byte("12:memory:/kubepods/besteffort/pod" + uidA + "/0123\n0::/\n"))
	f.Add([]byte("0::/../kubepods/pod" + uidB + "/x"))
	f.Add([]byte("0::/user.slice\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		uid, err := PodUIDFromCgroup(data)
		if err == nil && !ValidUID(uid) {
			t.Fatalf("accepted UID %q from %q", uid, data)
		}
		if err == nil && !strings.Contains(string(data), "kubepods") {
			t.Fatalf("found a pod in %q", data)
		}
	})
}

// fakeProc writes <root>/<pid>/cgroup for each pid.
func fakeProc(t *testing.T, procs map[int]string) string {
	root := t.TempDir()
	for pid, cg := range procs {
		dir := filepath.Join(root, fmt.Sprint(pid))
		os.MkdirAll(dir, 0o755)
		if err := os.WriteFile(filepath.Join(dir, "cgroup"), []byte(cg), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// A token opens sessions only from a process in the pod kubelet says holds
// the allocation: checked with kubelet's PodResources protocol (the test
// server), a fake /proc and a fake pod log directory, from the plugin's
// making on (before Run).
func TestAuthorizePeerBindsTokenToPod(t *testing.T) {
	e := newEnv(t)
	token := e.mustAllocate("gpu0-numa0-0", "gpu0-numa0-1")
	other := e.mustAllocate("gpu1-numa1-3")
	e.prs.SetPods(map[string]map[string][]string{
		"a": {contract.DefaultResourceName: {"gpu0-numa0-0", "gpu0-numa0-1"}},
		"b": {contract.DefaultResourceName: {"gpu1-numa1-3"}},
	})
	logs := t.TempDir()
	for _, d := range []string{"default_a_" + uidA, "default_b_" + uidB} {
		os.Mkdir(filepath.Join(logs, d), 0o755)
	}
	o := e.options(e.pool)
	o.BindPods, o.PodLogsDir = true, logs
	o.ProcRoot = fakeProc(t, map[int]string{
		100: "0::/kubepods/besteffort/pod" + uidA + "/c1\n",
		200: "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + strings.ReplaceAll(uidB, "-", "_") + ".slice/cri-containerd-c2.scope\n",
		300: "0::/user.slice/user-1000.slice/session-2.scope\n",
		400: "garbage",
	})
	// New dials kubelet's PodResources itself: the checks below come
	// before Run, as a client's first open after an agent restart does.
	p, err := New(o) // restores both allocations from the checkpoint
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx := context.Background()
	check := func(tok string, pid int32, wantErr error, wantMsg string) {
		t.Helper()
		id, err := p.AuthorizePeer(ctx, tok, pid)
		if wantErr == nil {
			if err != nil || id != AllocationID(tok) {
				t.Errorf("pid %d: %q, %v; want allowed", pid, id, err)
			}
			return
		}
		if !errors.Is(err, wantErr) || !strings.Contains(err.Error(), wantMsg) || id != "" {
			t.Errorf("pid %d: %q, %v; want %v mentioning %q", pid, id, err, wantErr, wantMsg)
		}
	}
	// Before any reconcile: the live PodResources listing decides.
	check(token, 100, nil, "")
	check(other, 200, nil, "")
	check(token, 200, ErrWrongPod, "belongs to pod default/a; the client (pid 200) runs in pod UID "+uidB)
	check(other, 100, ErrWrongPod, "belongs to pod default/b")
	check(token, 300, ErrWrongPod, "not in a Kubernetes pod")
	check(token, 400, ErrWrongPod, "not id:controllers:path")
	check(token, 0, ErrPeerUnknown, "hostPID: true")
	check(token, 999, ErrPeerUnknown, "pid 999")
	check("no-such-token", 100, contract.ErrUnknownToken, "")
	if err := p.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	check(token, 100, nil, "")
	check(token, 200, ErrWrongPod, "default/a")
	// Pod a is gone (its log directory too) and nothing lists the devices.
	e.prs.SetPods(nil)
	os.Remove(filepath.Join(logs, "default_a_"+uidA))
	check(token, 100, ErrWrongPod, "kubelet lists no pod holding")
	// Without BindPods (standalone), any process with the token is let in.
	check2, err := e.p.AuthorizePeer(ctx, token, 200)
	if err != nil || check2 != AllocationID(token) {
		t.Errorf("unbound plugin: %q, %v", check2, err)
	}
}
