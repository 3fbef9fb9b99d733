// Package server is the agent side of the kvpool copy API: it accepts
// clients on a SOCK_SEQPACKET Unix socket, opens their sessions on a
// pkg/pool Pool, passes them their chunks' file descriptors and serves every
// pool operation. It never touches KV bytes; clients copy them.
//
// Sessions outlive connections. A session is keyed by (allocation, GPU
// device: a GPU or one of its MIG instances) and owned by one client
// instance (a random ID the client process picks once):
//
//   - the same instance reconnecting from the same process (peer UID and
//     PID) resumes its session, streams and all; the instance ID presented
//     by another process counts as another instance;
//   - a different instance opening the same (allocation, device) while the owner
//     is disconnected replaces it: the old session closes and its pages go
//     back; while the owner is connected the newcomer gets StatusBusy;
//   - chunks return to the pool only when the allocation is revoked
//     (pool.Revoke), never because a socket closed.
//
// One connection's bad input gets an error reply, or closes that connection
// alone; nothing else is affected. Every per-tenant resource is bounded
// (Limits); a refusal is wire.StatusLimit with a message, counted by
// Hooks.Refused and logged at a bounded rate. Sessions whose allocation was
// revoked leave the table (and their connections close) within a second.
package server

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/poolerr"
	"github.com/kvpool/kvpool/pkg/unixsock"
	"github.com/kvpool/kvpool/pkg/wire"
)

// ChunkSource returns the memory of a chunk the pool knows by ID.
type ChunkSource func(id string) (*hostmem.Chunk, bool)

// Pool is the part of *pool.Pool the server uses: it opens sessions (by
// locality: pool.Near) and closes them; everything else is the pool
// session's.
type Pool interface {
	// ReplaceNear opens a session, in place of old (nil: none): a
	// refusal leaves old as it was.
	ReplaceNear(old *pool.Session, alloc string, spec pool.Spec, near pool.Near) (*pool.Session, error)
	Close(s *pool.Session)
	// StreamTotals is every session's streams and name bytes together,
	// for Limits.MaxStreams and MaxNameBytes.
	StreamTotals() (streams int, nameBytes int64)
}

var _ Pool = (*pool.Pool)(nil)

// Authorizer maps an allocation token (KVPOOL_TOKEN), presented by the
// client process peer (its credentials, for binding tokens to pods), to
// the allocation it names. It returns an error for unknown or revoked
// tokens, answered "unauthorized", and one wrapping poolerr.ErrNotReady
// while the allocation cannot be known yet, answered "unavailable, retry".
type Authorizer func(token string, peer unixsock.Peer) (allocation string, err error)

// StaticTokens is an Authorizer over a fixed map of token -> allocation,
// from any process.
func StaticTokens(m map[string]string) Authorizer {
	return func(token string, _ unixsock.Peer) (string, error) {
		if a, ok := m[token]; ok {
			return a, nil
		}
		return "", contract.ErrUnknownToken
	}
}

// Hooks observe the server, for metrics. Each may be nil; they must not block.
type Hooks struct {
	// Request is called after every request with what it did.
	Request func(Request)
	// Session is called when a session opens, resumes, is replaced or
	// closes, and when its client connects or disconnects.
	Session func(ev SessionEvent, info SessionInfo)
	// Refused is called for every refusal by a bound of Limits, a refused
	// token, an instance presented by a process that does not own it and
	// a temporary accept failure, with one of the Refused* reasons.
	Refused func(reason string)
}

// Request describes one answered request, for Hooks.Request.
type Request struct {
	Op     wire.Op
	Status wire.Status
	// Err is the failure as the client got it (a *RequestError); nil when
	// Status is StatusOK.
	Err        error
	Took       time.Duration // from receiving the packet to sending the reply
	GPU        int           // the session's GPU; -1 before a session is open
	Session    uint64        // the session's ID; 0 before a session is open
	Allocation string        // the session's allocation; "" before a session is open
	Pages      int           // host pages an offload took or a reload gave back
	Bytes      int64         // Pages times the session's host page size: what the client copies
	Full       bool          // an offload refused because the pool is full (its reply is ok=false)
}

// RequestError is a request the server refused, as the client got it:
// Message is the Error body's message. It unwraps to the error behind the
// status (a pool error, or nil), so errors.Is(err, poolerr.ErrPending) holds
// for a pending offload.
type RequestError struct {
	Op         wire.Op
	Status     wire.Status
	Message    string
	Session    uint64 // 0 before a session is open on the connection
	Allocation string // "" before a session is open on the connection
	Err        error
}

func (e *RequestError) Error() string { return e.Message }

// Kind is the status's kind (wire.Status.Kind), for metrics and the error
// ring.
func (e *RequestError) Kind() string { return e.Status.Kind() }

func (e *RequestError) Unwrap() error { return e.Err }

// ObserveRequests returns a Hooks.Request that reports each request to obs
// as an observe.Op: name, GPU, session, allocation, time, pages, bytes, and
// the error the client got (poolerr.ErrFull for an offload refused because
// the pool is full, which is flow control, not an error).
func ObserveRequests(obs observe.Observer) func(Request) {
	return func(r Request) {
		o := observe.Op{Name: r.Op.String(), GPU: r.GPU, Allocation: r.Allocation, Duration: r.Took,
			Pages: r.Pages, Bytes: r.Bytes, Err: r.Err}
		if r.Session != 0 && r.Err != nil {
			o.Session = strconv.FormatUint(r.Session, 10) // for the error ring only: no allocation per success
		}
		if r.Full && r.Err == nil {
			o.Err = poolerr.ErrFull
		}
		obs.Op(o)
	}
}

// SessionEvent names what happened to a session.
type SessionEvent string

const (
	SessionOpened       SessionEvent = "opened"
	SessionResumed      SessionEvent = "resumed"
	SessionReplaced     SessionEvent = "replaced" // a new instance reaped it
	SessionClosed       SessionEvent = "closed"   // the client closed it
	SessionDisconnected SessionEvent = "disconnected"
	SessionRevoked      SessionEvent = "revoked" // its allocation was revoked
)

// Options configure a Server.
type Options struct {
	Pool      Pool // a *pool.Pool
	Chunks    ChunkSource
	Authorize Authorizer
	Logger    *slog.Logger // default slog.Default()
	Hooks     Hooks
	Name      string // sent in HelloReply; default "kvpool-agent"
	// GPUs maps each GPU of the node's plan, by every UUID a client may
	// name it with ("GPU-...", and its MIG instances' "MIG-..."), to its
	// host index (NVML's), which is how the pool knows GPUs. An Open naming
	// a UUID not in it gets StatusUnknownGPU.
	GPUs map[string]int
	// GPUNUMA gives each host GPU's NUMA node; a GPU it lacks is on an
	// unknown node (-1). A session binds the chunks nearest its GPU.
	GPUNUMA map[int]int
	// Ranks, when set, says which GPUs run the ranks of the container that
	// holds an allocation, for the fair share of a new session (an Open
	// that declares its ranks overrides the count). It is called for each
	// Open outside the server's lock and may ask kubelet.
	Ranks func(alloc string) Ranks
	// Limits bound every per-tenant resource; zero fields take
	// DefaultLimits.
	Limits Limits
	// ProbePID is the PID of the agent's own process, whose connections
	// (its health probes) are counted against Limits.ProbeConns, never
	// against the tenants' bounds. 0: none is set apart (embedders whose
	// clients share the server's process).
	ProbePID int
	// EvictAfter is how old a connection without a session must be before
	// a new connection may take its place at a connection bound of Limits
	// (time for a client to say hello and open): connections that never
	// open a session cannot keep out one that does. Default
	// DefaultEvictAfter; negative: never (a full bound refuses).
	EvictAfter time.Duration
	// SweepInterval is how often sessions of revoked allocations are
	// dropped; default 1s.
	SweepInterval time.Duration
	// PollAfterReply is how long each connection polls for the next
	// request after a reply before its thread sleeps
	// (wire.Conn.SetSpin); 0: never.
	PollAfterReply time.Duration
	// Journal, when set, records every session change before its answer
	// is sent (internal/books), so that sessions survive an agent restart.
	Journal Journal
	// Durable, when set, says whether a change recorded now would survive
	// an agent restart (nil) or not, and why (the keeper is lost). While
	// it does not, every request that would change a session (offload,
	// reload, discard, remove_request, close, an open of a new session)
	// is answered StatusUnavailable ("retry") with that reason and changes
	// nothing; reads, resumes and resent requests whose answer is kept
	// are served. It is called under the server's lock: it must not block.
	Durable func() error
}

// DefaultEvictAfter is Options.EvictAfter's default.
const DefaultEvictAfter = 100 * time.Millisecond

// Server serves the copy API. Create it with New.
type Server struct {
	o        Options
	log      *slog.Logger
	lim      Limits
	rlog     *rateLog
	refusing atomic.Int32 // connections being refused now
	// lastRefusal is the last connection refused at a connection bound
	// (Refusing).
	lastRefusal atomic.Pointer[refusal]

	mu       sync.Mutex
	sessions map[key]*entry
	conns    map[*conn]struct{}
	closing  bool // Serve is shutting down
	counts   connCounts
	notReady atomic.Bool

	wg sync.WaitGroup
}

// Ranks are the ranks (one per GPU) of the container that holds an
// allocation.
type Ranks struct {
	Count int   // ranks sharing the allocation; 0: not known (pool.Near's default)
	GPUs  []int // the host GPU of each rank when known (len Count), else nil
}

// key names a session: its allocation and its GPU device, as the client
// named it (deviceKey), so that two MIG instances of one GPU are two
// sessions.
type key struct {
	alloc  string
	device string
}

// gpuCount is the number of GPUs Options.GPUs names (some by several
// names).
func (s *Server) gpuCount() int {
	seen := map[int]bool{}
	for _, g := range s.o.GPUs {
		seen[g] = true
	}
	return len(seen)
}

// deviceKey is a GPU UUID without its "GPU-" or "MIG-" prefix, lower case:
// the CUDA driver's UUID of a MIG instance, formatted as a GPU's, and
// NVML's "MIG-" name of it are one device.
func deviceKey(uuid string) string {
	u := strings.ToLower(uuid)
	if rest, ok := strings.CutPrefix(u, "gpu-"); ok {
		return rest
	}
	if rest, ok := strings.CutPrefix(u, "mig-"); ok {
		return rest
	}
	return u
}

// entry is a session as the server tracks it across connections.
type entry struct {
	id       uint64
	key      key
	instance string // the whole ID, compared on resume; never logged
	short    string // ShortID(instance)
	ps       *pool.Session
	regions  int // of the layout it was opened with, compared on resume with the pool session's Spec
	opened   time.Time
	conn     *conn // nil while disconnected; guarded by Server.mu
	peer     unixsock.Peer
	lastSeen time.Time
	uuid     string
	gpu      int // host index of the GPU

	opMu   sync.Mutex // held from a change to its record in the journal
	last   lastReply  // the answer to the last changing request
	fenced uint64     // the highest fence journaled; guarded by the connection serving it

	// more is the rest of the session's last long reply, for OpMore. It
	// lives on the session, not the connection, so that a client whose
	// connection dropped mid-reply resumes and fetches the rest.
	moreMu  sync.Mutex
	more    moreReply
	hasMore atomic.Bool
}

// moreReply is a long reply being fetched: every host page (or label, or
// chunk whose memfd an open passes) of it, the first part included; a
// client asks for them from an offset.
type moreReply struct {
	op     wire.Op
	pages  []int32
	labels []string
	chunks []string // OpOpen: the chunks granted, in the reply's order
	// grants are an open's chunks as its reply names them, kept where the
	// reply named only the first (OpenReply.chunk_count): More names the
	// rest beside their fds.
	grants []*wire.ChunkGrant
}

// SessionInfo describes a session for listings and hooks.
type SessionInfo struct {
	ID         uint64
	Allocation string
	GPU        int    // host index of the session's GPU
	GPUUUID    string // as the client named it
	// Locality is where the session's chunks lie relative to its GPU;
	// ChunkNUMA is each bound chunk's NUMA node, in page order.
	Locality  pool.Locality
	ChunkNUMA []int
	Instance  string // ShortID of the instance: never the whole ID
	Connected bool
	Peer      unixsock.Peer // of the current or last connection
	PageSize  int64
	Opened    time.Time
	LastSeen  time.Time // last disconnect; zero while connected
	Usage     pool.Usage
}

// New checks o and returns a server.
func New(o Options) (*Server, error) {
	if o.Pool == nil || o.Chunks == nil || o.Authorize == nil {
		return nil, errors.New("server: Options need Pool, Chunks and Authorize")
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Name == "" {
		o.Name = "kvpool-agent"
	}
	if o.PollAfterReply < 0 || o.PollAfterReply > wire.SpinLimit {
		return nil, fmt.Errorf("server: PollAfterReply %v outside [0, %v]", o.PollAfterReply, wire.SpinLimit)
	}
	if o.SweepInterval <= 0 {
		o.SweepInterval = time.Second
	}
	if o.EvictAfter == 0 {
		o.EvictAfter = DefaultEvictAfter
	}
	s := &Server{o: o, log: o.Logger, lim: o.Limits.withDefaults(), sessions: make(map[key]*entry), conns: make(map[*conn]struct{}),
		counts: connCounts{uid: map[uint32]int{}, pid: map[int32]int{}}}
	s.rlog = newRateLog(o.Logger, 10, 1)
	return s, nil
}

// Listen creates the socket at path with a unixpacket listener
// (unixsock.Listen): its directory is created when missing and a stale
// socket file left by an earlier agent is replaced; a live one is refused.
// The socket is made world-writable: the allocation token, not file
// permissions, authorizes a client.
func Listen(path string) (*net.UnixListener, error) {
	l, err := unixsock.Listen(path, 0o666)
	if err != nil {
		return nil, fmt.Errorf("server: %w", err)
	}
	return l, nil
}

// Serve accepts connections on l until ctx ends, then closes l and every
// connection and waits for their goroutines. Sessions survive: a later Serve
// on a new listener (the same Server) lets clients resume.
//
// A temporary accept error (out of file descriptors or memory, an aborted
// connection) is logged, at a bounded rate, and retried after a backoff of
// 5 ms doubling to 1 s; any other ends Serve with that error, logged, for
// the caller to exit on.
func (s *Server) Serve(ctx context.Context, l *net.UnixListener) error {
	sweepCtx, endSweep := context.WithCancel(ctx)
	s.wg.Go(func() { s.sweepLoop(sweepCtx) })
	err := unixsock.Acceptor{
		// Admission runs in the accept loop, not in the connection's
		// goroutine: a burst of connections beyond the bounds is closed
		// as fast as it is accepted and piles up neither fds nor
		// goroutines.
		Admit: s.admit,
		Retry: func(err error, wait time.Duration) {
			s.refused(RefusedAcceptTemporary, unixsock.Peer{}, "accept failed; retrying", "err", err, "retryIn", wait)
		},
		Stop: func() {
			s.mu.Lock()
			s.closing = true
			for c := range s.conns {
				c.wc.Close()
			}
			s.mu.Unlock()
		},
	}.Serve(ctx, l)
	if err != nil {
		err = fmt.Errorf("server: %w", err)
		s.log.Error("socket server stopped", "err", err)
	}
	endSweep()
	s.wg.Wait()
	s.mu.Lock()
	s.closing = false
	s.mu.Unlock()
	return err
}

// ServeConn serves one already connected unixpacket connection until it
// closes. Serve calls it for every accepted connection; tests and embedders
// with a socketpair may call it directly.
//
// Admission comes first, from the peer's credentials alone: a connection
// over a bound of Limits costs no buffer and no slot; its first request is
// answered with StatusLimit and it is closed.
func (s *Server) ServeConn(uc *net.UnixConn) {
	if run := s.admit(uc); run != nil {
		run()
	}
}

// admit decides what becomes of a new connection from its peer's
// credentials and returns the work that serves or refuses it, or nil when
// it has closed it already: the server is closing, or maxRefusers
// connections are being refused at once.
func (s *Server) admit(uc *net.UnixConn) func() {
	peer, err := unixsock.PeerOf(uc)
	if err != nil {
		s.rlog.Log(slog.LevelWarn, "peercred", "peer credentials unavailable", "err", err)
	}
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		uc.Close()
		return nil
	}
	if reason, msg := s.admitLocked(peer); reason != "" {
		s.mu.Unlock()
		s.refused(reason, peer, "connection refused: "+msg)
		if s.refusing.Add(1) > maxRefusers {
			s.refusing.Add(-1)
			uc.Close()
			return nil
		}
		return func() {
			defer s.refusing.Add(-1)
			s.refuseConn(uc, msg)
		}
	}
	c := s.newConn(uc, peer)
	s.conns[c] = struct{}{}
	s.mu.Unlock()
	return c.serve
}

// sweepLoop drops the sessions of revoked allocations every SweepInterval
// until ctx ends, and flushes the counts of suppressed log lines.
func (s *Server) sweepLoop(ctx context.Context) {
	t := time.NewTicker(s.o.SweepInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.Sweep()
			s.rlog.Flush()
		}
	}
}

// Sweep drops from the table every session whose pool session was closed
// behind the server's back (its allocation was revoked), so that nothing of
// it stays in memory, and closes the connection that served it: that
// client's next call reconnects and learns that its token is gone.
func (s *Server) Sweep() {
	var gone []SessionInfo
	s.mu.Lock()
	for k, e := range s.sessions {
		if !e.ps.Closed() {
			continue
		}
		gone = append(gone, e.infoLocked())
		delete(s.sessions, k)
		if e.conn != nil {
			e.conn.wc.Close()
		}
	}
	s.mu.Unlock()
	for _, info := range gone {
		s.hookSession(SessionRevoked, info)
	}
}

// Sessions lists every session the server tracks, ordered by ID. Sessions
// whose allocation was revoked are dropped from the table as a side effect.
func (s *Server) Sessions() []SessionInfo {
	s.mu.Lock()
	var out []SessionInfo
	for k, e := range s.sessions {
		if e.ps.Closed() {
			delete(s.sessions, k)
			continue
		}
		out = append(out, e.infoLocked())
	}
	s.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

func (e *entry) infoLocked() SessionInfo {
	info := SessionInfo{
		ID: e.id, Allocation: e.key.alloc, GPU: e.gpu, GPUUUID: e.uuid, Instance: e.short,
		Connected: e.conn != nil, Peer: e.peer, PageSize: e.ps.Spec().PageSize,
		Opened: e.opened, LastSeen: e.lastSeen, Usage: e.ps.Usage(), Locality: e.ps.Locality(),
	}
	for _, ch := range e.ps.Chunks() {
		info.ChunkNUMA = append(info.ChunkNUMA, ch.NUMA)
	}
	return info
}

func (s *Server) hookSession(ev SessionEvent, info SessionInfo) {
	attrs := []any{"session", info.ID, "allocation", info.Allocation, "gpu", info.GPU,
		"instance", info.Instance, "pid", info.Peer.PID, "uid", info.Peer.UID}
	if ev == SessionOpened {
		l := info.Locality
		attrs = append(attrs, "gpuNUMA", l.GPUNUMA, "ranks", l.Ranks, "chunks", len(info.ChunkNUMA),
			"local", l.Local, "remote", l.Remote, "unknownNUMA", l.Unknown)
	}
	s.log.Info("session "+string(ev), attrs...)
	if ev == SessionOpened && info.Locality.CrossNUMA() {
		// Once per session: a resume or reconnect does not say it again.
		s.log.Warn("session bound chunks on another NUMA node than its GPU: its copies cross the socket interconnect",
			"session", info.ID, "allocation", info.Allocation, "gpu", info.GPU, "gpuNUMA", info.Locality.GPUNUMA,
			"chunkNUMA", info.ChunkNUMA, "remote", info.Locality.Remote, "of", len(info.ChunkNUMA))
	}
	if s.o.Hooks.Session != nil {
		s.o.Hooks.Session(ev, info)
	}
}

var connIDs atomic.Uint64

func instanceString(b []byte) string { return hex.EncodeToString(b) }
