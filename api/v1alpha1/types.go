// Package v1alpha1 holds the kvpool.io/v1alpha1 API types: KVPoolNode, the
// per-node status object the agent writes so that `kubectl get kvpoolnodes`
// shows each node's host KV pool.
//
// The deep copies (zz_generated.deepcopy.go) and the CRD
// (config/crd, copied to charts/kvpool/crds) are generated from these types
// by controller-gen: run hack/gen-api.sh after changing them.
//
// +kubebuilder:object:generate=true
// +groupName=kvpool.io
package v1alpha1

//go:generate ../../hack/gen-api.sh

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// GroupVersion is the API group and version of these types.
var GroupVersion = schema.GroupVersion{Group: "kvpool.io", Version: "v1alpha1"}

var (
	// SchemeBuilder registers the types with a scheme.
	SchemeBuilder = runtime.NewSchemeBuilder(addKnownTypes)
	// AddToScheme adds the types to a scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)

func addKnownTypes(s *runtime.Scheme) error {
	s.AddKnownTypes(GroupVersion, &KVPoolNode{}, &KVPoolNodeList{})
	metav1.AddToGroupVersion(s, GroupVersion)
	return nil
}

// Health values of KVPoolNodeStatus.
const (
	HealthStarting  = "Starting"  // chunks are still being allocated, nothing ready yet
	HealthHealthy   = "Healthy"   // ready: chunks, socket and (in cluster mode) kubelet registration
	HealthDegraded  = "Degraded"  // ready, but some chunk or GPU is unhealthy
	HealthUnhealthy = "Unhealthy" // not serving
)

// Condition types of KVPoolNodeStatus.
const (
	// ConditionReady mirrors the agent's readiness probe.
	ConditionReady = "Ready"
	// ConditionPoolComplete is true once every planned chunk is ready.
	ConditionPoolComplete = "PoolComplete"
	// ConditionPoolKept (with a keeper) is true while the keeper holds the
	// pool and its books, so that an agent restart keeps every session;
	// false, reason KeeperLost, while it is lost. Reason PoolLostAtStart
	// (still true) says that the keeper had lost an earlier agent's pool.
	ConditionPoolKept = "PoolKept"
)

// KVPoolNode is the status of one node's host KV pool. It is cluster scoped,
// named after the node, owned by the Node object, and written only by the
// agent on that node.
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:scope=Cluster,shortName=kvpn,categories=kvpool
// +kubebuilder:subresource:status
// +kubebuilder:printcolumn:name="Capacity",type=string,JSONPath=`.status.capacity`,description="Memory planned for the node's pools"
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.ready`,description="Memory allocated, pinned and ready"
// +kubebuilder:printcolumn:name="Allocated",type=string,JSONPath=`.status.allocated`,description="Memory granted to pods"
// +kubebuilder:printcolumn:name="Used",type=string,JSONPath=`.status.used`,description="Memory holding offloaded streams",priority=1
// +kubebuilder:printcolumn:name="Sessions",type=integer,JSONPath=`.status.sessions`,priority=1
// +kubebuilder:printcolumn:name="Health",type=string,JSONPath=`.status.health`
// +kubebuilder:printcolumn:name="Heartbeat",type=date,JSONPath=`.status.lastUpdateTime`,description="Time since the agent last wrote this status; it rewrites it every 10s, so over 30s means no agent is running"
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type KVPoolNode struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Status KVPoolNodeStatus `json:"status,omitempty"`
}

// KVPoolNodeList is a list of KVPoolNode.
//
// +kubebuilder:object:root=true
type KVPoolNodeList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []KVPoolNode `json:"items"`
}

// KVPoolNodeStatus is what the agent observed.
type KVPoolNodeStatus struct {
	// NodeName is the node the pool is on.
	NodeName string `json:"nodeName,omitempty"`
	// ResourceName is the extended resource the chunks are advertised as.
	ResourceName string `json:"resourceName,omitempty"`
	// Mode is the front door pods get host KV through: devicePlugin (the
	// extended resource, from a kubelet device plugin) or dra (ResourceSlices
	// of DRADriver; ResourceName through its DeviceClass).
	// +optional
	Mode string `json:"mode,omitempty"`
	// DRADriver is the DRA driver's name (mode dra).
	// +optional
	DRADriver string `json:"draDriver,omitempty"`
	// AgentVersion is the version of the agent that wrote this status.
	AgentVersion string `json:"agentVersion,omitempty"`

	// Capacity is the memory sizing planned for the node's pools.
	Capacity resource.Quantity `json:"capacity"`
	// Ready is the memory of chunks allocated, pinned and held by the pools.
	Ready resource.Quantity `json:"ready"`
	// Allocated is the memory of chunks granted to pods.
	Allocated resource.Quantity `json:"allocated"`
	// Used is the memory of host pages holding offloaded streams.
	Used resource.Quantity `json:"used"`

	// Chunks counts the node's chunks by state.
	Chunks ChunkCounts `json:"chunks"`
	// Sessions is the number of open client sessions.
	// +kubebuilder:validation:Minimum=0
	Sessions int32 `json:"sessions"`

	// Health is Starting, Healthy, Degraded or Unhealthy.
	// +kubebuilder:validation:Enum=Starting;Healthy;Degraded;Unhealthy
	Health string `json:"health"`
	// Message says why Health is not Healthy.
	Message string `json:"message,omitempty"`

	// GPUs lists each GPU's pool.
	// +listType=map
	// +listMapKey=index
	GPUs []GPUPool `json:"gpus,omitempty"`

	// Conditions are the standard conditions (Ready, PoolComplete).
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`

	// Restart says what the running agent took over from the keeper when
	// it started; absent without a keeper.
	Restart *RestartStatus `json:"restart,omitempty"`

	// Claims are the ResourceClaims the DRA driver has prepared on this
	// node (mode dra, or left from it), sorted by namespace and name.
	// +optional
	// +listType=atomic
	Claims []PreparedClaim `json:"claims,omitempty"`

	// LastUpdateTime is when the agent last wrote this status: its
	// heartbeat. The agent rewrites the status at least every 10 seconds;
	// one older than 30 seconds is from an agent that is not running, and
	// its Health no longer describes the node. On a graceful stop the agent
	// writes a final status (Unhealthy, Ready False, reason AgentStopped).
	LastUpdateTime metav1.Time `json:"lastUpdateTime,omitempty"`
}

// PreparedClaim is a ResourceClaim the DRA driver prepared: its chunks
// are granted to it, one token per request.
type PreparedClaim struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid"`
	// Requests is how many of the claim's requests the driver prepared.
	Requests int32 `json:"requests"`
	// Chunks and Bytes are the host KV the claim holds.
	Chunks int32             `json:"chunks"`
	Bytes  resource.Quantity `json:"bytes"`
	// GPUs are the indexes of the GPUs whose chunks it holds.
	// +optional
	// +listType=atomic
	GPUs []int32 `json:"gpus,omitempty"`
}

// RestartStatus is what an agent took over from the keeper at start.
type RestartStatus struct {
	// AdoptedChunks is how many chunks the agent adopted: the previous
	// agent's memory, not pinned again.
	// +kubebuilder:validation:Minimum=0
	AdoptedChunks int32 `json:"adoptedChunks"`
	// FreshChunks is how many chunks the agent allocated and pinned itself.
	// +kubebuilder:validation:Minimum=0
	FreshChunks int32 `json:"freshChunks"`
	// LastGapMilliseconds is how long the pool went unserved before this
	// agent served: from the previous agent's last sign of life (0 on a
	// first start).
	// +kubebuilder:validation:Minimum=0
	LastGapMilliseconds int64 `json:"lastGapMilliseconds"`
	// KeeperConnected says whether the keeper holds the pool and its books
	// now. While it does not, changes to sessions are refused (clients
	// retry) and the agent reconnects to the keeper.
	KeeperConnected bool `json:"keeperConnected"`
	// KeeperLockedChunks is how many chunks' lock the keeper holds: the
	// agent hands it each chunk's lock once the chunk is in the pool, then
	// unmaps the chunk, so that a restart does not wait for the kernel to
	// unmap the pool. Below adoptedChunks plus freshChunks while the hand-over
	// runs, or for good where the keeper cannot lock (no IPC_LOCK).
	// +kubebuilder:validation:Minimum=0
	// +optional
	KeeperLockedChunks int32 `json:"keeperLockedChunks,omitempty"`
	// KeeperLosses counts the keeper connections this agent lost.
	// +kubebuilder:validation:Minimum=0
	// +optional
	KeeperLosses int32 `json:"keeperLosses,omitempty"`
	// PoolLost says that at this agent's start the keeper held none of the
	// pool an earlier agent had kept in it: that pool's sessions and
	// streams are gone.
	// +optional
	PoolLost bool `json:"poolLost,omitempty"`
}

// ChunkCounts counts chunks by state.
type ChunkCounts struct {
	// Free chunks are scrubbed and unallocated.
	// +kubebuilder:validation:Minimum=0
	Free int32 `json:"free"`
	// Granted chunks are held by pods.
	// +kubebuilder:validation:Minimum=0
	Granted int32 `json:"granted"`
	// Dirty chunks were released and await scrubbing.
	// +kubebuilder:validation:Minimum=0
	Dirty int32 `json:"dirty"`
	// Unhealthy chunks are reported unhealthy to kubelet.
	// +kubebuilder:validation:Minimum=0
	Unhealthy int32 `json:"unhealthy,omitempty"`
}

// GPUPool is one GPU's pool.
type GPUPool struct {
	// Index is the GPU's index on the node.
	// +kubebuilder:validation:Minimum=0
	Index int32 `json:"index"`
	// NUMANode is the NUMA node of the pool's memory, -1 when unknown.
	// +kubebuilder:validation:Minimum=-1
	NUMANode int32 `json:"numaNode"`
	// Capacity is the memory planned for this GPU.
	Capacity resource.Quantity `json:"capacity"`
	// Ready is the memory of this GPU's ready chunks.
	Ready resource.Quantity `json:"ready"`
	// Allocated is the memory of this GPU's chunks granted to pods.
	Allocated resource.Quantity `json:"allocated"`
	// Used is the memory of host pages holding streams of sessions serving this GPU.
	Used resource.Quantity `json:"used"`
	// Chunks counts this GPU's chunks by state.
	Chunks ChunkCounts `json:"chunks"`
	// Healthy is false while the GPU is reported unhealthy.
	Healthy bool `json:"healthy"`
}
