package adversarial

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvpool/kvpool/pkg/plugin/kubelettest"
)

// Row 9: a session on a GPU the node does not have is refused with a clear
// error, and the metrics do not grow a series for it.
func TestRow09GPUsThatDoNotExist(t *testing.T) {
	a := startAgent(t)
	series := strings.Count(a.scrape(), "\n")
	cmd := exec.Command(bins.kvclient, "-ops", "1", "-gpu", "19999", "-max-pages", "8")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "KVPOOL_SOCKET=" + a.socket, "KVPOOL_TOKEN=" + evilToken}
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Skip("needs branch i13-wire (GPUs named by UUID and validated): a session on GPU 19999 of a 2-GPU node is accepted here")
	}
	if strings.Contains(a.scrape(), `gpu="19999"`) {
		t.Errorf("a metrics series for GPU 19999")
	}
	if n := strings.Count(a.scrape(), "\n"); n > series+50 {
		t.Errorf("metrics grew from %d to %d lines", series, n)
	}
	t.Logf("refused: %s", strings.TrimSpace(string(out)))
	a.alive()
	runGood(t, a)
}

// Row 12: --standalone --device-plugin must not put the state directory
// (every tenant's token) inside the socket directory that pods mount.
func TestRow12StateOutsideSocketDir(t *testing.T) {
	dir, err := os.MkdirTemp("", "kvadv12")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	kdir := filepath.Join(dir, "kubelet")
	for _, d := range []string{"device-plugins", "pod-resources"} {
		os.MkdirAll(filepath.Join(kdir, d), 0o755)
	}
	k := kubelettest.NewKubelet(t, filepath.Join(kdir, "device-plugins"))
	kubelettest.NewPodResources(t, filepath.Join(kdir, "pod-resources", "kubelet.sock"))
	a := launchEnv(t, []string{"XDG_RUNTIME_DIR=" + dir}, "--standalone", "--device-plugin", "--log-format", "json",
		"--kubelet-dir", kdir, "--metrics-address", "127.0.0.1:0", "--health-address", "127.0.0.1:0",
		"--chunks-per-gpu", "1", "--chunk-mib", "2")
	sockDir := filepath.Join(dir, "kvpool")
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := os.Stat(filepath.Join(sockDir, "kvpool.sock")); err == nil {
			break
		}
		select {
		case <-a.done:
			t.Logf("the agent exited: %v", a.err)
			return // refusing the layout is a pass too
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no socket in %s:\n%s", sockDir, a.logText())
		}
	}
	// An Allocate writes the plugin's checkpoint (every token) to the
	// state directory.
	k.WaitRegister(20 * time.Second)
	devs := k.WaitList(func(l []*pluginapi.Device) bool { return len(l) == 2 })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := k.Client().Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{devs[0].ID}}}}); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(sockDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.Name() != "kvpool.sock" {
			t.Skipf("needs branch i14-mem (state and socket directories kept apart): %s sits in the socket directory pods mount", e.Name())
		}
	}
}

// Row 13: standalone refuses a socket directory another user could have
// made (wrong owner or group/world-writable).
func TestRow13ForeignSocketDir(t *testing.T) {
	tmp, err := os.MkdirTemp("", "kvadv13")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(tmp)
	sockDir := filepath.Join(tmp, fmt.Sprintf("kvpool-%d", os.Getuid()))
	if err := os.Mkdir(sockDir, 0o777); err != nil {
		t.Fatal(err)
	}
	os.Chmod(sockDir, 0o777)
	cmd := exec.Command(bins.agent, "--standalone", "--chunks-per-gpu", "1", "--chunk-mib", "2")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "TMPDIR=" + tmp}
	done := make(chan error, 1)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("the agent exited 0")
		}
		if !strings.Contains(out.String(), sockDir) {
			t.Errorf("the refusal does not name %s:\n%s", sockDir, out.String())
		}
	case <-time.After(3 * time.Second):
		cmd.Process.Kill()
		<-done
		t.Skip("needs branch i14-mem (standalone checks the owner and mode of its socket directory): the agent serves from a 0777 directory here")
	}
}
