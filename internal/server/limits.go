package server

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/unixsock"
	"github.com/kvpool/kvpool/pkg/wire"
)

// Limits bound what one tenant (a local process with or without a token)
// can make the server hold. A request over a bound gets wire.StatusLimit
// with a message naming the bound; a connection over a bound gets that
// status in reply to its first request and is closed. Zero fields take the
// defaults of DefaultLimits. docs/security.md derives the heap they bound.
type Limits struct {
	// MaxConns bounds the tenants' connections together (the agent's own
	// probe connections are counted apart, see Options.ProbePID).
	MaxConns int
	// MaxConnsPerUID and MaxConnsPerPID bound one peer user's and one peer
	// process's connections (SO_PEERCRED). A peer in a PID namespace the
	// agent cannot see has PID 0: only its UID's bound applies.
	MaxConnsPerUID int
	MaxConnsPerPID int
	// ProbeConns bounds the connections of the agent's own process, which
	// no tenant can take.
	ProbeConns int
	// HelloTimeout is how long a new connection may take to say hello;
	// OpenTimeout how long, from connecting, it may take to open a session.
	// A connection that misses either is closed.
	HelloTimeout time.Duration
	OpenTimeout  time.Duration
	// MaxSessions bounds the server's sessions; MaxSessionsPerAllocation
	// one allocation's.
	MaxSessions              int
	MaxSessionsPerAllocation int
	// MaxStreamsPerSession and MaxNameBytesPerSession bound one session's
	// stream table: its streams, and the bytes of their request IDs and
	// labels (counted once per stream).
	MaxStreamsPerSession   int
	MaxNameBytesPerSession int64
	// MaxStreams and MaxNameBytes bound the same over every session
	// together (pool.StreamTotals): what the agent's heap, its books and
	// the time of its restart grow with. Concurrent offloads may overshoot
	// them by one stream each.
	MaxStreams   int
	MaxNameBytes int64
	// MaxDevicePages bounds a layout's device pages (the smallest region's
	// page count): the pool keeps a duplicate-check bitmap of one bit per
	// device page for each session.
	MaxDevicePages int
	// MaxDevicePagesTotal bounds the same over every session together:
	// their bitmaps are the agent's heap, and a layout is the tenant's
	// choice (1 << 29: 64 MiB of bitmaps).
	MaxDevicePagesTotal int
	// MaxClientName bounds the client name a hello carries, in bytes.
	MaxClientName int
}

// DefaultLimits are the bounds a zero Limits field takes.
var DefaultLimits = Limits{
	MaxConns:                 1024,
	MaxConnsPerUID:           512,
	MaxConnsPerPID:           64,
	ProbeConns:               8,
	HelloTimeout:             5 * time.Second,
	OpenTimeout:              15 * time.Second,
	MaxSessions:              1024,
	MaxSessionsPerAllocation: 64,
	MaxStreamsPerSession:     1 << 17,
	MaxNameBytesPerSession:   16 << 20,
	MaxStreams:               1 << 19,
	MaxNameBytes:             32 << 20,
	MaxDevicePages:           1 << 24,
	MaxDevicePagesTotal:      1 << 29,
	MaxClientName:            256,
}

func (l Limits) withDefaults() Limits {
	d := DefaultLimits
	set := func(v *int, def int) {
		if *v <= 0 {
			*v = def
		}
	}
	set(&l.MaxConns, d.MaxConns)
	set(&l.MaxConnsPerUID, d.MaxConnsPerUID)
	set(&l.MaxConnsPerPID, d.MaxConnsPerPID)
	set(&l.ProbeConns, d.ProbeConns)
	set(&l.MaxSessions, d.MaxSessions)
	set(&l.MaxSessionsPerAllocation, d.MaxSessionsPerAllocation)
	set(&l.MaxStreamsPerSession, d.MaxStreamsPerSession)
	set(&l.MaxStreams, d.MaxStreams)
	set(&l.MaxDevicePages, d.MaxDevicePages)
	set(&l.MaxDevicePagesTotal, d.MaxDevicePagesTotal)
	set(&l.MaxClientName, d.MaxClientName)
	if l.HelloTimeout <= 0 {
		l.HelloTimeout = d.HelloTimeout
	}
	if l.OpenTimeout <= 0 {
		l.OpenTimeout = d.OpenTimeout
	}
	if l.MaxNameBytesPerSession <= 0 {
		l.MaxNameBytesPerSession = d.MaxNameBytesPerSession
	}
	if l.MaxNameBytes <= 0 {
		l.MaxNameBytes = d.MaxNameBytes
	}
	return l
}

// Refusal reasons, as Hooks.Refused and the kvpool_limit_rejects_total
// metric name them.
const (
	RefusedConns            = "conns"
	RefusedConnsPerUID      = "conns_per_uid"
	RefusedConnsPerPID      = "conns_per_pid"
	RefusedProbeConns       = "probe_conns"
	RefusedHelloTimeout     = "hello_timeout"
	RefusedOpenTimeout      = "open_timeout"
	RefusedSessions         = "sessions"
	RefusedAllocSessions    = "sessions_per_allocation"
	RefusedStreams          = "streams"
	RefusedNameBytes        = "name_bytes"
	RefusedStreamsTotal     = "streams_total"
	RefusedNameBytesTotal   = "name_bytes_total"
	RefusedDevicePages      = "device_pages"
	RefusedDevicePagesTotal = "device_pages_total"
	RefusedPages            = "pages"
	RefusedClientName       = "client_name"
	RefusedUnauthorized     = "unauthorized"
	RefusedNotOwner         = "not_owner"
	RefusedAcceptTemporary  = "accept_temporary"
	// RefusedEvicted counts connections without a session closed to make
	// room for a new one at a connection bound (not a refusal of the new
	// one, which is served).
	RefusedEvicted = "evicted_idle"
)

// RefusalReasons lists every reason, for metrics that start at zero.
var RefusalReasons = []string{RefusedConns, RefusedConnsPerUID, RefusedConnsPerPID, RefusedProbeConns,
	RefusedHelloTimeout, RefusedOpenTimeout, RefusedSessions, RefusedAllocSessions, RefusedStreams,
	RefusedNameBytes, RefusedStreamsTotal, RefusedNameBytesTotal, RefusedDevicePages, RefusedDevicePagesTotal, RefusedPages, RefusedClientName, RefusedUnauthorized, RefusedNotOwner,
	RefusedAcceptTemporary, RefusedEvicted}

// refused counts a refusal and logs it, rate-limited per reason.
func (s *Server) refused(reason string, peer unixsock.Peer, msg string, args ...any) {
	if h := s.o.Hooks.Refused; h != nil {
		h(reason)
	}
	args = append(args, "reason", reason, "pid", peer.PID, "uid", peer.UID)
	s.rlog.Log(slog.LevelWarn, reason, msg, args...)
}

// connCounts are the live connections by peer, guarded by Server.mu.
type connCounts struct {
	total, probes int
	uid           map[uint32]int
	pid           map[int32]int
}

func (s *Server) isProbe(p unixsock.Peer) bool { return s.o.ProbePID > 0 && int(p.PID) == s.o.ProbePID }

// admitLocked decides whether a connection from peer may be served. It
// returns the refusal reason and message, or "" when admitted (and then
// counts the connection). At a connection bound it first makes room by
// closing the oldest connection within that bound that has no session
// (evictLocked): connections that never open a session, however many a
// process re-dials, cannot keep out a client that opens one.
func (s *Server) admitLocked(p unixsock.Peer) (string, string) {
	n, l := &s.counts, &s.lim
	if s.isProbe(p) {
		if n.probes >= l.ProbeConns {
			return RefusedProbeConns, fmt.Sprintf("the agent's own connections are at their limit of %d", l.ProbeConns)
		}
		n.probes++
		return "", ""
	}
	room := func(full bool, reason, msg string, sameUID, samePID bool) (string, string) {
		if !full {
			return "", ""
		}
		evicted, young := s.evictLocked(p, sameUID, samePID)
		if evicted {
			return "", ""
		}
		msg += " (none could make room: each has a session or is new)"
		if !young {
			// Every place holds a session: the agent refuses clients
			// (Refusing). Places taken by connections too new to close
			// are churn of connections that never open, not that.
			s.lastRefusal.Store(&refusal{at: time.Now(), why: msg})
		}
		return reason, msg
	}
	// Each bound is checked after the room the one before made.
	if r, m := room(n.total >= l.MaxConns, RefusedConns, fmt.Sprintf("the agent serves at most %d connections", l.MaxConns), false, false); r != "" {
		return r, m
	}
	if r, m := room(n.uid[p.UID] >= l.MaxConnsPerUID, RefusedConnsPerUID, fmt.Sprintf("uid %d holds %d connections, the limit", p.UID, l.MaxConnsPerUID), true, false); r != "" {
		return r, m
	}
	if r, m := room(p.PID != 0 && n.pid[p.PID] >= l.MaxConnsPerPID, RefusedConnsPerPID, fmt.Sprintf("pid %d holds %d connections, the limit", p.PID, l.MaxConnsPerPID), true, true); r != "" {
		return r, m
	}
	n.total++
	n.uid[p.UID]++
	if p.PID != 0 {
		n.pid[p.PID]++
	}
	return "", ""
}

// evictLocked closes the oldest connection without a session of peer's
// uid (sameUID), of its process (samePID) or of anyone, at least
// EvictAfter old, and releases its place at once. It reports whether it
// found one, and whether connections without a session too new to close
// hold places of that bound.
func (s *Server) evictLocked(p unixsock.Peer, sameUID, samePID bool) (evicted, young bool) {
	if s.o.EvictAfter < 0 {
		return false, false
	}
	var oldest *conn
	cutoff := time.Now().Add(-s.o.EvictAfter)
	for c := range s.conns {
		switch {
		case c.e != nil || c.evicted || s.isProbe(c.peer):
		case sameUID && c.peer.UID != p.UID, samePID && c.peer.PID != p.PID:
		case !c.since.Before(cutoff):
			young = true
		case oldest == nil || c.since.Before(oldest.since):
			oldest = c
		}
	}
	if oldest == nil {
		return false, young
	}
	oldest.evicted = true
	s.releaseLocked(oldest.peer)
	oldest.wc.Close()
	s.refused(RefusedEvicted, oldest.peer, "closing a connection without a session to make room for a new one", "conn", oldest.id,
		"age", time.Since(oldest.since).Round(time.Millisecond))
	return true, young
}

// refusal is the last connection refused at a bound.
type refusal struct {
	at  time.Time
	why string
}

// Refusing reports whether the server refused a new connection at one of
// its connection bounds within the last window (every place held by a
// connection with a session, so none could be made), and why. Health
// checks report it.
func (s *Server) Refusing(window time.Duration) (string, bool) {
	r := s.lastRefusal.Load()
	if r == nil || time.Since(r.at) > window {
		return "", false
	}
	return r.why, true
}

// releaseLocked undoes admitLocked when a connection ends.
func (s *Server) releaseLocked(p unixsock.Peer) {
	n := &s.counts
	if s.isProbe(p) {
		n.probes--
		return
	}
	n.total--
	if n.uid[p.UID]--; n.uid[p.UID] <= 0 {
		delete(n.uid, p.UID)
	}
	if p.PID != 0 {
		if n.pid[p.PID]--; n.pid[p.PID] <= 0 {
			delete(n.pid, p.PID)
		}
	}
}

// maxRefusers bounds the connections being refused at once; beyond it a
// refused connection is closed without a reply.
const maxRefusers = 32

// refuseTimeout bounds how long a refused connection is waited on for the
// request its refusal answers.
const refuseTimeout = time.Second

// refuseConn answers the first request of a connection the server will not
// serve with StatusLimit and msg, then closes it. It holds no connection
// slot and at most a small buffer; admit counts it in s.refusing.
func (s *Server) refuseConn(uc *net.UnixConn, msg string) {
	defer uc.Close()
	if uc.SetDeadline(time.Now().Add(refuseTimeout)) != nil {
		return // no deadline, no read: just close
	}
	var buf [512]byte
	n, oobn, _, _, err := uc.ReadMsgUnix(buf[:], nil)
	if err != nil || n < wire.HeaderSize || oobn != 0 {
		return
	}
	h, _, err := wire.ParseHeader(buf[:n])
	if err != nil {
		return
	}
	pkt, err := wire.AppendPacket(nil, wire.Header{Op: h.Op, Status: wire.StatusLimit, Seq: h.Seq},
		&wire.Error{Message: "connection refused: " + msg})
	if err == nil {
		_, _ = uc.Write(pkt) // best effort: the connection closes next
	}
}

// stage moves a connection's deadline along its life: HelloTimeout from
// connecting until hello, OpenTimeout from connecting until open, none once
// a session is open.
func (c *conn) stage() {
	l := c.s.lim
	var err error
	switch {
	case c.e != nil:
		err = c.wc.SetReadDeadline(time.Time{})
	case c.hello:
		err = c.wc.SetReadDeadline(c.since.Add(l.OpenTimeout))
	default:
		err = c.wc.SetReadDeadline(c.since.Add(l.HelloTimeout))
	}
	if err != nil {
		// Only a closed socket refuses a deadline; the next receive
		// reports that and ends the connection.
		c.log.Debug("set read deadline", "err", err)
	}
}

// timedOut reports (and counts) a receive that failed because the
// connection missed its hello or open deadline.
func (c *conn) timedOut(err error) bool {
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() || c.e != nil {
		return false
	}
	if c.hello {
		c.s.refused(RefusedOpenTimeout, c.peer, "closing connection: no session opened in time", "limit", c.s.lim.OpenTimeout)
	} else {
		c.s.refused(RefusedHelloTimeout, c.peer, "closing connection: no hello in time", "limit", c.s.lim.HelloTimeout)
	}
	return true
}

// checkClientName bounds a hello's client name.
func (c *conn) checkClientName(name string) (reply, bool) {
	if limit := c.s.lim.MaxClientName; len(name) > limit {
		c.s.refused(RefusedClientName, c.peer, "hello refused: client name too long", "bytes", len(name), "client", logName(name))
		return fail(wire.StatusLimit, fmt.Errorf("client name of %d bytes, at most %d", len(name), limit)), false
	}
	return reply{}, true
}

// checkLayout bounds an Open's layout beyond openSpec's own checks.
func (c *conn) checkLayout(spec pool.Spec) (reply, bool) {
	if limit := c.s.lim.MaxDevicePages; spec.DevicePages > limit {
		c.s.refused(RefusedDevicePages, c.peer, "open refused: too many device pages", "pages", spec.DevicePages)
		return fail(wire.StatusLimit, fmt.Errorf("open: layout of %d device pages, at most %d (limits.maxDevicePages)", spec.DevicePages, limit)), false
	}
	return reply{}, true
}

// unauthorized logs and counts a refused token.
func (c *conn) unauthorized(err error) {
	c.s.refused(RefusedUnauthorized, c.peer, "open refused: bad token", "err", err)
}

// checkStreams bounds the session's stream table before an offload adds
// (rid, label) to it.
func (c *conn) checkStreams(ps *pool.Session, rid, label string) (reply, bool) {
	u := ps.Usage()
	l := &c.s.lim
	if u.Streams >= l.MaxStreamsPerSession {
		c.s.refused(RefusedStreams, c.peer, "offload refused: too many streams", "session", c.e.id)
		return fail(wire.StatusLimit, fmt.Errorf("offload: the session holds %d streams, the limit (limits.maxStreamsPerSession)", u.Streams)), false
	}
	if n := u.NameBytes + int64(len(rid)+len(label)); n > l.MaxNameBytesPerSession {
		c.s.refused(RefusedNameBytes, c.peer, "offload refused: too many name bytes", "session", c.e.id)
		return fail(wire.StatusLimit, fmt.Errorf("offload: request IDs and labels would take %d bytes, more than the session's %d (limits.maxNameBytesPerSession)", n, l.MaxNameBytesPerSession)), false
	}
	streams, names := c.s.o.Pool.StreamTotals()
	if streams >= l.MaxStreams {
		c.s.refused(RefusedStreamsTotal, c.peer, "offload refused: the agent holds its limit of streams", "session", c.e.id)
		return fail(wire.StatusLimit, fmt.Errorf("offload: the agent's sessions hold %d streams, the limit (limits.maxStreams)", streams)), false
	}
	if n := names + int64(len(rid)+len(label)); n > l.MaxNameBytes {
		c.s.refused(RefusedNameBytesTotal, c.peer, "offload refused: the agent holds its limit of name bytes", "session", c.e.id)
		return fail(wire.StatusLimit, fmt.Errorf("offload: the agent's request IDs and labels would take %d bytes, more than its %d (limits.maxNameBytes)", n, l.MaxNameBytes)), false
	}
	return reply{}, true
}

// checkSessionsLocked bounds the sessions before attach opens one for k
// whose layout names devicePages: the agent's sessions, the allocation's,
// and the device pages of every session's layout together (each session
// keeps a bit a device page).
func (s *Server) checkSessionsLocked(c *conn, k key, devicePages int) (reply, bool) {
	l := &s.lim
	if len(s.sessions) >= l.MaxSessions {
		s.refused(RefusedSessions, c.peer, "open refused: too many sessions")
		return fail(wire.StatusLimit, fmt.Errorf("open: the agent holds %d sessions, the limit", len(s.sessions))), false
	}
	n, held := 0, 0
	for sk, e := range s.sessions {
		if sk.alloc == k.alloc {
			n++
		}
		held += e.ps.Spec().DevicePages
	}
	if n >= l.MaxSessionsPerAllocation {
		s.refused(RefusedAllocSessions, c.peer, "open refused: too many sessions of one allocation", "allocation", k.alloc)
		return fail(wire.StatusLimit, fmt.Errorf("open: the allocation holds %d sessions, the limit (limits.maxSessionsPerAllocation)", n)), false
	}
	if limit := l.MaxDevicePagesTotal; held+devicePages > limit {
		s.refused(RefusedDevicePagesTotal, c.peer, "open refused: the sessions' layouts would name too many device pages", "pages", devicePages, "held", held)
		return fail(wire.StatusLimit, fmt.Errorf("open: a layout of %d device pages would bring the sessions' to %d, more than the agent's %d (limits.maxDevicePagesTotal); %d more fit",
			devicePages, held+devicePages, limit, max(limit-held, 0))), false
	}
	return reply{}, true
}

// sameProcess reports whether two peers are the same process as the agent
// can tell: same UID and same PID. Peers whose PID the agent cannot see
// (PID 0, another PID namespace) match on UID alone; the instance ID, a
// 128-bit secret of the process, then stands between them.
func sameProcess(a, b unixsock.Peer) bool { return a.UID == b.UID && a.PID == b.PID }

// shortID is how logs and listings name a client instance (given in hex):
// the first 8 hex digits of the SHA-256 of that hex text, enough to tell
// instances apart, useless to resume one.
func shortID(instance string) string {
	h := sha256.Sum256([]byte(instance))
	return hex.EncodeToString(h[:4])
}

// logName makes a client-chosen name safe to log: printable ASCII only, at
// most 64 bytes, the rest replaced or cut with a note of the length.
func logName(s string) string {
	const most = 64
	var b strings.Builder
	for i := 0; i < len(s) && b.Len() < most; i++ {
		if c := s[i]; c >= 0x20 && c < 0x7f {
			b.WriteByte(c)
		} else {
			b.WriteByte('?')
		}
	}
	if len(s) > most {
		fmt.Fprintf(&b, "...(%d bytes)", len(s))
	}
	return b.String()
}
