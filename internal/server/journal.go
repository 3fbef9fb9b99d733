package server

import (
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/unixsock"
	"github.com/kvpool/kvpool/pkg/wire"
)

// Journal makes the server's session changes durable (internal/books keeps
// them in a memfd that outlives the agent). The server calls Session after
// a request changed a session and before it answers; an error means the
// change may not survive a restart, so the request is answered
// StatusInternal and the connection closed.
type Journal interface {
	Session(op SessionOp) error
}

// SessionOp is one change of a session, with the answer the client gets
// (so that a client resending an unanswered request after an agent
// restart gets the same answer).
type SessionOp struct {
	Session uint64
	Op      wire.Op
	Seq     uint32
	Fence   uint64 // the header's fence, applied before the op (0: none)
	Rid     string
	Label   string
	Meta    pool.Meta
	Pages   []int32 // offload: host pages taken; reload: host pages released
	Ticket  uint64  // reload
	// Reply is the encoded reply body; Status its status. Empty Reply and
	// StatusOK for ops without a body. Nil Reply and Op 0 for a record
	// that carries only a fence.
	Status wire.Status
	Reply  []byte
	Open   *OpenInfo // OpOpen
}

// OpenInfo is a session as it was opened.
type OpenInfo struct {
	Replaces   uint64 // the session of another instance it replaced (0: none)
	Allocation string
	Instance   string            // hex
	UUID       string            // the GPU's, as the client named it
	Peer       unixsock.Peer     // the client process that opened it (resumes need the same)
	Regions    int               // of the layout it was opened with; its geometry is Image.Spec
	Image      pool.SessionImage // as opened: no streams
}

// LastReply is the answer to a session's last changing request.
type LastReply struct {
	Seq    uint32
	Op     wire.Op
	Status wire.Status
	Body   []byte
	// Pages is every host page of a reply longer than one packet (nil
	// otherwise), for OpMore after a resend.
	Pages []int32
}

// RestoredSession is a session the books kept, for Restore.
type RestoredSession struct {
	Session  *pool.Session // restored by pool.Restore
	Instance string
	UUID     string
	Peer     unixsock.Peer
	Regions  int // of the layout it was opened with; its geometry is Session.Spec()
	Last     LastReply
}

// lastReply is an entry's replay cache.
type lastReply struct {
	mu sync.Mutex
	LastReply
}

// Restore gives the server the sessions of a restored pool, disconnected,
// for their clients to resume. Call it before Serve.
func (s *Server) Restore(rs []RestoredSession) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range rs {
		ps := r.Session
		if ps == nil || ps.Closed() {
			return errors.New("server: restore: a closed or missing session")
		}
		k := key{alloc: ps.Allocation(), device: deviceKey(r.UUID)}
		if r.UUID == "" {
			k.device = "gpu " + strconv.Itoa(ps.Spec().GPU) // books of an agent that kept no UUID
		}
		if _, ok := s.sessions[k]; ok {
			return fmt.Errorf("server: restore: two sessions for allocation %s GPU %s", k.alloc, r.UUID)
		}
		e := &entry{id: ps.ID(), key: k, uuid: r.UUID, gpu: ps.Spec().GPU, instance: r.Instance, short: shortID(r.Instance), ps: ps,
			regions: r.Regions, peer: r.Peer, opened: time.Now(), lastSeen: time.Now()}
		e.last.LastReply = r.Last
		s.sessions[k] = e
	}
	return nil
}

// SetReady says whether the server answers requests (true), or refuses
// every hello with StatusUnavailable, "retry", while the agent restores
// its books (false). A new server is ready.
func (s *Server) SetReady(ready bool) { s.notReady.Store(!ready) }

// replayable says whether op changes a session and so has its answer kept.
func replayable(op wire.Op) bool {
	switch op {
	case wire.OpOffload, wire.OpReload, wire.OpDiscard, wire.OpRemoveRequest, wire.OpClose:
		return true
	}
	return false
}
