package v1alpha1_test

import (
	"testing"

	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/kvpool/kvpool/api/v1alpha1"
)

func scheme() *runtime.Scheme {
	s := runtime.NewScheme()
	if err := v1alpha1.AddToScheme(s); err != nil {
		panic(err)
	}
	return s
}

func TestDeepCopyIsDeep(t *testing.T) {
	in := full()
	out := in.DeepCopy()
	if !equality.Semantic.DeepEqual(in, out) {
		t.Fatal("copy differs")
	}
	out.Status.GPUs[0].Ready = resource.MustParse("1Gi")
	out.Status.Conditions[0].Reason = "Changed"
	out.Labels = map[string]string{"x": "y"}
	if !equality.Semantic.DeepEqual(in, full()) {
		t.Fatal("mutating the copy changed the original")
	}
	list := &v1alpha1.KVPoolNodeList{Items: []v1alpha1.KVPoolNode{*full()}}
	lc := list.DeepCopyObject().(*v1alpha1.KVPoolNodeList)
	lc.Items[0].Status.GPUs[0].Index = 7
	if list.Items[0].Status.GPUs[0].Index != 1 {
		t.Fatal("list copy shares items")
	}
	var nilNode *v1alpha1.KVPoolNode
	if nilNode.DeepCopy() != nil {
		t.Fatal("nil copy")
	}
}
