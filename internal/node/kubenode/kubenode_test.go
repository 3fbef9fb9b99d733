package kubenode

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

func node(name string, capacity, alloc corev1.ResourceList) *corev1.Node {
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Status:     corev1.NodeStatus{Capacity: capacity, Allocatable: alloc},
	}
}

func q(s string) resource.Quantity { return resource.MustParse(s) }

func TestRead(t *testing.T) {
	cs := fake.NewClientset(
		node("gpu-1", corev1.ResourceList{corev1.ResourceMemory: q("2Ti")},
			corev1.ResourceList{corev1.ResourceMemory: q("2000Gi"), "hugepages-2Mi": q("1Gi"), "hugepages-1Gi": q("16Gi"), corev1.ResourceCPU: q("96")}),
		node("cpu-1", corev1.ResourceList{corev1.ResourceMemory: q("64Gi")}, corev1.ResourceList{corev1.ResourceMemory: q("62Gi")}),
	)
	got, err := Read(context.Background(), cs, "gpu-1")
	if err != nil {
		t.Fatal(err)
	}
	want := Memory{Capacity: 2 << 40, Allocatable: 2000 << 30, HugePages: map[int64]int64{2 << 20: 1 << 30, 1 << 30: 16 << 30}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Read = %+v, want %+v", got, want)
	}
}

func TestReadErrors(t *testing.T) {
	noMem := fake.NewClientset(node("n", nil, corev1.ResourceList{corev1.ResourceCPU: q("4")}))
	forbidden := fake.NewClientset()
	forbidden.PrependReactor("get", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(corev1.Resource("nodes"), "n", errors.New("rbac"))
	})
	broken := fake.NewClientset()
	broken.PrependReactor("get", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("connection refused")
	})
	cases := []struct {
		name string
		cs   *fake.Clientset
		node string
		want string
	}{
		{"no name", fake.NewClientset(), "", "set NODE_NAME"},
		{"missing", fake.NewClientset(), "ghost", `node "ghost" not found`},
		{"forbidden", forbidden, "n", "ClusterRole needs get on nodes"},
		{"api down", broken, "n", "connection refused"},
		{"no allocatable memory", noMem, "n", "reports no allocatable memory"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Read(context.Background(), c.cs, c.node)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %v, want one containing %q", err, c.want)
			}
		})
	}
}

func TestNodeName(t *testing.T) {
	t.Setenv(EnvNodeName, "")
	if _, err := NodeName(); !errors.Is(err, ErrNoNodeName) {
		t.Errorf("err %v", err)
	}
	t.Setenv(EnvNodeName, "gpu-7")
	if n, err := NodeName(); n != "gpu-7" || err != nil {
		t.Errorf("NodeName = %q, %v", n, err)
	}
}
