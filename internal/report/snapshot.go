// Package report takes consistent-enough snapshots of the agent's pool for the
// operator: per-GPU byte and page totals, the open sessions, and the recent
// errors. Metrics, the node status object and `agent status` all read it, so
// they agree on what each number means.
package report

import (
	"cmp"
	"slices"
	"time"

	"github.com/kvpool/kvpool/pkg/pool"
)

// Source is the part of *pool.Pool a snapshot reads.
type Source interface {
	Chunks() []pool.ChunkInfo
	Sessions(alloc string) []*pool.Session
}

// GPU is one GPU's pool.
type GPU struct {
	Index int `json:"gpu"`
	NUMA  int `json:"numa"` // NUMA node of its chunks; -1 when unknown or mixed

	// TargetBytes is what sizing planned for this GPU; 0 when no plan was given.
	TargetBytes int64 `json:"targetBytes,omitempty"`
	// ReadyBytes is the memory of every chunk the pool holds: allocated,
	// pinned and usable (free, granted to a pod, or waiting to be scrubbed).
	ReadyBytes int64 `json:"readyBytes"`
	// FreeBytes is the memory of scrubbed chunks no pod holds.
	FreeBytes int64 `json:"freeBytes"`
	// AllocatedBytes is the memory of chunks granted to pods.
	AllocatedBytes int64 `json:"allocatedBytes"`
	// DirtyBytes is the memory of chunks released by pods, not yet scrubbed.
	DirtyBytes int64 `json:"dirtyBytes"`
	// UsedBytes is the memory of host pages that hold streams, for sessions
	// that serve this GPU.
	UsedBytes int64 `json:"usedBytes"`

	Chunks   ChunkCounts `json:"chunks"`
	Sessions int         `json:"sessions"`
	// CrossNUMASessions counts the sessions serving this GPU that hold
	// chunks on another NUMA node than the GPU's; RemoteChunks those chunks.
	CrossNUMASessions int `json:"crossNumaSessions"`
	RemoteChunks      int `json:"remoteChunks"`
	Streams           int `json:"streams"`
	Requests          int `json:"requests"`
	PagesTotal        int `json:"pagesTotal"`   // pages of every open session
	PagesUsed         int `json:"pagesUsed"`    // held by streams
	PagesPending      int `json:"pagesPending"` // released by reloads, awaiting their fence
}

// ChunkCounts counts chunks by state.
type ChunkCounts struct {
	Free    int `json:"free"`
	Granted int `json:"granted"`
	Dirty   int `json:"dirty"`
	Bound   int `json:"bound"` // granted chunks bound to a session
}

// Total is the number of chunks in the pool.
func (c ChunkCounts) Total() int { return c.Free + c.Granted + c.Dirty }

// Session is one open session.
type Session struct {
	Allocation string `json:"allocation"`
	GPU        int    `json:"gpu"`
	// GPUNUMA is the NUMA node of the session's GPU (-1: unknown); of its
	// chunks, Local are on that node, Remote on another (their copies
	// cross the socket interconnect), UnknownNUMA where a node is unknown.
	GPUNUMA     int `json:"gpuNuma"`
	Local       int `json:"local"`
	Remote      int `json:"remote"`
	UnknownNUMA int `json:"unknownNuma"`
	// Ranks is how many ranks the allocation was shared among when the
	// session opened (0: not known, as after an agent restart).
	Ranks    int   `json:"ranks"`
	PageSize int64 `json:"pageSize"`
	Chunks   int   `json:"chunks"`
	Pages    int   `json:"pages"`
	Used     int   `json:"used"`
	Pending  int   `json:"pending"`
	Streams  int   `json:"streams"`
	Requests int   `json:"requests"`
}

// Snapshot is the pool at one moment. Each chunk and each session is read
// atomically; the whole is not (a session may close between the two reads),
// which is fine for monitoring.
type Snapshot struct {
	Time     time.Time `json:"time"`
	GPUs     []GPU     `json:"gpus"`
	Sessions []Session `json:"sessions"`
}

// Totals sums the per-GPU figures; Index and NUMA are -1.
func (s Snapshot) Totals() GPU {
	t := GPU{Index: -1, NUMA: -1}
	for _, g := range s.GPUs {
		t.TargetBytes += g.TargetBytes
		t.ReadyBytes += g.ReadyBytes
		t.FreeBytes += g.FreeBytes
		t.AllocatedBytes += g.AllocatedBytes
		t.DirtyBytes += g.DirtyBytes
		t.UsedBytes += g.UsedBytes
		t.Chunks.Free += g.Chunks.Free
		t.Chunks.Granted += g.Chunks.Granted
		t.Chunks.Dirty += g.Chunks.Dirty
		t.Chunks.Bound += g.Chunks.Bound
		t.Sessions += g.Sessions
		t.CrossNUMASessions += g.CrossNUMASessions
		t.RemoteChunks += g.RemoteChunks
		t.Streams += g.Streams
		t.Requests += g.Requests
		t.PagesTotal += g.PagesTotal
		t.PagesUsed += g.PagesUsed
		t.PagesPending += g.PagesPending
	}
	return t
}

// takeSessions lists the open sessions of allocs and adds them up into
// their GPUs (gpu returns a GPU's entry).
func takeSessions(src Source, allocs []string, gpu func(int) *GPU) []Session {
	var sessions []Session
	for _, a := range allocs {
		for _, s := range src.Sessions(a) {
			if s.Closed() {
				continue
			}
			u := s.Usage()
			spec := s.Spec()
			l := s.Locality()
			sessions = append(sessions, Session{
				Allocation: a, GPU: spec.GPU, PageSize: spec.PageSize,
				GPUNUMA: l.GPUNUMA, Local: l.Local, Remote: l.Remote, UnknownNUMA: l.Unknown, Ranks: l.Ranks,
				Chunks: len(s.Chunks()), Pages: u.Capacity, Used: u.Used, Pending: u.Pending,
				Streams: u.Streams, Requests: u.Requests,
			})
			g := gpu(spec.GPU)
			if l.CrossNUMA() {
				g.CrossNUMASessions++
				g.RemoteChunks += l.Remote
			}
			g.UsedBytes += int64(u.Used) * spec.PageSize
			g.Sessions++
			g.Streams += u.Streams
			g.Requests += u.Requests
			g.PagesTotal += u.Capacity
			g.PagesUsed += u.Used
			g.PagesPending += u.Pending
		}
	}
	return sessions
}

// Take reads src. targets, when not nil, gives the planned bytes per GPU; a
// GPU with a target but no chunk yet still appears, so that allocation
// progress shows from the first moment.
func Take(src Source, targets map[int]int64, now time.Time) Snapshot {
	byGPU := make(map[int]*GPU)
	gpu := func(i int) *GPU {
		g, ok := byGPU[i]
		if !ok {
			g = &GPU{Index: i, NUMA: -2}
			byGPU[i] = g
		}
		return g
	}
	for i, t := range targets {
		gpu(i).TargetBytes = t
	}
	var allocs []string
	seen := make(map[string]bool)
	for _, c := range src.Chunks() {
		g := gpu(c.GPU)
		switch {
		case g.NUMA == -2:
			g.NUMA = c.NUMA
		case g.NUMA != c.NUMA:
			g.NUMA = -1
		}
		g.ReadyBytes += c.Size
		switch c.State {
		case pool.ChunkFree:
			g.FreeBytes += c.Size
			g.Chunks.Free++
		case pool.ChunkGranted:
			g.AllocatedBytes += c.Size
			g.Chunks.Granted++
			if c.Bound {
				g.Chunks.Bound++
			}
		case pool.ChunkDirty:
			g.DirtyBytes += c.Size
			g.Chunks.Dirty++
		}
		if c.Allocation != "" && !seen[c.Allocation] {
			seen[c.Allocation] = true
			allocs = append(allocs, c.Allocation)
		}
	}
	sessions := takeSessions(src, allocs, gpu)
	snap := Snapshot{Time: now, GPUs: make([]GPU, 0, len(byGPU)), Sessions: sessions}
	for _, g := range byGPU {
		if g.NUMA == -2 {
			g.NUMA = -1
		}
		snap.GPUs = append(snap.GPUs, *g)
	}
	slices.SortFunc(snap.GPUs, func(a, b GPU) int { return cmp.Compare(a.Index, b.Index) })
	slices.SortFunc(snap.Sessions, func(a, b Session) int {
		return cmp.Or(cmp.Compare(a.Allocation, b.Allocation), cmp.Compare(a.GPU, b.GPU), cmp.Compare(a.PageSize, b.PageSize))
	})
	return snap
}
