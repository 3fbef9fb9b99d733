// Package nodestatus writes the node's KVPoolNode object: what the pool holds
// and whether it serves, for `kubectl get kvpoolnodes`.
package nodestatus

import (
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kvpool/kvpool/api/v1alpha1"
	"github.com/kvpool/kvpool/internal/report"
)

// Input is what Build turns into a status.
type Input struct {
	Snapshot     report.Snapshot
	Ready        bool   // the readiness probe passes
	Reason       string // why not, when it does not
	ResourceName string
	AgentVersion string
	// UnhealthyChunks counts chunks the device plugin reports unhealthy, by GPU.
	UnhealthyChunks map[int]int
	// UnhealthyGPUs names GPUs reported unhealthy.
	UnhealthyGPUs map[int]bool
	// Restart is what the agent took over from the keeper (nil: no keeper).
	Restart *report.Restart
	// Mode is the front door ("devicePlugin" or "dra"), DRADriver the DRA
	// driver's name, Claims the claims it prepared.
	Mode      string
	DRADriver string
	Claims    []report.Claim
}

func bytesQ(n int64) resource.Quantity { return *resource.NewQuantity(n, resource.BinarySI) }

// Build makes the status for node. Conditions carry no transition times;
// the Writer sets them against the object's previous conditions.
func Build(node string, in Input) v1alpha1.KVPoolNodeStatus {
	tot := in.Snapshot.Totals()
	st := v1alpha1.KVPoolNodeStatus{
		NodeName:     node,
		ResourceName: in.ResourceName,
		AgentVersion: in.AgentVersion,
		Capacity:     bytesQ(max(tot.TargetBytes, tot.ReadyBytes)),
		Ready:        bytesQ(tot.ReadyBytes),
		Allocated:    bytesQ(tot.AllocatedBytes),
		Used:         bytesQ(tot.UsedBytes),
		Sessions:     int32(tot.Sessions),
	}
	st.Mode, st.DRADriver = in.Mode, in.DRADriver
	for _, c := range in.Claims {
		pc := v1alpha1.PreparedClaim{Namespace: c.Namespace, Name: c.Name, UID: c.UID,
			Requests: int32(len(c.Requests)), Chunks: int32(c.Chunks), Bytes: bytesQ(c.Bytes)}
		for _, g := range c.GPUs {
			pc.GPUs = append(pc.GPUs, int32(g))
		}
		st.Claims = append(st.Claims, pc)
	}
	if r := in.Restart; r != nil {
		st.Restart = &v1alpha1.RestartStatus{AdoptedChunks: int32(r.AdoptedChunks), FreshChunks: int32(r.FreshChunks),
			LastGapMilliseconds: int64(r.LastGapSeconds * 1000), KeeperConnected: r.KeeperConnected,
			KeeperLockedChunks: int32(r.KeeperLockedChunks), KeeperLosses: int32(r.KeeperLosses), PoolLost: r.PoolLost}
	}
	var sick []string
	for _, g := range in.Snapshot.GPUs {
		p := v1alpha1.GPUPool{
			Index: int32(g.Index), NUMANode: int32(g.NUMA),
			Capacity:  bytesQ(max(g.TargetBytes, g.ReadyBytes)),
			Ready:     bytesQ(g.ReadyBytes),
			Allocated: bytesQ(g.AllocatedBytes),
			Used:      bytesQ(g.UsedBytes),
			Chunks: v1alpha1.ChunkCounts{
				Free: int32(g.Chunks.Free), Granted: int32(g.Chunks.Granted), Dirty: int32(g.Chunks.Dirty),
				Unhealthy: int32(in.UnhealthyChunks[g.Index]),
			},
			Healthy: !in.UnhealthyGPUs[g.Index],
		}
		st.Chunks.Free += p.Chunks.Free
		st.Chunks.Granted += p.Chunks.Granted
		st.Chunks.Dirty += p.Chunks.Dirty
		st.Chunks.Unhealthy += p.Chunks.Unhealthy
		if !p.Healthy {
			sick = append(sick, fmt.Sprintf("GPU %d unhealthy", g.Index))
		} else if p.Chunks.Unhealthy > 0 {
			sick = append(sick, fmt.Sprintf("GPU %d: %d chunks unhealthy", g.Index, p.Chunks.Unhealthy))
		}
		st.GPUs = append(st.GPUs, p)
	}

	switch {
	case in.Ready && len(sick) == 0:
		st.Health = v1alpha1.HealthHealthy
	case in.Ready:
		st.Health, st.Message = v1alpha1.HealthDegraded, strings.Join(sick, "; ")
	case tot.ReadyBytes == 0:
		st.Health, st.Message = v1alpha1.HealthStarting, in.Reason
	default:
		st.Health, st.Message = v1alpha1.HealthUnhealthy, in.Reason
	}

	ready := metav1.Condition{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: "ChecksPassed", Message: "chunks, socket and registration checks pass"}
	if !in.Ready {
		ready.Status, ready.Reason, ready.Message = metav1.ConditionFalse, "ChecksFailing", in.Reason
	}
	complete := metav1.Condition{Type: v1alpha1.ConditionPoolComplete, Status: metav1.ConditionTrue, Reason: "AllChunksReady",
		Message: fmt.Sprintf("%s of %s ready", st.Ready.String(), st.Capacity.String())}
	if tot.ReadyBytes < tot.TargetBytes {
		complete.Status, complete.Reason = metav1.ConditionFalse, "Allocating"
	}
	st.Conditions = []metav1.Condition{ready, complete}
	if r := in.Restart; r != nil {
		st.Conditions = append(st.Conditions, keptCondition(r))
	}
	return st
}

// keptCondition is PoolKept: whether the keeper holds the pool.
func keptCondition(r *report.Restart) metav1.Condition {
	c := metav1.Condition{Type: v1alpha1.ConditionPoolKept, Status: metav1.ConditionTrue, Reason: "KeeperHoldsPool",
		Message: "the keeper holds the pool and its books: an agent restart keeps every session"}
	switch {
	case !r.KeeperConnected:
		c.Status, c.Reason = metav1.ConditionFalse, "KeeperLost"
		c.Message = fmt.Sprintf("the keeper is lost (%s): changes are refused, clients retry; the agent holds the pool and reconnects", r.KeeperError)
	case r.PoolLost:
		c.Reason = "PoolLostAtStart"
		c.Message = fmt.Sprintf("the keeper holds the pool, but at this agent's start it had lost an earlier agent's pool (%d chunks, about %d sessions): those sessions and streams are gone", r.LostChunks, r.LostSessions)
	}
	return c
}
