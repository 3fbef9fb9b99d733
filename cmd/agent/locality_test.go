package main

import (
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/cudart"
)

// The agent as a cluster node runs it, four simulated GPUs, against the
// test kubelet: kubelet gives a pod four chunks all sized under GPU 0's
// name and, through another device plugin, GPUs 3 and 2; PodResources
// lists both. The pod's engine runs one real kvclient process per GPU it
// was given (NVIDIA_VISIBLE_DEVICES, as the NVIDIA device plugin sets it):
// each binds half the allocation, and none is refused for the chunks'
// name. A pod given one GPU, whose chunks are another GPU's, binds them
// all.
func TestClusterModeRanksShareTheAllocation(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	n := newTestNode(t)
	root, kdir, sockDir, k, prs := n.root, n.kubelet, n.sock, n.k, n.prs
	a := spawnAgent(t, []string{"NODE_NAME=node-r", "KVPOOL_LOG_FORMAT=json"},
		"--simulate-gpus", "4", "--kubelet-dir", kdir, "--socket-dir", sockDir, "--state-dir", filepath.Join(root, "state"),
		"--pool-bytes", "512Mi", "--chunk-bytes", "32Mi", "--reserve-bytes", "64Mi", "--huge-pages", "never",
		"--metrics-address", "127.0.0.1:0", "--health-address", "127.0.0.1:0",
		"--reclaim-interval", "100ms", "--reclaim-grace-period", "1h", "--token-binding", "none")
	k.WaitRegister(20 * time.Second)
	k.WaitList(func(l []*pluginapi.Device) bool { return len(l) == 16 })
	waitReady(t, a)

	var gpu0 []string
	for _, l := range a.log.all("pool plan gpu") {
		if l["gpu"] == float64(0) {
			numa := int(l["numa"].(float64))
			for i := range 4 {
				gpu0 = append(gpu0, contract.ChunkID(0, numa, i))
			}
		}
	}
	resp, err := allocate(t, k, gpu0...)
	if err != nil {
		t.Fatal(err)
	}
	token := resp.Envs[contract.EnvToken]
	hostSock := filepath.Join(sockDir, contract.SocketFile)
	given := cudart.SimulatedUUID(3) + "," + cudart.SimulatedUUID(2)
	prs.SetPods(map[string]map[string][]string{"tp": {contract.DefaultResourceName: gpu0,
		"nvidia.com/gpu": {cudart.SimulatedUUID(3), cudart.SimulatedUUID(2)}}})
	env := []string{"KVPOOL_SOCKET=" + hostSock, "KVPOOL_TOKEN=" + token, cudart.EnvNVIDIAVisible + "=" + given}
	out, err := kvclient(t, env, "-all-ranks", "-ops", "200", "-max-pages", "-1")
	if err != nil {
		t.Fatalf("kvclient -all-ranks: %v\n%s", err, out)
	}
	// 16 KiB K and V pages: 32 KiB host pages, 1024 per chunk, 2 chunks a rank.
	for _, dev := range []string{cudart.SimulatedUUID(3), cudart.SimulatedUUID(2)} {
		re := regexp.MustCompile(`kvclient result" .*device=` + dev + ` .*capacity=2048 chunks=2 .*ranks=2 `)
		if !re.MatchString(out) {
			t.Errorf("no rank on %s with half the allocation:\n%s", dev, out)
		}
	}
	if !strings.Contains(out, "kvclient: all 2 ranks OK") {
		t.Errorf("kvclient -all-ranks did not report both ranks:\n%s", out)
	}

	// One GPU, GPU 1, with GPU 2's chunks: all of them.
	gpu2 := []string{strings.Replace(gpu0[0], "gpu0", "gpu2", 1), strings.Replace(gpu0[1], "gpu0", "gpu2", 1)}
	resp, err = allocate(t, k, gpu2...)
	if err != nil {
		t.Fatal(err)
	}
	prs.SetPods(map[string]map[string][]string{"tp": {contract.DefaultResourceName: gpu0, "nvidia.com/gpu": {cudart.SimulatedUUID(3), cudart.SimulatedUUID(2)}},
		"one": {contract.DefaultResourceName: gpu2, "nvidia.com/gpu": {cudart.SimulatedUUID(1)}}})
	env = []string{"KVPOOL_SOCKET=" + hostSock, "KVPOOL_TOKEN=" + resp.Envs[contract.EnvToken],
		cudart.EnvNVIDIAVisible + "=" + cudart.SimulatedUUID(1)}
	out, err = kvclient(t, env, "-ops", "100", "-max-pages", "-1")
	if err != nil || !regexp.MustCompile(`kvclient result" .*device=`+cudart.SimulatedUUID(1)+` .*capacity=2048 chunks=2 .*ranks=1 `).MatchString(out) {
		t.Fatalf("one-GPU pod on another GPU's chunks: %v\n%s", err, out)
	}
}
