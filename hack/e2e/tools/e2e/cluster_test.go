// Package e2e drives kvpool on a real single-node Kubernetes: the node that
// hack/e2e/run.sh starts from host processes (etcd, kube-apiserver,
// containerd, kubelet). Without that node (KVPOOL_E2E_RUN and KUBECONFIG
// unset) every test skips and says how to run it.
package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

const (
	namespace = "default"
	// image is imported by run.sh: /pause, busybox as /bin/sh and friends,
	// and /kvclient when cmd/kvclient exists.
	image = "kvpool.local/e2e:dev"
)

// env is what run.sh (via cluster.sh env) hands the test.
type env struct {
	Run        string // run directory of the node
	Node       string // node name
	KubeletDir string // kubelet --root-dir
	Ctl        string // cluster.sh, for restart-kubelet
	Repo       string // repository root
	Agent      string // agent binary
	KVClient   string // kvclient binary, "" when the tree has none
}

type cluster struct {
	env
	cs  kubernetes.Interface
	cfg *rest.Config
}

// newCluster connects to the e2e node or skips the test with the reason.
func newCluster(t *testing.T) *cluster {
	t.Helper()
	e := env{
		Run:        os.Getenv("KVPOOL_E2E_RUN"),
		Node:       os.Getenv("KVPOOL_E2E_NODE"),
		KubeletDir: os.Getenv("KVPOOL_E2E_KUBELET_DIR"),
		Ctl:        os.Getenv("KVPOOL_E2E_CTL"),
		Repo:       os.Getenv("KVPOOL_E2E_REPO"),
		Agent:      os.Getenv("KVPOOL_E2E_AGENT"),
		KVClient:   os.Getenv("KVPOOL_E2E_KVCLIENT"),
	}
	kubeconfig := os.Getenv("KUBECONFIG")
	if e.Run == "" || kubeconfig == "" || e.Node == "" {
		t.Skip("no e2e node: KVPOOL_E2E_RUN, KVPOOL_E2E_NODE and KUBECONFIG are unset; run hack/e2e/run.sh, which starts a real node and runs these tests")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatalf("kubeconfig %s: %v", kubeconfig, err)
	}
	cfg.QPS, cfg.Burst = 50, 100
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatalf("client: %v", err)
	}
	return &cluster{env: e, cs: cs, cfg: cfg}
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return c
}

// eventually polls cond every 250 ms until it reports done, fails on its
// error, or fails after timeout with the last status it described.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() (done bool, status string, err error)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	last := ""
	for {
		done, status, err := cond()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if done {
			return
		}
		if status != last {
			t.Logf("%s: %s", what, status)
			last = status
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not done after %v; last status: %s", what, timeout, last)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func (c *cluster) waitNodeReady(t *testing.T, timeout time.Duration) *corev1.Node {
	t.Helper()
	var node *corev1.Node
	eventually(t, timeout, "node "+c.Node+" Ready", func() (bool, string, error) {
		n, err := c.cs.CoreV1().Nodes().Get(ctx(t), c.Node, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return false, "not registered yet", nil
		}
		if err != nil {
			return false, "", err
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				node = n
				return cond.Status == corev1.ConditionTrue, fmt.Sprintf("Ready=%s %s: %s", cond.Status, cond.Reason, cond.Message), nil
			}
		}
		return false, "no Ready condition", nil
	})
	return node
}

// podSpec is a pod pinned to the e2e node (there is no scheduler) that never
// pulls and mounts no service account token (there is no controller-manager).
func (c *cluster) podSpec(name string, command []string, units int64, resourceName string) *corev1.Pod {
	no := false
	grace := int64(1)
	ctr := corev1.Container{
		Name:                     "main",
		Image:                    image,
		ImagePullPolicy:          corev1.PullNever,
		Command:                  command,
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
	}
	if units > 0 {
		q := *resource.NewQuantity(units, resource.DecimalSI)
		ctr.Resources = corev1.ResourceRequirements{
			Limits:   corev1.ResourceList{corev1.ResourceName(resourceName): q},
			Requests: corev1.ResourceList{corev1.ResourceName(resourceName): q},
		}
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, Labels: map[string]string{"app": "kvpool-e2e"}},
		Spec: corev1.PodSpec{
			NodeName:                      c.Node,
			RestartPolicy:                 corev1.RestartPolicyNever,
			AutomountServiceAccountToken:  &no,
			TerminationGracePeriodSeconds: &grace,
			Tolerations:                   []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
			Containers:                    []corev1.Container{ctr},
		},
	}
}

// createPod creates the pod and deletes it (and waits for it to go) when the
// test ends.
func (c *cluster) createPod(t *testing.T, pod *corev1.Pod) {
	t.Helper()
	if _, err := c.cs.CoreV1().Pods(namespace).Create(ctx(t), pod, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod %s: %v", pod.Name, err)
	}
	t.Cleanup(func() { c.deletePod(t, pod.Name) })
}

func (c *cluster) deletePod(t *testing.T, name string) {
	t.Helper()
	zero := int64(0)
	err := c.cs.CoreV1().Pods(namespace).Delete(context.Background(), name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	if apierrors.IsNotFound(err) {
		return
	}
	if err != nil {
		t.Errorf("delete pod %s: %v", name, err)
		return
	}
	eventually(t, 60*time.Second, "pod "+name+" gone", func() (bool, string, error) {
		_, err := c.cs.CoreV1().Pods(namespace).Get(context.Background(), name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, "", nil
		}
		return false, "still present", err
	})
}

// waitPod waits until the pod reaches one of the phases and returns it.
func (c *cluster) waitPod(t *testing.T, name string, timeout time.Duration, phases ...corev1.PodPhase) *corev1.Pod {
	t.Helper()
	var got *corev1.Pod
	eventually(t, timeout, "pod "+name+" phase in "+fmt.Sprint(phases), func() (bool, string, error) {
		p, err := c.cs.CoreV1().Pods(namespace).Get(ctx(t), name, metav1.GetOptions{})
		if err != nil {
			return false, "", err
		}
		got = p
		for _, ph := range phases {
			if p.Status.Phase == ph {
				return true, "", nil
			}
		}
		return false, describePod(p), nil
	})
	return got
}

func describePod(p *corev1.Pod) string {
	s := fmt.Sprintf("phase=%s reason=%q message=%q", p.Status.Phase, p.Status.Reason, p.Status.Message)
	for _, cs := range p.Status.ContainerStatuses {
		switch {
		case cs.State.Waiting != nil:
			s += fmt.Sprintf(" %s: waiting %s %s", cs.Name, cs.State.Waiting.Reason, cs.State.Waiting.Message)
		case cs.State.Running != nil:
			s += fmt.Sprintf(" %s: running", cs.Name)
		case cs.State.Terminated != nil:
			s += fmt.Sprintf(" %s: exit %d %s", cs.Name, cs.State.Terminated.ExitCode, cs.State.Terminated.Reason)
		}
	}
	return s
}

// terminationMessage is what the container wrote to /dev/termination-log,
// or the tail of its log when it failed without writing one.
func terminationMessage(p *corev1.Pod) string {
	for _, cs := range p.Status.ContainerStatuses {
		if cs.State.Terminated != nil {
			return strings.TrimSpace(cs.State.Terminated.Message)
		}
	}
	return ""
}

// TestNodeReady: the kubelet registered the node and it went Ready, with
// the container runtime and the CNI network up.
func TestNodeReady(t *testing.T) {
	c := newCluster(t)
	n := c.waitNodeReady(t, 90*time.Second)
	t.Logf("node %s Ready: kubelet %s, runtime %s, kernel %s", n.Name,
		n.Status.NodeInfo.KubeletVersion, n.Status.NodeInfo.ContainerRuntimeVersion, n.Status.NodeInfo.KernelVersion)
}

// TestPausePodRuns: a pod runs in a real sandbox from the imported image,
// a second one runs to completion and its output reaches the API.
func TestPausePodRuns(t *testing.T) {
	c := newCluster(t)
	c.waitNodeReady(t, 90*time.Second)

	c.createPod(t, c.podSpec("pause", []string{"/pause"}, 0, ""))
	p := c.waitPod(t, "pause", 90*time.Second, corev1.PodRunning, corev1.PodFailed, corev1.PodSucceeded)
	if p.Status.Phase != corev1.PodRunning {
		t.Fatalf("pause pod: %s", describePod(p))
	}
	t.Logf("pause pod running, pod IP %s", p.Status.PodIP)

	c.createPod(t, c.podSpec("hello", []string{"sh", "-c", `echo "hello from $(cat /proc/sys/kernel/hostname)" >/dev/termination-log`}, 0, ""))
	p = c.waitPod(t, "hello", 90*time.Second, corev1.PodSucceeded, corev1.PodFailed)
	if p.Status.Phase != corev1.PodSucceeded {
		t.Fatalf("hello pod: %s: %s", describePod(p), terminationMessage(p))
	}
	if got, want := terminationMessage(p), "hello from hello"; got != want {
		t.Fatalf("hello pod said %q, want %q", got, want)
	}
}

// kubectl-free helper used by scenarios that restart the kubelet.
func (c *cluster) ctl(t *testing.T, args ...string) {
	t.Helper()
	cmd := exec.Command(c.Ctl, args...)
	out, err := cmd.CombinedOutput()
	t.Logf("cluster.sh %s:\n%s", strings.Join(args, " "), out)
	if err != nil {
		t.Fatalf("cluster.sh %s: %v", strings.Join(args, " "), err)
	}
}
