package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// Deep copies, written by hand: the types are few and small.

// DeepCopyInto copies in into out.
func (in *KVPoolNode) DeepCopyInto(out *KVPoolNode) {
	*out = *in
	out.TypeMeta = in.TypeMeta
	in.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	in.Status.DeepCopyInto(&out.Status)
}

// DeepCopy returns a deep copy.
func (in *KVPoolNode) DeepCopy() *KVPoolNode {
	if in == nil {
		return nil
	}
	out := new(KVPoolNode)
	in.DeepCopyInto(out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *KVPoolNode) DeepCopyObject() runtime.Object {
	if c := in.DeepCopy(); c != nil {
		return c
	}
	return nil
}

// DeepCopyInto copies in into out.
func (in *KVPoolNodeList) DeepCopyInto(out *KVPoolNodeList) {
	*out = *in
	out.TypeMeta = in.TypeMeta
	in.ListMeta.DeepCopyInto(&out.ListMeta)
	if in.Items != nil {
		out.Items = make([]KVPoolNode, len(in.Items))
		for i := range in.Items {
			in.Items[i].DeepCopyInto(&out.Items[i])
		}
	}
}

// DeepCopy returns a deep copy.
func (in *KVPoolNodeList) DeepCopy() *KVPoolNodeList {
	if in == nil {
		return nil
	}
	out := new(KVPoolNodeList)
	in.DeepCopyInto(out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *KVPoolNodeList) DeepCopyObject() runtime.Object {
	if c := in.DeepCopy(); c != nil {
		return c
	}
	return nil
}

// DeepCopyInto copies in into out.
func (in *KVPoolNodeStatus) DeepCopyInto(out *KVPoolNodeStatus) {
	*out = *in
	out.Capacity = in.Capacity.DeepCopy()
	out.Ready = in.Ready.DeepCopy()
	out.Allocated = in.Allocated.DeepCopy()
	out.Used = in.Used.DeepCopy()
	if in.GPUs != nil {
		out.GPUs = make([]GPUPool, len(in.GPUs))
		for i := range in.GPUs {
			in.GPUs[i].DeepCopyInto(&out.GPUs[i])
		}
	}
	if in.Conditions != nil {
		out.Conditions = make([]metav1.Condition, len(in.Conditions))
		for i := range in.Conditions {
			in.Conditions[i].DeepCopyInto(&out.Conditions[i])
		}
	}
	if in.Restart != nil {
		out.Restart = new(RestartStatus)
		*out.Restart = *in.Restart
	}
	in.LastUpdateTime.DeepCopyInto(&out.LastUpdateTime)
}

// DeepCopy returns a deep copy.
func (in *KVPoolNodeStatus) DeepCopy() *KVPoolNodeStatus {
	if in == nil {
		return nil
	}
	out := new(KVPoolNodeStatus)
	in.DeepCopyInto(out)
	return out
}

// DeepCopyInto copies in into out.
func (in *GPUPool) DeepCopyInto(out *GPUPool) {
	*out = *in
	out.Capacity = in.Capacity.DeepCopy()
	out.Ready = in.Ready.DeepCopy()
	out.Allocated = in.Allocated.DeepCopy()
	out.Used = in.Used.DeepCopy()
}

// DeepCopy returns a deep copy.
func (in *GPUPool) DeepCopy() *GPUPool {
	if in == nil {
		return nil
	}
	out := new(GPUPool)
	in.DeepCopyInto(out)
	return out
}
