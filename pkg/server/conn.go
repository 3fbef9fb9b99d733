package server

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/wire"
)

const (
	// MaxRegions bounds the regions of a layout.
	MaxRegions = 1024
	// PageAlign is the alignment of a host page: the sum of a layout's bytes
	// per page is rounded up to it.
	PageAlign = 256
	// MinInstanceID and MaxInstanceID bound a client instance ID, in bytes.
	MinInstanceID = 8
	MaxInstanceID = 64
	maxPageBytes  = 1 << 40
)

type layout struct {
	pageSize    int64
	devicePages int
	maxPages    int
	regions     int
}

// parseLayout checks an Open's regions and returns the session geometry.
func parseLayout(m *wire.Open) (layout, error) {
	if len(m.Regions) == 0 || len(m.Regions) > MaxRegions {
		return layout{}, fmt.Errorf("%d regions, want 1 to %d", len(m.Regions), MaxRegions)
	}
	var sum uint64
	dev := uint32(0)
	for i, r := range m.Regions {
		if r.BytesPerPage == 0 || r.BytesPerPage > maxPageBytes {
			return layout{}, fmt.Errorf("region %d: %d bytes per page, want 1 to %d", i, r.BytesPerPage, uint64(maxPageBytes))
		}
		if r.PageCount == 0 {
			return layout{}, fmt.Errorf("region %d: zero pages", i)
		}
		sum += r.BytesPerPage
		if sum > maxPageBytes {
			return layout{}, fmt.Errorf("host page of more than %d bytes", uint64(maxPageBytes))
		}
		if i == 0 || r.PageCount < dev {
			dev = r.PageCount
		}
	}
	if dev > 1<<31-2 {
		return layout{}, fmt.Errorf("%d device pages, at most %d", dev, 1<<31-2)
	}
	if m.MaxPages > 1<<31-2 {
		return layout{}, fmt.Errorf("max pages %d, at most %d", m.MaxPages, 1<<31-2)
	}
	ps := int64((sum + PageAlign - 1) / PageAlign * PageAlign)
	return layout{pageSize: ps, devicePages: int(dev), maxPages: int(m.MaxPages), regions: len(m.Regions)}, nil
}

// conn is one client connection.
type conn struct {
	s    *Server
	wc   *wire.Conn
	id   uint64
	peer Peer
	log  *slog.Logger

	hello bool
	e     *entry // the session this connection serves, nil before open

	in, out []byte
	pages   []int32

	// reused request and reply bodies of the hot path
	offload wire.Offload
	offRep  wire.OffloadReply
	reload  wire.Reload
	relRep  wire.ReloadReply
	stream  wire.Stream
	request wire.Request
	errBody wire.Error
	jop     SessionOp
}

func (s *Server) newConn(uc *net.UnixConn) *conn {
	c := &conn{s: s, wc: wire.NewConn(uc), id: connIDs.Add(1), in: make([]byte, wire.MaxMessage+1)}
	peer, err := peerCred(uc)
	if err != nil {
		s.log.Warn("peer credentials unavailable", "err", err)
	}
	c.peer = peer
	c.log = s.log.With("conn", c.id, "pid", peer.PID)
	return c
}

// reply is an operation's outcome: a body for StatusOK, or a status and an
// error for the Error body.
type reply struct {
	raw    []byte // a kept answer sent again: the body of a StatusOK reply
	change bool   // the op changed the session (journal it)
	pages  int    // host pages moved, for Hooks.Request
	full   bool   // offload refused: pool full
	st     wire.Status
	body   proto.Message
	err    error
	ticket uint64
	fds    []int
}

func fail(st wire.Status, err error) reply { return reply{st: st, err: err} }

func (c *conn) serve() {
	defer c.finish()
	for {
		pkt, files, err := c.wc.Recv(c.in)
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				c.log.Warn("closing connection", "err", err)
			}
			return
		}
		start := time.Now()
		h, body, err := wire.ParseHeader(pkt)
		if err != nil {
			closeFiles(files)
			c.log.Warn("closing connection: bad header", "err", err)
			return
		}
		var r reply
		switch {
		case len(files) > 0:
			closeFiles(files)
			r = fail(wire.StatusUnexpectedFDs, fmt.Errorf("%s request carried %d file descriptors; requests carry none", h.Op, len(files)))
		case h.Status != wire.StatusOK:
			r = fail(wire.StatusBadRequest, fmt.Errorf("request header has status %d; requests carry 0", h.Status))
		case !h.Op.Valid():
			r = fail(wire.StatusUnknownOp, fmt.Errorf("unknown op %d (protocol version %d)", uint8(h.Op), wire.Version))
		case !c.hello && h.Op != wire.OpHello:
			r = fail(wire.StatusVersion, fmt.Errorf("%s before hello; the first request must be hello", h.Op))
		case h.Op == wire.OpHello && c.s.notReady.Load():
			r = fail(wire.StatusUnavailable, errors.New("the agent is restoring its books after a restart; retry"))
		default:
			e := c.e
			if e != nil && c.s.o.Journal != nil {
				// A change and its record are one step: a half-open
				// connection of the same session cannot interleave.
				e.opMu.Lock()
			}
			r = c.handle(h, body)
			if e != nil && c.s.o.Journal != nil {
				err := c.journal(e, h, r)
				e.opMu.Unlock()
				if err != nil {
					c.log.Error("closing connection: the books cannot record a change", "op", h.Op, "err", err)
					c.send(h, fail(wire.StatusInternal, fmt.Errorf("the agent cannot record this change: %w", err)))
					return
				}
			}
		}
		if err := c.send(h, r); err != nil {
			c.log.Warn("closing connection: send reply", "op", h.Op, "err", err)
			return
		}
		if hk := c.s.o.Hooks.Request; hk != nil {
			req := Request{Op: h.Op, Status: r.st, Took: time.Since(start), GPU: -1, Pages: r.pages, Full: r.full}
			if c.e != nil {
				spec := c.e.ps.Spec()
				req.GPU, req.Bytes = spec.GPU, int64(r.pages)*spec.PageSize
			}
			hk(req)
		}
		if h.Op == wire.OpHello && r.st == wire.StatusVersion {
			return
		}
	}
}

func (c *conn) send(h wire.Header, r reply) error {
	if r.raw != nil {
		c.out = append(wire.AppendHeader(c.out[:0], wire.Header{Op: h.Op, Seq: h.Seq}), r.raw...)
		return c.wc.Send(c.out, nil)
	}
	var err error
	if c.out, err = c.encode(h, r); err != nil {
		return err
	}
	return c.wc.Send(c.out, r.fds)
}

// encode builds the reply packet in c.out.
func (c *conn) encode(h wire.Header, r reply) ([]byte, error) {
	body := r.body
	if r.st != wire.StatusOK {
		c.errBody.Reset()
		c.errBody.Message = r.err.Error()
		c.errBody.Ticket = r.ticket
		body = &c.errBody
	}
	var err error
	c.out, err = wire.AppendPacket(c.out[:0], wire.Header{Op: h.Op, Status: r.st, Seq: h.Seq}, body)
	if err != nil {
		// Only an enormous label list gets here; say so instead.
		c.errBody.Reset()
		c.errBody.Message = err.Error()
		c.out, err = wire.AppendPacket(c.out[:0], wire.Header{Op: h.Op, Status: wire.StatusInternal, Seq: h.Seq}, &c.errBody)
	}
	return c.out, err
}

// journal records what request h did to session e, with its answer,
// before the answer is sent. A request that changed nothing but carried a
// new fence is recorded as the fence alone.
func (c *conn) journal(e *entry, h wire.Header, r reply) error {
	change := r.change && r.st == wire.StatusOK && r.raw == nil
	if !change && (h.Fence == 0 || h.Fence <= e.fenced) {
		return nil
	}
	op := &c.jop
	*op = SessionOp{Session: e.id, Seq: h.Seq, Fence: h.Fence}
	if change {
		out, err := c.encode(h, r)
		if err != nil {
			return err
		}
		c.out = out
		op.Op, op.Status, op.Reply = h.Op, r.st, out[wire.HeaderSize:]
		switch h.Op {
		case wire.OpOffload:
			m := &c.offload
			op.Rid, op.Label, op.Pages = m.Rid, m.Label, c.offRep.HostPages
			op.Meta = pool.Meta{StoredLen: m.StoredLen, Position: m.Position, Released: m.Released}
		case wire.OpReload:
			op.Rid, op.Label, op.Pages, op.Ticket = c.reload.Rid, c.reload.Label, c.relRep.HostPages, c.relRep.Ticket
		case wire.OpDiscard:
			op.Rid, op.Label = c.stream.Rid, c.stream.Label
		case wire.OpRemoveRequest:
			op.Rid = c.request.Rid
		}
	}
	if err := c.s.o.Journal.Session(*op); err != nil {
		return err
	}
	if h.Fence > e.fenced {
		e.fenced = h.Fence
	}
	if change && replayable(h.Op) {
		e.last.mu.Lock()
		e.last.Seq, e.last.Op, e.last.Status = h.Seq, h.Op, r.st
		e.last.Body = append(e.last.Body[:0], op.Reply...)
		e.last.mu.Unlock()
	}
	return nil
}

// cached returns the kept answer when seq and op are those of the
// session's last changing request: the client resends a request whose
// answer it never got (the agent restarted in between).
func (e *entry) cached(seq uint32, op wire.Op) ([]byte, bool) {
	e.last.mu.Lock()
	defer e.last.mu.Unlock()
	if e.last.Op == 0 || e.last.Seq != seq || e.last.Op != op {
		return nil, false
	}
	return append([]byte{}, e.last.Body...), true
}

func closeFiles(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}

// finish detaches the connection from its session, which stays for the
// client to resume.
func (c *conn) finish() {
	c.wc.Close()
	s := c.s
	s.mu.Lock()
	delete(s.conns, c)
	var info SessionInfo
	detached := false
	if e := c.e; e != nil && e.conn == c {
		e.conn = nil
		e.lastSeen = time.Now()
		if !e.ps.Closed() {
			info, detached = e.infoLocked(), true
		}
	}
	s.mu.Unlock()
	if detached {
		s.hookSession(SessionDisconnected, info)
	}
}

func (c *conn) handle(h wire.Header, body []byte) reply {
	switch h.Op {
	case wire.OpHello:
		return c.handleHello(body)
	case wire.OpOpen:
		return c.handleOpen(body)
	}
	if c.e == nil {
		return fail(wire.StatusNoSession, fmt.Errorf("%s before a session was opened on this connection", h.Op))
	}
	ps := c.e.ps
	if h.Fence != 0 {
		if err := ps.Fence(h.Fence); err != nil {
			return errReply(err)
		}
	}
	if replayable(h.Op) {
		if body, ok := c.e.cached(h.Seq, h.Op); ok {
			return reply{raw: body}
		}
	}
	switch h.Op {
	case wire.OpOffload:
		m := &c.offload
		if err := wire.DecodeBody(body, m); err != nil {
			return fail(wire.StatusBadRequest, err)
		}
		var err error
		c.pages, err = ps.Offload(m.Rid, m.Label, m.GpuPages,
			pool.Meta{StoredLen: m.StoredLen, Position: m.Position, Released: m.Released}, c.pages[:0])
		rep := &c.offRep
		rep.Ok, rep.HostPages = err == nil, c.pages
		if errors.Is(err, pool.ErrFull) {
			rep.HostPages = rep.HostPages[:0]
			return reply{body: rep, full: true}
		}
		if err != nil {
			return errReply(err)
		}
		return reply{body: rep, pages: len(rep.HostPages), change: true}
	case wire.OpReload:
		m := &c.reload
		if err := wire.DecodeBody(body, m); err != nil {
			return fail(wire.StatusBadRequest, err)
		}
		rl, err := ps.Reload(m.Rid, m.Label, m.GpuPages, c.pages[:0])
		c.pages = rl.Pages
		if err != nil {
			return errReply(err)
		}
		rep := &c.relRep
		rep.HostPages, rep.StoredLen, rep.Position, rep.Released, rep.Ticket =
			rl.Pages, rl.Meta.StoredLen, rl.Meta.Position, rl.Meta.Released, rl.Ticket
		return reply{body: rep, pages: len(rl.Pages), change: true}
	case wire.OpDiscard:
		m := &c.stream
		if err := wire.DecodeBody(body, m); err != nil {
			return fail(wire.StatusBadRequest, err)
		}
		if err := ps.Discard(m.Rid, m.Label); err != nil {
			return errReply(err)
		}
		return reply{change: true}
	case wire.OpNumPages:
		m := &c.stream
		if err := wire.DecodeBody(body, m); err != nil {
			return fail(wire.StatusBadRequest, err)
		}
		n, err := ps.NumPages(m.Rid, m.Label)
		if err != nil {
			return errReply(err)
		}
		return reply{body: &wire.NumPagesReply{Pages: uint32(n)}}
	case wire.OpRemoveRequest, wire.OpIsOffloaded, wire.OpLabels:
		m := &c.request
		if err := wire.DecodeBody(body, m); err != nil {
			return fail(wire.StatusBadRequest, err)
		}
		switch h.Op {
		case wire.OpRemoveRequest:
			n, err := ps.RemoveRequest(m.Rid)
			if err != nil {
				return errReply(err)
			}
			return reply{body: &wire.RemoveRequestReply{Removed: uint32(n)}, change: n > 0}
		case wire.OpIsOffloaded:
			if ps.Closed() {
				return errReply(pool.ErrClosed)
			}
			return reply{body: &wire.IsOffloadedReply{Offloaded: ps.IsOffloaded(m.Rid)}}
		default:
			if ps.Closed() {
				return errReply(pool.ErrClosed)
			}
			return reply{body: &wire.LabelsReply{Labels: ps.Labels(m.Rid)}}
		}
	case wire.OpUsage, wire.OpFence, wire.OpClose:
		if err := wire.DecodeBody(body, nil); err != nil {
			return fail(wire.StatusBadRequest, err)
		}
		if ps.Closed() {
			return errReply(pool.ErrClosed)
		}
		switch h.Op {
		case wire.OpUsage:
			u := ps.Usage()
			return reply{body: &wire.UsageReply{Capacity: uint32(u.Capacity), Used: uint32(u.Used),
				Pending: uint32(u.Pending), Streams: uint32(u.Streams), Requests: uint32(u.Requests), Free: uint32(u.Free())}}
		case wire.OpClose:
			c.closeSession()
			return reply{change: true}
		}
		return reply{}
	}
	return fail(wire.StatusUnknownOp, fmt.Errorf("unknown op %d", uint8(h.Op)))
}

func (c *conn) handleHello(body []byte) reply {
	if c.hello {
		return fail(wire.StatusBadRequest, errors.New("hello sent twice"))
	}
	var m wire.Hello
	if err := wire.DecodeBody(body, &m); err != nil {
		return fail(wire.StatusBadRequest, err)
	}
	if m.Version < 1 {
		return fail(wire.StatusVersion, fmt.Errorf("client speaks version %d, server speaks %d", m.Version, wire.Version))
	}
	c.hello = true
	c.log = c.log.With("client", m.Client)
	return reply{body: &wire.HelloReply{Version: min(m.Version, wire.Version), Server: c.s.o.Name, MaxMessage: wire.MaxMessage}}
}

func (c *conn) handleOpen(body []byte) reply {
	if c.e != nil {
		return fail(wire.StatusBadRequest, errors.New("a session is already open on this connection"))
	}
	var m wire.Open
	if err := wire.DecodeBody(body, &m); err != nil {
		return fail(wire.StatusBadRequest, err)
	}
	if n := len(m.InstanceId); n < MinInstanceID || n > MaxInstanceID {
		return fail(wire.StatusBadRequest, fmt.Errorf("instance ID of %d bytes, want %d to %d", n, MinInstanceID, MaxInstanceID))
	}
	if m.Gpu > 1<<16 {
		return fail(wire.StatusBadRequest, fmt.Errorf("GPU ordinal %d out of range", m.Gpu))
	}
	lay, err := parseLayout(&m)
	if err != nil {
		return fail(wire.StatusBadSize, fmt.Errorf("open: layout: %w", err))
	}
	alloc, err := c.s.o.Authorize(m.Token)
	if errors.Is(err, pool.ErrNotReady) {
		return fail(wire.StatusUnavailable, fmt.Errorf("open: %w", err))
	}
	if err != nil {
		return fail(wire.StatusUnauthorized, fmt.Errorf("open: token: %w", err))
	}
	e, ev, r := c.s.attach(c, key{alloc: alloc, gpu: int(m.Gpu)}, instanceString(m.InstanceId), lay)
	if e == nil {
		return r
	}
	// Build the reply outside the server lock: chunk lookups may be slow.
	chunks := e.ps.Chunks()
	rep := &wire.OpenReply{
		Session: e.id, Resumed: ev == SessionResumed, PageSize: uint64(lay.pageSize),
		PagesPerChunk: uint32(e.ps.PagesPerChunk()), Capacity: uint32(e.ps.Capacity()),
	}
	fds := make([]int, 0, len(chunks))
	for _, ch := range chunks {
		hc, ok := c.s.o.Chunks(ch.ID)
		if !ok || hc.File == nil {
			c.s.detach(c, e)
			return fail(wire.StatusInternal, fmt.Errorf("open: chunk %s has no memory", ch.ID))
		}
		rep.Chunks = append(rep.Chunks, &wire.ChunkGrant{Id: ch.ID, Size: uint64(ch.Size)})
		fds = append(fds, int(hc.File.Fd()))
	}
	c.s.mu.Lock()
	info := e.infoLocked()
	c.s.mu.Unlock()
	c.s.hookSession(ev, info)
	return reply{body: rep, fds: fds}
}

// attach finds or creates the session of k for instance inst and makes c its
// connection.
func (s *Server) attach(c *conn, k key, inst string, lay layout) (*entry, SessionEvent, reply) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.sessions[k]
	if e != nil && e.ps.Closed() {
		delete(s.sessions, k) // the allocation was revoked and granted anew
		e = nil
	}
	var replaced *SessionInfo
	if e != nil {
		if e.instance == inst {
			if e.layout != lay {
				return nil, "", fail(wire.StatusBadSize, fmt.Errorf("open: resuming session %d with a different layout", e.id))
			}
			if old := e.conn; old != nil && old != c {
				old.wc.Close() // a half-open connection of the same client
			}
			e.conn, e.peer, e.lastSeen = c, c.peer, time.Time{}
			c.e = e
			return e, SessionResumed, reply{}
		}
		if e.conn != nil {
			return nil, "", fail(wire.StatusBusy, fmt.Errorf("open: GPU %d of this allocation is held by live session %d (pid %d)", k.gpu, e.id, e.peer.PID))
		}
		info := e.infoLocked()
		replaced = &info
		s.o.Pool.Close(e.ps)
		delete(s.sessions, k)
	}
	ps, err := s.o.Pool.Open(k.alloc, pool.Spec{GPU: k.gpu, PageSize: lay.pageSize, DevicePages: lay.devicePages, MaxPages: s.defaultPages(k, lay)})
	if replaced != nil {
		// Hooks run under s.mu here; they must not block (documented).
		s.hookSessionLocked(SessionReplaced, *replaced)
	}
	if err != nil {
		r := errReply(err)
		r.err = fmt.Errorf("open: %w", err)
		return nil, "", r
	}
	e = &entry{id: ps.ID(), key: k, instance: inst, ps: ps, layout: lay, opened: time.Now(), conn: c, peer: c.peer}
	if j := s.o.Journal; j != nil {
		info := &OpenInfo{Allocation: k.alloc, Instance: inst, Layout: lay.export(), Image: pool.SessionImage{
			ID: ps.ID(), Allocation: k.alloc, Spec: ps.Spec(), PPC: ps.PagesPerChunk(), Capacity: ps.Capacity()}}
		if replaced != nil {
			info.Replaces = replaced.ID
		}
		for _, ch := range ps.Chunks() {
			info.Image.Chunks = append(info.Image.Chunks, ch.ID)
		}
		if err := j.Session(SessionOp{Session: ps.ID(), Op: wire.OpOpen, Open: info}); err != nil {
			s.o.Pool.Close(ps)
			return nil, "", fail(wire.StatusInternal, fmt.Errorf("open: the agent cannot record the session: %w", err))
		}
	}
	s.sessions[k] = e
	c.e = e
	return e, SessionOpened, reply{}
}

// defaultPages is the MaxPages a session asks of the pool. A client that
// names none gets every unbound chunk of its own GPU in the allocation, so
// that the first rank of a tensor-parallel group does not take the chunks
// meant for the others; when the allocation has no unbound chunk of that GPU
// it gets every unbound chunk.
func (s *Server) defaultPages(k key, lay layout) int {
	if lay.maxPages > 0 {
		return lay.maxPages
	}
	var size int64
	n := 0
	for _, ch := range s.o.Pool.Chunks() {
		if ch.Allocation == k.alloc && !ch.Bound && ch.GPU == k.gpu {
			if n == 0 || ch.Size < size {
				size = ch.Size
			}
			n++
		}
	}
	if n == 0 || lay.pageSize > size {
		return 0
	}
	return n * int(size/lay.pageSize)
}

func (s *Server) hookSessionLocked(ev SessionEvent, info SessionInfo) { s.hookSession(ev, info) }

// detach undoes attach after a failure to build the reply.
func (s *Server) detach(c *conn, e *entry) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e.conn == c {
		e.conn = nil
	}
	c.e = nil
}

// closeSession ends the connection's session at the client's request.
func (c *conn) closeSession() {
	s := c.s
	s.mu.Lock()
	e := c.e
	if s.sessions[e.key] == e {
		delete(s.sessions, e.key)
	}
	info := e.infoLocked()
	s.o.Pool.Close(e.ps)
	c.e = nil
	s.mu.Unlock()
	s.hookSession(SessionClosed, info)
}

// errReply maps a pool error to its status.
func errReply(err error) reply {
	var pe *pool.PendingError
	if errors.As(err, &pe) {
		return reply{st: wire.StatusPending, err: err, ticket: pe.Ticket}
	}
	st := wire.StatusInternal
	for _, m := range statusMap {
		if errors.Is(err, m.err) {
			st = m.st
			break
		}
	}
	return reply{st: st, err: err}
}

var statusMap = []struct {
	err error
	st  wire.Status
}{
	{pool.ErrUnknownStream, wire.StatusUnknownStream},
	{pool.ErrDuplicateStream, wire.StatusDuplicateStream},
	{pool.ErrPageCount, wire.StatusPageCount},
	{pool.ErrOutOfRange, wire.StatusOutOfRange},
	{pool.ErrDuplicateIndex, wire.StatusDuplicateIndex},
	{pool.ErrBadName, wire.StatusBadName},
	{pool.ErrBadSize, wire.StatusBadSize},
	{pool.ErrBadFence, wire.StatusBadFence},
	{pool.ErrClosed, wire.StatusClosed},
	{pool.ErrNoCapacity, wire.StatusNoCapacity},
	{pool.ErrUnknownAllocation, wire.StatusUnauthorized},
	{pool.ErrNotReady, wire.StatusUnavailable},
}
