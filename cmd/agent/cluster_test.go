package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/plugin/kubelettest"
)

// TestMain lets the test binary stand in for the agent binary: the
// end-to-end tests start it again as a separate process.

type agentProc struct {
	t   *testing.T
	cmd *exec.Cmd
}

func startAgent(t *testing.T, args ...string) *agentProc {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "KVPOOL_TEST_AGENT=1", "KVPOOL_TEST_AGENT_ARGS="+strings.Join(args, " "))
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	a := &agentProc{t: t, cmd: cmd}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	return a
}

// stop sends SIGTERM and expects a clean exit.
func (a *agentProc) stop() {
	a.t.Helper()
	a.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- a.cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			a.t.Fatalf("agent exit: %v", err)
		}
	case <-time.After(10 * time.Second):
		a.t.Fatal("agent did not stop within 10s of SIGTERM")
	}
}

func allocate(t *testing.T, k *kubelettest.Kubelet, ids ...string) (*pluginapi.ContainerAllocateResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := k.Client().Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids}}})
	if err != nil {
		return nil, err
	}
	return resp.ContainerResponses[0], nil
}

// The standalone agent with the device plugin enabled, as a separate
// process, against the test kubelet: registration, the device list,
// Allocate, a restart of the agent that keeps the token, and a conflicting
// Allocate refused because PodResources lists the holder.
func TestStandaloneAgentWithDevicePlugin(t *testing.T) {
	n := newTestNode(t)
	root, kdir, k, prs := n.root, n.kubelet, n.k, n.prs
	args := []string{"--standalone", "--device-plugin", "--kubelet-dir", kdir, "--socket-dir", filepath.Join(root, "sock"),
		"--state-dir", filepath.Join(root, "state"), "--reclaim-interval", "50ms", "--reclaim-grace-period", "1h"}

	agent := startAgent(t, args...)
	reg := k.WaitRegister(20 * time.Second)
	if reg.ResourceName != contract.DefaultResourceName {
		t.Errorf("registered %q", reg.ResourceName)
	}
	k.WaitList(func(l []*pluginapi.Device) bool {
		for _, d := range l {
			if d.Health != pluginapi.Healthy || d.GetTopology().GetNodes()[0].GetID() != 0 {
				return false
			}
		}
		return len(l) == 8
	})
	ids := []string{"gpu1-numa0-0", "gpu1-numa0-1"}
	resp, err := allocate(t, k, ids...)
	if err != nil {
		t.Fatal(err)
	}
	token := resp.Envs[contract.EnvToken]
	if resp.Envs[contract.EnvSocket] != "/var/run/kvpool/kvpool.sock" || len(token) < 22 ||
		resp.Mounts[0].HostPath != filepath.Join(root, "sock") || resp.Mounts[0].ContainerPath != "/var/run/kvpool" {
		t.Fatalf("allocate response %v", resp)
	}
	if _, err := allocate(t, k, "gpu9-numa0-0"); status.Code(err) != codes.InvalidArgument {
		t.Errorf("allocate of an unknown chunk: %v", err)
	}
	agent.stop()
	if ents, _ := os.ReadDir(filepath.Join(kdir, "device-plugins")); len(ents) != 1 {
		t.Errorf("device-plugins after stop: %v (want only kubelet.sock)", ents)
	}

	// The agent restarts: it registers again, lists its chunks as they
	// become ready (kubelet allocates only listed devices) and knows the
	// allocation.
	agent = startAgent(t, args...)
	k.WaitRegister(20 * time.Second)
	k.WaitList(func(l []*pluginapi.Device) bool { return len(l) == 8 })
	resp, err = allocate(t, k, ids[1], ids[0])
	if err != nil || resp.Envs[contract.EnvToken] != token {
		t.Fatalf("allocate after the agent restarted: %v (same token: %v)", err, err == nil && resp.Envs[contract.EnvToken] == token)
	}
	prs.SetPods(map[string]map[string][]string{"x": {contract.DefaultResourceName: ids}})
	if _, err := allocate(t, k, "gpu1-numa0-1", "gpu1-numa0-2"); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "default/x") {
		t.Errorf("allocate of a chunk a listed pod holds: %v", err)
	}
	agent.stop()
}
