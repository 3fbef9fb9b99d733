package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kvpool/kvpool/hack/e2e/tools/gpuplugin"
)

// The locality scenario's node: four simulated GPUs, each with four chunks
// of the pool.
const (
	localityGPUs   = 4
	localityChunks = 16
)

// gpuPod is a pod as an inference engine's deployment writes it: GPUs from
// the NVIDIA device plugin and host KV chunks from kvpool's, in limits.
func (c *cluster) gpuPod(name string, gpus, chunks int64, script string) *corev1.Pod {
	p := c.podSpec(name, []string{"sh", "-c", script}, chunks, resourceName)
	q := *resource.NewQuantity(gpus, resource.DecimalSI)
	r := &p.Spec.Containers[0].Resources
	r.Limits[gpuplugin.ResourceName], r.Requests[gpuplugin.ResourceName] = q, q
	return p
}

// engineScript runs kvclient the way an engine runs: on the GPUs the
// container was given (NVIDIA_VISIBLE_DEVICES, set by the GPU plugin), one
// process per GPU, each asking for its fair share of the pod's host KV.
const engineScript = `set -u
fail() { echo "FAIL: $*" >/dev/termination-log; exit 1; }
[ -n "${NVIDIA_VISIBLE_DEVICES:-}" ] || fail "NVIDIA_VISIBLE_DEVICES is not set"
[ -n "${KVPOOL_TOKEN:-}" ] || fail "KVPOOL_TOKEN is not set"
out=$(/kvclient -all-ranks -ops 300 -max-pages -1 2>&1); rc=$?
printf 'visible=%s\n%s\n' "$NVIDIA_VISIBLE_DEVICES" "$(echo "$out" | grep -e 'kvclient result' -e 'kvclient chunks' -e 'kvclient:' -e 'FAIL' -e 'error')" | tail -c 3800 >/dev/termination-log
exit $rc`

var chunksLine = regexp.MustCompile(`kvclient chunks" device=(\S+) ids=(\S+)`)

var resultLine = regexp.MustCompile(`kvclient result.* device=(\S+) rank=(\d+) capacity=(\d+) chunks=(\d+) gpuNUMA=(-?\d+) local=(\d+) remote=(\d+) ranks=(\d+) `)

// rankResult is one rank's kvclient result line.
type rankResult struct {
	device                      string
	chunks, local, remote, rank int
	ranks                       int
	ids                         []string // the chunks it bound
}

// engineResults reads a finished engine pod's termination message: the
// GPUs it was given and each rank's result.
func engineResults(t *testing.T, msg string) (visible []string, ranks []rankResult) {
	t.Helper()
	bound := map[string][]string{}
	defer func() {
		for i := range ranks {
			ranks[i].ids = bound[ranks[i].device]
		}
	}()
	for _, line := range strings.Split(msg, "\n") {
		if v, ok := strings.CutPrefix(line, "visible="); ok {
			visible = strings.Split(v, ",")
		}
		if m := chunksLine.FindStringSubmatch(line); m != nil {
			bound[m[1]] = strings.Split(m[2], ",")
		}
		if m := resultLine.FindStringSubmatch(line); m != nil {
			n := func(i int) int { v, _ := strconv.Atoi(m[i]); return v }
			ranks = append(ranks, rankResult{device: m[1], rank: n(2), chunks: n(4), local: n(6), remote: n(7), ranks: n(8)})
		}
	}
	return visible, ranks
}

// runEngines creates the pods at once, waits for all of them and checks
// each: it succeeded (every byte verified), ran one rank per GPU it was
// given, on that GPU, each rank with chunks of the pod's host KV and none
// on another NUMA node. It returns the GPUs each pod was given.
func (c *cluster) runEngines(t *testing.T, pods []*corev1.Pod, chunksPerRank int) map[string][]string {
	t.Helper()
	for _, p := range pods {
		c.createPod(t, p)
	}
	given := map[string][]string{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, p := range pods {
		wg.Go(func() {
			got := c.waitPod(t, p.Name, 180*time.Second, corev1.PodSucceeded, corev1.PodFailed)
			msg := terminationMessage(got)
			if got.Status.Phase != corev1.PodSucceeded {
				t.Errorf("%s: %s\n%s", p.Name, describePod(got), msg)
				return
			}
			visible, ranks := engineResults(t, msg)
			if len(visible) == 0 || len(ranks) != len(visible) {
				t.Errorf("%s: given GPUs %v, %d rank results:\n%s", p.Name, visible, len(ranks), msg)
				return
			}
			for _, r := range ranks {
				if len(r.ids) != r.chunks {
					t.Errorf("%s: rank %d names %d chunks (%v), holds %d", p.Name, r.rank, len(r.ids), r.ids, r.chunks)
				}
				foreign := 0
				for _, id := range r.ids {
					if !strings.HasPrefix(id, gpuOfUUID(r.device)+"-") {
						foreign++
					}
				}
				t.Logf("%s: rank %d on %s bound %v (%d sized under another GPU's name)", p.Name, r.rank, r.device, r.ids, foreign)
				if r.device != visible[r.rank] || r.chunks != chunksPerRank || r.remote != 0 || r.ranks != len(visible) {
					t.Errorf("%s: rank %d on %s (given %v) holds %d chunks (%d local, %d remote), shared among %d ranks; want %d chunks, %d ranks, none remote",
						p.Name, r.rank, r.device, visible, r.chunks, r.local, r.remote, r.ranks, chunksPerRank, len(visible))
				}
			}
			mu.Lock()
			given[p.Name] = visible
			mu.Unlock()
			t.Logf("%s said:\n%s", p.Name, msg)
		})
	}
	wg.Wait()
	return given
}

// TestGPULocality is the example pod of docs/device-plugin.md on a node as a
// real GPU node runs it: the NVIDIA device plugin's stand-in (gpuplugin)
// advertises four GPUs as nvidia.com/gpu beside kvpool's chunks, kubelet
// runs the Topology Manager (single-numa-node, pod scope), and each pod's
// client takes the GPU the container was given, never one chosen to suit
// the chunks.
//
//   - Four pods of nvidia.com/gpu: 1 and kvpool.io/host-kv: 4 at once, one
//     on every GPU: each binds its four chunks, whatever GPU's share kubelet
//     took them from, and verifies every byte.
//   - Two pods of nvidia.com/gpu: 2 and kvpool.io/host-kv: 8 at once: each
//     runs one process per GPU, and each rank binds four chunks, its fair
//     share, the agent counting the container's GPUs through PodResources.
func TestGPULocality(t *testing.T) {
	c := newCluster(t)
	if c.KVClient == "" {
		t.Skip("cmd/kvclient is not in this tree")
	}
	c.waitNodeReady(t, 90*time.Second)
	kubeletCfg, err := os.ReadFile(filepath.Join(c.Run, "kubelet", "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"topologyManagerPolicy: single-numa-node", "topologyManagerScope: pod"} {
		if !strings.Contains(string(kubeletCfg), want) {
			t.Fatalf("the e2e kubelet's configuration lacks %q", want)
		}
	}
	c.installCRDs(t, filepath.Join(c.Repo, "config", "crd"))
	a := c.startAgentWith(t, "locality-agent", fmt.Sprintf("--simulate-gpus %d --resource-name %s --kubelet-dir {kubelet}"+
		" --socket-dir {run}/locality-agent/sock --state-dir {run}/locality-agent/state --pool-bytes %d"+
		" --reclaim-grace-period %s --reclaim-interval %s", localityGPUs, resourceName, localityChunks*chunkBytes, gracePeriod, reconcile))
	gpus := plannedGPUs(t, a)
	if len(gpus) != localityGPUs {
		t.Fatalf("the agent planned %d GPUs (%v), want %d", len(gpus), gpus, localityGPUs)
	}
	p, err := gpuplugin.Start(context.Background(), filepath.Join(c.KubeletDir, "device-plugins"), gpus)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)
	c.waitCapacity(t, a, localityChunks, 60*time.Second)
	eventually(t, 60*time.Second, "node allocatable nvidia.com/gpu", func() (bool, string, error) {
		n, err := c.cs.CoreV1().Nodes().Get(ctx(t), c.Node, metav1.GetOptions{})
		if err != nil {
			return false, "", err
		}
		q := n.Status.Allocatable[gpuplugin.ResourceName]
		return q.Value() == localityGPUs, fmt.Sprintf("allocatable %d", q.Value()), nil
	})

	t.Run("one-GPU pods on every GPU", func(t *testing.T) {
		var pods []*corev1.Pod
		for i := range localityGPUs {
			pods = append(pods, c.gpuPod(fmt.Sprintf("engine-1gpu-%d", i), 1, localityChunks/localityGPUs, engineScript))
		}
		given := c.runEngines(t, pods, localityChunks/localityGPUs)
		seen := map[string]bool{}
		for _, v := range given {
			seen[v[0]] = true
		}
		if len(seen) != localityGPUs {
			t.Errorf("the pods were given GPUs %v: not every GPU", given)
		}
	})

	t.Run("two-GPU pods, one rank per GPU", func(t *testing.T) {
		var pods []*corev1.Pod
		for i := range localityGPUs / 2 {
			pods = append(pods, c.gpuPod(fmt.Sprintf("engine-2gpu-%d", i), 2, localityChunks/2, engineScript))
		}
		given := c.runEngines(t, pods, localityChunks/localityGPUs)
		var all []string
		for _, v := range given {
			all = append(all, v...)
		}
		slices.Sort(all)
		if len(slices.Compact(all)) != localityGPUs {
			t.Errorf("the pods were given GPUs %v", given)
		}
	})
}

// gpuOfUUID is the chunk ID prefix of a simulated GPU's share,
// "gpu<i>" for GPU-sim-<i>.
func gpuOfUUID(uuid string) string {
	n, err := strconv.Atoi(strings.TrimPrefix(uuid, "GPU-sim-"))
	if err != nil {
		return "?"
	}
	return "gpu" + strconv.Itoa(n)
}

// plannedGPUs reads the agent's plan from its log: each GPU's UUID and the
// NUMA node of its share ("pool plan gpu" lines).
func plannedGPUs(t *testing.T, a *agent) []gpuplugin.GPU {
	t.Helper()
	re := regexp.MustCompile(`msg="pool plan gpu" gpu=(\d+) uuid=(\S+) numa=(-?\d+)`)
	var out []gpuplugin.GPU
	eventually(t, 30*time.Second, "the agent's plan in its log", func() (bool, string, error) {
		data, err := os.ReadFile(a.log)
		if err != nil {
			return false, "", err
		}
		out = nil
		for _, m := range re.FindAllStringSubmatch(string(data), -1) {
			numa, _ := strconv.Atoi(m[3])
			out = append(out, gpuplugin.GPU{UUID: m[2], NUMA: numa})
		}
		return len(out) > 0, fmt.Sprintf("%d GPUs", len(out)), nil
	})
	return out
}
