// Package kubenode reads the agent's Node object: the memory kubelet lets
// pods use (allocatable), which bounds the pool in a cluster.
package kubenode

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Memory is the Node's memory as kubelet reports it, in bytes.
type Memory struct {
	Capacity    int64
	Allocatable int64
	// HugePages maps a page size in bytes to the allocatable bytes of
	// that size (resource hugepages-2Mi, hugepages-1Gi).
	HugePages map[int64]int64
}

// EnvNodeName is the variable the DaemonSet sets from spec.nodeName
// through the downward API.
const EnvNodeName = "NODE_NAME"

// ErrNoNodeName means the agent does not know which Node it runs on.
var ErrNoNodeName = errors.New("kubenode: node name unknown: set " + EnvNodeName + " from the downward API (fieldRef spec.nodeName)")

// NodeName returns $NODE_NAME, or ErrNoNodeName.
func NodeName() (string, error) {
	if n := os.Getenv(EnvNodeName); n != "" {
		return n, nil
	}
	return "", ErrNoNodeName
}

// Read gets Node name through cs and returns its memory.
func Read(ctx context.Context, cs kubernetes.Interface, name string) (Memory, error) {
	if name == "" {
		return Memory{}, ErrNoNodeName
	}
	n, err := cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return Memory{}, fmt.Errorf("kubenode: node %q not found (is %s the node's name?): %w", name, EnvNodeName, err)
	case apierrors.IsForbidden(err):
		return Memory{}, fmt.Errorf("kubenode: not allowed to get node %q (the agent's ClusterRole needs get on nodes): %w", name, err)
	case err != nil:
		return Memory{}, fmt.Errorf("kubenode: get node %q: %w", name, err)
	}
	return FromNode(n)
}

// FromNode reads the memory figures out of a Node object.
func FromNode(n *corev1.Node) (Memory, error) {
	alloc, ok := n.Status.Allocatable[corev1.ResourceMemory]
	if !ok {
		return Memory{}, fmt.Errorf("kubenode: node %q reports no allocatable memory (kubelet not ready?)", n.Name)
	}
	m := Memory{Allocatable: alloc.Value(), HugePages: map[int64]int64{}}
	if c, ok := n.Status.Capacity[corev1.ResourceMemory]; ok {
		m.Capacity = c.Value()
	}
	for name, q := range n.Status.Allocatable {
		if size, err := hugePageSize(name); err == nil {
			m.HugePages[size] = q.Value()
		}
	}
	if m.Allocatable < 0 {
		return Memory{}, fmt.Errorf("kubenode: node %q reports negative allocatable memory %d", n.Name, m.Allocatable)
	}
	return m, nil
}

func hugePageSize(name corev1.ResourceName) (int64, error) {
	s, ok := strings.CutPrefix(string(name), corev1.ResourceHugePagesPrefix)
	if !ok {
		return 0, errors.New("not a huge page resource")
	}
	q, err := resource.ParseQuantity(s)
	if err != nil || q.Value() <= 0 {
		return 0, fmt.Errorf("bad huge page size %q", s)
	}
	return q.Value(), nil
}
