package server

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/poolerr"
	"github.com/kvpool/kvpool/pkg/unixsock"
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
	maxUUID       = 128
	// maxRanks bounds the ranks an Open may declare.
	maxRanks = 1024
)

// openSpec checks an Open's regions and returns the pool session's
// geometry for gpu: the host page holds a device page of every region (the
// sum of their bytes, rounded up to PageAlign), and the device pages are
// those of the smallest region.
func openSpec(gpu int, m *wire.Open) (pool.Spec, error) {
	if len(m.Regions) == 0 || len(m.Regions) > MaxRegions {
		return pool.Spec{}, fmt.Errorf("%d regions, want 1 to %d", len(m.Regions), MaxRegions)
	}
	var sum uint64
	dev := uint32(0)
	for i, r := range m.Regions {
		if r.BytesPerPage == 0 || r.BytesPerPage > maxPageBytes {
			return pool.Spec{}, fmt.Errorf("region %d: %d bytes per page, want 1 to %d", i, r.BytesPerPage, uint64(maxPageBytes))
		}
		if r.PageCount == 0 {
			return pool.Spec{}, fmt.Errorf("region %d: zero pages", i)
		}
		sum += r.BytesPerPage
		if sum > maxPageBytes {
			return pool.Spec{}, fmt.Errorf("host page of more than %d bytes", uint64(maxPageBytes))
		}
		if i == 0 || r.PageCount < dev {
			dev = r.PageCount
		}
	}
	if dev > 1<<31-2 {
		return pool.Spec{}, fmt.Errorf("%d device pages, at most %d", dev, 1<<31-2)
	}
	if m.MaxPages > 1<<31-2 {
		return pool.Spec{}, fmt.Errorf("max pages %d, at most %d", m.MaxPages, 1<<31-2)
	}
	ps := int64((sum + PageAlign - 1) / PageAlign * PageAlign)
	return pool.Spec{GPU: gpu, PageSize: ps, DevicePages: int(dev), MaxPages: int(m.MaxPages)}, nil
}

// conn is one client connection.
type conn struct {
	s    *Server
	wc   *wire.Conn
	id   uint64
	peer unixsock.Peer
	log  *slog.Logger

	hello bool
	e     *entry    // the session this connection serves, nil before open; set under Server.mu
	since time.Time // connected; the hello and open deadlines count from it
	// evicted: closed to make room at a connection bound, its place
	// released already (Server.mu).
	evicted bool

	in, out []byte
	pages   []int32
	staged  []int32 // device pages of OpPages packets, for the next offload or reload

	// reused request and reply bodies of the hot path
	offload wire.Offload
	offRep  wire.OffloadReply
	reload  wire.Reload
	relRep  wire.ReloadReply
	stream  wire.Stream
	request wire.Request
	pagesIn wire.Pages
	moreIn  wire.More
	numRep  wire.NumPagesReply
	remRep  wire.RemoveRequestReply
	isOff   wire.IsOffloadedReply
	errBody wire.Error
	jop     SessionOp
}

// maxKeep bounds the page buffers a connection keeps between requests; a
// long stream's buffers are dropped after use.
const maxKeep = 4 * wire.MaxPagesPerPacket

// helloBuffer is the receive buffer of a connection until its hello: a
// larger first packet closes the connection (ErrTooLarge). The full
// MaxMessage buffer comes with the hello.
const helloBuffer = 4096

func (s *Server) newConn(uc *net.UnixConn, peer unixsock.Peer) *conn {
	c := &conn{s: s, wc: wire.NewConn(uc), id: connIDs.Add(1), in: make([]byte, helloBuffer), peer: peer, since: time.Now()}
	c.log = s.log.With("conn", c.id, "pid", peer.PID)
	_ = c.wc.SetSpin(s.o.PollAfterReply) // New checked the bound
	// Requests carry no files: where the kernel can (Linux 6.16), a
	// client's send of one fails there, with EPERM, and requests are
	// read the cheaper way; elsewhere serve answers StatusUnexpectedFDs.
	c.wc.RefuseFiles()
	return c
}

// reply is an operation's outcome: a body for StatusOK, or a status and an
// error for the Error body.
type reply struct {
	raw    []byte  // a kept answer sent again: the body of a StatusOK reply
	change bool    // the op changed the session (journal it)
	pages  int     // host pages moved, for Hooks.Request
	all    []int32 // offload, reload: every host page, also those left for OpMore
	full   bool    // offload refused: pool full
	st     wire.Status
	body   proto.Message
	err    error
	ticket uint64
	fds    []int
	lane   []int // OpLane: this side's ends of the pipes whose other ends are fds
}

func fail(st wire.Status, err error) reply { return reply{st: st, err: err} }

// epoch is the monotonic clock's origin for the request hook's durations:
// time.Since(epoch) reads that clock alone, where time.Now reads the wall
// clock as well (two vDSO calls instead of one, on every request).
var epoch = time.Now()

func (c *conn) serve() {
	defer c.finish()
	c.stage()
	for {
		pkt, files, err := c.wc.Recv(c.in)
		if err != nil {
			if !c.timedOut(err) && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				c.s.rlog.Log(slog.LevelWarn, "recv", "closing connection", "conn", c.id, "pid", c.peer.PID, "err", err)
			}
			return
		}
		var start time.Duration
		if c.s.o.Hooks.Request != nil {
			start = time.Since(epoch)
		}
		h, body, err := wire.ParseHeader(pkt)
		if err != nil {
			closeFiles(files)
			c.s.rlog.Log(slog.LevelWarn, "header", "closing connection: bad header", "conn", c.id, "pid", c.peer.PID, "err", err)
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
					// The connection closes either way; the client retries.
					_ = c.send(h, fail(wire.StatusInternal, fmt.Errorf("the agent cannot record this change: %w", err)))
					return
				}
			}
		}
		err = c.send(h, r)
		if r.lane != nil {
			err = c.takeLane(r, err)
		}
		if err != nil {
			c.s.rlog.Log(slog.LevelWarn, "send", "closing connection: send reply", "conn", c.id, "pid", c.peer.PID, "op", h.Op, "err", err)
			return
		}
		if hk := c.s.o.Hooks.Request; hk != nil {
			req := Request{Op: h.Op, Status: r.st, Took: time.Since(epoch) - start, GPU: -1, Pages: r.pages, Full: r.full}
			if c.e != nil {
				spec := c.e.ps.Spec()
				req.GPU, req.Bytes = spec.GPU, int64(r.pages)*spec.PageSize
				req.Session, req.Allocation = c.e.id, c.e.key.alloc
			}
			if r.st != wire.StatusOK {
				req.Err = &RequestError{Op: h.Op, Status: r.st, Message: r.err.Error(),
					Session: req.Session, Allocation: req.Allocation, Err: r.err}
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
			op.Rid, op.Label, op.Pages = m.Rid, m.Label, r.all
			op.Meta = pool.Meta{StoredLen: m.StoredLen, Position: m.Position, Released: m.Released}
		case wire.OpReload:
			op.Rid, op.Label, op.Pages, op.Ticket = c.reload.Rid, c.reload.Label, r.all, c.relRep.Ticket
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
		e.last.Pages = nil
		if len(r.all) > wire.MaxPagesPerPacket {
			// The rest of a long reply stays fetchable after a resend:
			// the slice is the session's (longPages gave it up).
			e.last.Pages = r.all
		}
		e.last.mu.Unlock()
	}
	return nil
}

// cached returns the kept answer when seq and op are those of the
// session's last changing request: the client resends a request whose
// answer it never got (the agent restarted in between). The rest of a long
// reply becomes fetchable with OpMore again.
func (e *entry) cached(seq uint32, op wire.Op) ([]byte, bool) {
	e.last.mu.Lock()
	defer e.last.mu.Unlock()
	if e.last.Op == 0 || e.last.Seq != seq || e.last.Op != op {
		return nil, false
	}
	if len(e.last.Pages) > 0 {
		e.setMore(moreReply{op: op, pages: e.last.Pages})
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
	if !c.evicted {
		s.releaseLocked(c.peer)
	}
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

// handle runs one request: hello and open on any connection, every other
// op on the connection's session, one method each.
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
	if h.Op == wire.OpOffload || h.Op == wire.OpReload {
		// Staged pages are the next offload's or reload's, whatever
		// becomes of it: refused by a limit, a decode error, the pool.
		defer c.dropStaged()
	}
	if r, done := c.prepare(h); done {
		return r
	}
	if replayable(h.Op) {
		if r, ok := c.s.durable(h.Op); !ok {
			return r
		}
	}
	switch h.Op {
	case wire.OpPages:
		return c.handlePages(body)
	case wire.OpOffload:
		return c.handleOffload(body)
	case wire.OpReload:
		return c.handleReload(body)
	case wire.OpMore:
		return c.handleMore(body)
	case wire.OpDiscard:
		return c.handleDiscard(body)
	case wire.OpNumPages:
		return c.handleNumPages(body)
	case wire.OpRemoveRequest:
		return c.handleRemoveRequest(body)
	case wire.OpIsOffloaded:
		return c.handleIsOffloaded(body)
	case wire.OpLabels:
		return c.handleLabels(body)
	case wire.OpUsage:
		return c.handleUsage(body)
	case wire.OpFence:
		return c.handleFence(body)
	case wire.OpClose:
		return c.handleClose(body)
	case wire.OpLane:
		return c.handleLane(body)
	}
	return fail(wire.StatusUnknownOp, fmt.Errorf("unknown op %d", uint8(h.Op)))
}

// prepare does what comes before every session op: it ends a long reply
// that the op does not continue and drops staged device pages that the op
// does not take, applies the header's fence, and answers a resent
// changing request from the session's replay cache. done: r is the answer.
func (c *conn) prepare(h wire.Header) (r reply, done bool) {
	e := c.e
	if h.Op != wire.OpMore && e.hasMore.Load() {
		e.setMore(moreReply{})
	}
	if len(c.staged) > 0 && h.Op != wire.OpPages && h.Op != wire.OpOffload && h.Op != wire.OpReload {
		c.dropStaged()
	}
	if h.Fence != 0 {
		if err := e.ps.Fence(h.Fence); err != nil {
			c.dropStaged()
			return errReply(err), true
		}
	}
	if replayable(h.Op) {
		if body, ok := e.cached(h.Seq, h.Op); ok {
			return reply{raw: body}, true
		}
	}
	return reply{}, false
}

// handlePages stages the device pages of a long offload or reload.
func (c *conn) handlePages(body []byte) reply {
	m := &c.pagesIn
	if err := wire.DecodeBody(body, m); err != nil {
		c.dropStaged()
		return fail(wire.StatusBadRequest, err)
	}
	if r, ok := checkPacketPages(wire.OpPages, len(m.GpuPages)); !ok {
		c.dropStaged()
		return r
	}
	if dev := c.e.ps.Spec().DevicePages; len(c.staged)+len(m.GpuPages) > dev {
		n := len(c.staged) + len(m.GpuPages)
		c.dropStaged()
		return errReply(fmt.Errorf("pages: %w: %d device pages named, the device has %d", poolerr.ErrPageCount, n, dev))
	}
	c.staged = append(c.staged, m.GpuPages...)
	return reply{}
}

// handleOffload takes host pages for a stream; a full pool (or no pages)
// is the reply ok=false, not an error.
func (c *conn) handleOffload(body []byte) reply {
	ps := c.e.ps
	m := &c.offload
	if err := wire.DecodeBody(body, m); err != nil {
		return fail(wire.StatusBadRequest, err)
	}
	if r, ok := checkPacketPages(wire.OpOffload, len(m.GpuPages)); !ok {
		return r
	}
	if r, ok := c.checkStreams(ps, m.Rid, m.Label); !ok {
		return r
	}
	var err error
	c.pages, err = ps.Offload(m.Rid, m.Label, c.withStaged(m.GpuPages),
		pool.Meta{StoredLen: m.StoredLen, Position: m.Position, Released: m.Released}, c.pages[:0])
	rep := &c.offRep
	rep.Ok, rep.HostPages, rep.Total = err == nil, c.pages, 0
	if errors.Is(err, poolerr.ErrFull) || errors.Is(err, poolerr.ErrNoPages) {
		rep.HostPages = rep.HostPages[:0]
		return reply{body: rep, full: errors.Is(err, poolerr.ErrFull)}
	}
	if err != nil {
		return errReply(err)
	}
	all := rep.HostPages
	rep.HostPages, rep.Total = c.longPages(wire.OpOffload)
	return reply{body: rep, pages: len(all), all: all, change: true}
}

// handleReload gives a stream's host pages back, with its metadata and
// the ticket to fence once the copy has read them.
func (c *conn) handleReload(body []byte) reply {
	m := &c.reload
	if err := wire.DecodeBody(body, m); err != nil {
		return fail(wire.StatusBadRequest, err)
	}
	if r, ok := checkPacketPages(wire.OpReload, len(m.GpuPages)); !ok {
		return r
	}
	rl, err := c.e.ps.Reload(m.Rid, m.Label, c.withStaged(m.GpuPages), c.pages[:0])
	c.pages = rl.Pages
	if err != nil {
		return errReply(err)
	}
	rep := &c.relRep
	rep.StoredLen, rep.Position, rep.Released, rep.Ticket = rl.Meta.StoredLen, rl.Meta.Position, rl.Meta.Released, rl.Ticket
	rep.HostPages, rep.Total = c.longPages(wire.OpReload)
	return reply{body: rep, pages: len(rl.Pages), all: rl.Pages, change: true}
}

// handleMore continues the session's last long reply.
func (c *conn) handleMore(body []byte) reply {
	m := &c.moreIn
	if err := wire.DecodeBody(body, m); err != nil {
		return fail(wire.StatusBadRequest, err)
	}
	return c.e.nextPart(c.s, m.Offset)
}

func (c *conn) handleDiscard(body []byte) reply {
	m := &c.stream
	if err := wire.DecodeBody(body, m); err != nil {
		return fail(wire.StatusBadRequest, err)
	}
	if err := c.e.ps.Discard(m.Rid, m.Label); err != nil {
		return errReply(err)
	}
	return reply{change: true}
}

func (c *conn) handleNumPages(body []byte) reply {
	m := &c.stream
	if err := wire.DecodeBody(body, m); err != nil {
		return fail(wire.StatusBadRequest, err)
	}
	n, err := c.e.ps.NumPages(m.Rid, m.Label)
	if err != nil {
		return errReply(err)
	}
	c.numRep.Pages = uint32(n)
	return reply{body: &c.numRep}
}

func (c *conn) handleRemoveRequest(body []byte) reply {
	m := &c.request
	if err := wire.DecodeBody(body, m); err != nil {
		return fail(wire.StatusBadRequest, err)
	}
	n, err := c.e.ps.RemoveRequest(m.Rid)
	if err != nil {
		return errReply(err)
	}
	c.remRep.Removed = uint32(n)
	return reply{body: &c.remRep, change: n > 0}
}

func (c *conn) handleIsOffloaded(body []byte) reply {
	m := &c.request
	if r, ok := c.decodeOpen(body, m); !ok {
		return r
	}
	c.isOff.Offloaded = c.e.ps.IsOffloaded(m.Rid)
	return reply{body: &c.isOff}
}

// handleLabels lists a request's labels, the first part of a long list.
func (c *conn) handleLabels(body []byte) reply {
	m := &c.request
	if r, ok := c.decodeOpen(body, m); !ok {
		return r
	}
	labels := c.e.ps.Labels(m.Rid)
	n := labelsFitting(labels)
	if n == len(labels) {
		return reply{body: &wire.LabelsReply{Labels: labels}}
	}
	c.e.setMore(moreReply{op: wire.OpLabels, labels: labels})
	return reply{body: &wire.LabelsReply{Labels: labels[:n], Total: uint32(len(labels))}}
}

func (c *conn) handleUsage(body []byte) reply {
	if r, ok := c.decodeOpen(body, nil); !ok {
		return r
	}
	u := c.e.ps.Usage()
	return reply{body: &wire.UsageReply{Capacity: uint32(u.Capacity), Used: uint32(u.Used),
		Pending: uint32(u.Pending), Streams: uint32(u.Streams), Requests: uint32(u.Requests), Free: uint32(u.Free())}}
}

// handleFence has nothing to do: prepare applied the header's fence.
func (c *conn) handleFence(body []byte) reply {
	r, _ := c.decodeOpen(body, nil)
	return r
}

func (c *conn) handleClose(body []byte) reply {
	if r, ok := c.decodeOpen(body, nil); !ok {
		return r
	}
	c.closeSession()
	return reply{change: true}
}

// decodeOpen decodes a request body into m (nil: the body must be empty)
// for an op that reads the session without the pool refusing a closed one
// itself. ok false: r is the answer.
func (c *conn) decodeOpen(body []byte, m proto.Message) (r reply, ok bool) {
	if err := wire.DecodeBody(body, m); err != nil {
		return fail(wire.StatusBadRequest, err), false
	}
	if c.e.ps.Closed() {
		return errReply(poolerr.ErrClosed), false
	}
	return reply{}, true
}

// checkPacketPages refuses a packet that names more device pages than
// the protocol lets one packet carry (wire.MaxPagesPerPacket): a longer
// list travels as pages packets.
func checkPacketPages(op wire.Op, n int) (reply, bool) {
	if n > wire.MaxPagesPerPacket {
		return fail(wire.StatusBadRequest, fmt.Errorf("%s: %d device pages in one packet, at most %d (send the rest ahead in pages packets)",
			op, n, wire.MaxPagesPerPacket)), false
	}
	return reply{}, true
}

// withStaged returns the device pages of an offload or reload: those of
// the OpPages packets before it, then its own.
func (c *conn) withStaged(pages []int32) []int32 {
	if len(c.staged) == 0 {
		return pages
	}
	if len(c.staged)+len(pages) > 1<<31-2 {
		return c.staged // the pool refuses it: more than any device has
	}
	c.staged = append(c.staged, pages...)
	return c.staged
}

func (c *conn) dropStaged() {
	if cap(c.staged) > maxKeep {
		c.staged = nil
	}
	c.staged = c.staged[:0]
}

// longPages returns the host pages of c.pages that go in the first reply
// packet and, when they are not all of them, the whole count; the pages
// then move to the session for OpMore to hand out.
func (c *conn) longPages(op wire.Op) ([]int32, uint32) {
	pages := c.pages
	if len(pages) <= wire.MaxPagesPerPacket {
		if cap(pages) > maxKeep {
			c.pages = nil
		}
		return pages, 0
	}
	c.e.setMore(moreReply{op: op, pages: pages})
	c.pages = nil
	return pages[:wire.MaxPagesPerPacket], uint32(len(pages))
}

// labelsFitting returns how many of labels fit in one reply.
func labelsFitting(labels []string) int {
	size := 0
	for i, l := range labels {
		size += 1 + protowire.SizeVarint(uint64(len(l))) + len(l)
		if size > wire.MaxLabelBytes {
			return i
		}
	}
	return len(labels)
}

func (e *entry) setMore(m moreReply) {
	e.moreMu.Lock()
	e.more = m
	e.hasMore.Store(m.op != 0)
	e.moreMu.Unlock()
}

// nextPart answers OpMore: the part of the session's last long reply from
// offset on.
func (e *entry) nextPart(s *Server, offset uint32) reply {
	e.moreMu.Lock()
	m := e.more
	e.moreMu.Unlock()
	off := int(offset)
	switch m.op {
	case 0:
		return fail(wire.StatusBadRequest, errors.New("more: the session has no long reply to continue (the next request after it ends it)"))
	case wire.OpLabels:
		if off > len(m.labels) {
			return fail(wire.StatusBadRequest, fmt.Errorf("more: offset %d past the %d labels", off, len(m.labels)))
		}
		rest := m.labels[off:]
		return reply{body: &wire.MoreReply{Labels: rest[:labelsFitting(rest)]}}
	case wire.OpOpen:
		if off >= len(m.chunks) {
			return fail(wire.StatusBadRequest, fmt.Errorf("more: offset %d past the %d chunks of the open", off, len(m.chunks)))
		}
		end := min(len(m.chunks), off+wire.MaxFDs)
		fds, err := s.chunkFDs(m.chunks[off:end])
		if err != nil {
			return fail(wire.StatusInternal, fmt.Errorf("more: %w", err))
		}
		mr := &wire.MoreReply{}
		if m.grants != nil {
			mr.Chunks = m.grants[off:end]
		}
		return reply{body: mr, fds: fds}
	}
	if off > len(m.pages) {
		return fail(wire.StatusBadRequest, fmt.Errorf("more: offset %d past the %d host pages of the %s", off, len(m.pages), m.op))
	}
	end := min(len(m.pages), off+wire.MaxPagesPerPacket)
	return reply{body: &wire.MoreReply{HostPages: m.pages[off:end]}}
}

// handleLane makes the pipes of a lane (wire.Conn.UseLane) for the
// session's packets from the next request on, and passes the client its
// ends; a connection takes one lane.
func (c *conn) handleLane(body []byte) reply {
	if err := wire.DecodeBody(body, nil); err != nil {
		return fail(wire.StatusBadRequest, err)
	}
	if c.wc.HasLane() {
		return fail(wire.StatusBadRequest, errors.New("lane: this connection's packets travel a lane already"))
	}
	ours, theirs, err := wire.LanePipes()
	if err != nil {
		return fail(wire.StatusInternal, err) // out of descriptors: the session stays on the socket
	}
	return reply{fds: theirs[:], lane: ours[:]}
}

// takeLane ends an OpLane whose reply was sent (sent: send's error): the
// client's ends are closed here, and the connection's packets move to the
// lane, which a failed send drops.
func (c *conn) takeLane(r reply, sent error) error {
	for _, fd := range r.fds {
		unix.Close(fd)
	}
	if sent != nil {
		unix.Close(r.lane[0])
		unix.Close(r.lane[1])
		return sent
	}
	if err := c.wc.UseLane(r.lane[0], r.lane[1]); err != nil {
		return err // the client writes to a lane nobody reads: close
	}
	c.log.Debug("the session's packets travel a lane")
	return nil
}

func (c *conn) handleHello(body []byte) reply {
	if c.hello {
		return fail(wire.StatusBadRequest, errors.New("hello sent twice"))
	}
	var m wire.Hello
	if err := wire.DecodeBody(body, &m); err != nil {
		return fail(wire.StatusBadRequest, err)
	}
	if r, ok := c.checkClientName(m.Client); !ok {
		return r
	}
	if m.Version < wire.Version {
		return fail(wire.StatusVersion, fmt.Errorf("client speaks protocol version %d; this agent speaks version %d only "+
			"(GPUs named by UUID, page lists of any length): upgrade the kvpool client", m.Version, wire.Version))
	}
	c.hello = true
	c.in = make([]byte, wire.MaxMessage+1)
	c.stage()
	c.log = c.log.With("client", logName(m.Client))
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
	if m.Ranks > maxRanks {
		return fail(wire.StatusBadRequest, fmt.Errorf("open: %d ranks declared, at most %d", m.Ranks, maxRanks))
	}
	if m.GpuUuid == "" || len(m.GpuUuid) > maxUUID {
		return fail(wire.StatusBadRequest, fmt.Errorf("open: GPU UUID of %d bytes, want 1 to %d (the UUID the CUDA driver reports, \"GPU-...\")", len(m.GpuUuid), maxUUID))
	}
	gpu, ok := c.s.o.GPUs[m.GpuUuid]
	if !ok {
		return fail(wire.StatusUnknownGPU, fmt.Errorf("open: GPU %s is none of this node's %d GPUs (or their MIG instances) in the agent's plan", m.GpuUuid, c.s.gpuCount()))
	}
	spec, err := openSpec(gpu, &m)
	if err != nil {
		return fail(wire.StatusBadSize, fmt.Errorf("open: layout: %w", err))
	}
	if r, ok := c.checkLayout(spec); !ok {
		return r
	}
	alloc, err := c.s.o.Authorize(m.Token, c.peer)
	if errors.Is(err, poolerr.ErrNotReady) {
		return fail(wire.StatusUnavailable, fmt.Errorf("open: %w", err))
	}
	if err != nil {
		c.unauthorized(err)
		return fail(wire.StatusUnauthorized, fmt.Errorf("open: token: %w", err))
	}
	near := c.s.near(alloc, gpu, int(m.Ranks))
	e, ev, r := c.s.attach(c, key{alloc: alloc, device: deviceKey(m.GpuUuid)}, gpu, m.GpuUuid, instanceString(m.InstanceId), spec, near, len(m.Regions))
	if e == nil {
		return r
	}
	c.stage()
	// A session's connection waits for its requests in the kernel, out of
	// the poller, while the agent has a CPU to spare for it (wire.Conn);
	// short-lived connections (health probes) never take that place.
	c.wc.TryDirect()
	// Build the reply outside the server lock: chunk lookups may be slow.
	chunks := e.ps.Chunks()
	loc := e.ps.Locality()
	rep := &wire.OpenReply{
		Session: e.id, Resumed: ev == SessionResumed, PageSize: uint64(spec.PageSize),
		PagesPerChunk: uint32(e.ps.PagesPerChunk()), Capacity: uint32(e.ps.Capacity()),
		GpuNuma: proto.Int32(int32(near.NUMA)), Ranks: uint32(max(loc.Ranks, 0)),
	}
	ids := make([]string, len(chunks))
	for i, ch := range chunks {
		rep.Chunks = append(rep.Chunks, &wire.ChunkGrant{Id: ch.ID, Size: uint64(ch.Size), Numa: proto.Int32(int32(max(ch.NUMA, -1)))})
		ids[i] = ch.ID
	}
	// Every chunk's memory is checked now; one packet passes at most
	// wire.MaxFDs descriptors, and the client asks for the rest with
	// OpMore.
	fds, err := c.s.chunkFDs(ids)
	if err != nil {
		c.s.detach(c, e)
		return fail(wire.StatusInternal, fmt.Errorf("open: %w", err))
	}
	if rep.Resumed && m.MappedSession == e.id && wire.HeaderSize+proto.Size(rep) <= wire.MaxMessage {
		// The client maps this session's chunks still: a session's chunks
		// are its own for its life, the same memory across restarts (an
		// adopted chunk is the memfd the keeper held; one that is not
		// revokes the allocation, and the session with it). Named, not
		// passed: a session of thousands of chunks resumes without
		// thousands of descriptors to pass, receive and close.
		rep.ChunksMapped = true
		fds = nil
	}
	if len(fds) > wire.MaxFDs {
		fds = fds[:wire.MaxFDs]
		m := moreReply{op: wire.OpOpen, chunks: ids}
		if wire.HeaderSize+proto.Size(rep) > wire.MaxMessage {
			// Too many chunks to name in one packet (some 4,800 of 1 GiB
			// with the agent's chunk names): the reply names those whose
			// fds it passes, and each More the next.
			m.grants = rep.Chunks
			rep.Chunks, rep.ChunkCount = rep.Chunks[:wire.MaxFDs], uint32(len(m.grants))
		}
		e.setMore(m)
	}
	c.s.mu.Lock()
	info := e.infoLocked()
	c.s.mu.Unlock()
	c.s.hookSession(ev, info)
	return reply{body: rep, fds: fds}
}

// chunkFDs are the memfds of the chunks named, in order.
func (s *Server) chunkFDs(ids []string) ([]int, error) {
	fds := make([]int, len(ids))
	for i, id := range ids {
		hc, ok := s.o.Chunks(id)
		if !ok || hc.File == nil {
			return nil, fmt.Errorf("chunk %s has no memory", id)
		}
		fds[i] = int(hc.File.Fd())
	}
	return fds, nil
}

// near is where an Open's GPU sits and who shares its allocation: the
// GPU's NUMA node (Options.GPUNUMA), the ranks the client declared or else
// Options.Ranks says, and the other ranks' GPUs when those are known and
// as many as the ranks.
func (s *Server) near(alloc string, gpu, declared int) pool.Near {
	near := pool.Near{NUMA: s.numaOf(gpu), Ranks: declared}
	if s.o.Ranks == nil {
		return near
	}
	rk := s.o.Ranks(alloc)
	if near.Ranks == 0 {
		near.Ranks = rk.Count
	}
	if near.Ranks == 0 || len(rk.GPUs) != near.Ranks || !slices.Contains(rk.GPUs, gpu) {
		return near
	}
	self := false
	for _, g := range rk.GPUs {
		if g == gpu && !self {
			self = true // one rank on this GPU is the session itself
			continue
		}
		near.Peers = append(near.Peers, pool.Place{GPU: g, NUMA: s.numaOf(g)})
	}
	return near
}

// numaOf is a host GPU's NUMA node, -1 when unknown.
func (s *Server) numaOf(gpu int) int {
	if n, ok := s.o.GPUNUMA[gpu]; ok && n >= 0 {
		return n
	}
	return -1
}

// attach finds or creates the session of k for instance inst, of geometry
// spec from a layout of that many regions, and makes c its connection.
func (s *Server) attach(c *conn, k key, gpu int, uuid, inst string, spec pool.Spec, near pool.Near, regions int) (*entry, SessionEvent, reply) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.sessions[k]
	if e != nil && e.ps.Closed() {
		delete(s.sessions, k) // the allocation was revoked and granted anew
		e = nil
	}
	var replaced *SessionInfo
	if e != nil {
		owner := sameProcess(e.peer, c.peer)
		if e.instance == inst && !owner {
			// The owner's ID from another process is never a resume: that
			// process counts as another instance.
			s.refused(RefusedNotOwner, c.peer, "resume refused: instance ID of another process", "session", e.id, "owner", e.peer.PID)
		}
		if e.instance == inst && owner {
			if e.ps.Spec() != spec || e.regions != regions {
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
			return nil, "", fail(wire.StatusBusy, fmt.Errorf("open: GPU %s of this allocation is held by live session %d (pid %d)", uuid, e.id, e.peer.PID))
		}
		if r, ok := s.durable(wire.OpOpen); !ok {
			return nil, "", r
		}
		// The owner's session is replaced only if the open succeeds: it
		// is set aside for the bounds and put back on a refusal, with
		// its streams (the pool does the same with its chunks).
		info := e.infoLocked()
		replaced = &info
		delete(s.sessions, k)
	} else if r, ok := s.durable(wire.OpOpen); !ok {
		return nil, "", r
	}
	old := e
	refuse := func(r reply) (*entry, SessionEvent, reply) {
		if old != nil {
			s.sessions[k] = old
		}
		return nil, "", r
	}
	if r, ok := s.checkSessionsLocked(c, k, spec.DevicePages); !ok {
		return refuse(r)
	}
	var oldPS *pool.Session
	if old != nil {
		oldPS = old.ps
	}
	ps, err := s.o.Pool.ReplaceNear(oldPS, k.alloc, spec, near)
	if err != nil {
		r := errReply(err)
		r.err = fmt.Errorf("open: %w", err)
		if pb := (*pool.PageBoundError)(nil); errors.As(err, &pb) {
			s.refused(RefusedPages, c.peer, "open refused: the sessions' host pages would pass the agent's bound", "pages", pb.Pages, "page_size", pb.PageSize, "bound", pb.Bound)
			r = fail(wire.StatusLimit, fmt.Errorf("%w (limits.maxPages)", err))
		}
		return refuse(r)
	}
	if replaced != nil {
		// Hooks run under s.mu here; they must not block (documented).
		s.hookSessionLocked(SessionReplaced, *replaced)
	}
	e = &entry{id: ps.ID(), key: k, gpu: gpu, uuid: uuid, instance: inst, short: shortID(inst), ps: ps, regions: regions, opened: time.Now(), conn: c, peer: c.peer}
	if j := s.o.Journal; j != nil {
		info := &OpenInfo{Allocation: k.alloc, Instance: inst, UUID: uuid, Peer: c.peer, Regions: regions, Image: ps.Image()}
		if replaced != nil {
			info.Replaces = replaced.ID
		}
		if err := j.Session(SessionOp{Session: ps.ID(), Op: wire.OpOpen, Open: info}); err != nil {
			s.o.Pool.Close(ps)
			// The replaced session is closed in the pool; the books
			// must say so too, or a restart would bring it back.
			r := fail(wire.StatusInternal, fmt.Errorf("open: the agent cannot record the session: %w", err))
			return nil, "", s.failedOpenLocked(replaced, r)
		}
	}
	s.sessions[k] = e
	c.e = e
	return e, SessionOpened, reply{}
}

func (s *Server) hookSessionLocked(ev SessionEvent, info SessionInfo) { s.hookSession(ev, info) }

// durable refuses a change, "unavailable, retry", while Options.Durable
// says it would not survive a restart.
func (s *Server) durable(op wire.Op) (reply, bool) {
	if s.o.Durable == nil {
		return reply{}, true
	}
	if err := s.o.Durable(); err != nil {
		return fail(wire.StatusUnavailable, fmt.Errorf("%s: %w; nothing was done, retry", op, err)), false
	}
	return reply{}, true
}

// failedOpenLocked ends an open that failed after it had replaced the
// disconnected owner's session (replaced, nil when it had not), which
// only the books' refusal to record the new session does (the hook has
// seen the replacement): the replaced session is closed in the pool, so
// the books record its close, or a restart would bring it back over
// whatever later opens on its chunks. It returns r, or StatusInternal
// when the close cannot be recorded.
func (s *Server) failedOpenLocked(replaced *SessionInfo, r reply) reply {
	if replaced == nil {
		return r
	}
	if j := s.o.Journal; j != nil {
		if err := j.Session(SessionOp{Session: replaced.ID, Op: wire.OpClose}); err != nil {
			return fail(wire.StatusInternal, fmt.Errorf("%w; and the agent cannot record the close of the session it replaced: %w", r.err, err))
		}
	}
	return r
}

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

// errReply maps a pool error to its status (wire.StatusOf), with the
// ticket to fence for a refusal until a fence.
func errReply(err error) reply {
	r := reply{st: wire.StatusOf(err), err: err}
	if pe := (*pool.PendingError)(nil); errors.As(err, &pe) {
		r.ticket = pe.Ticket
	}
	return r
}
