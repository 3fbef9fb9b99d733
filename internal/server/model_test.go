package server_test

// The model test drives the real server (a real socket, the books over a
// memfd, a keeper stand-in that holds the books' memfd) through random
// operations, restarts it from its books at random points, and compares
// every session, stream and stream byte with a reference model after each
// restart and every few steps. The operations are those a client, a
// second process of the same pod and a restart can combine: opens
// (resumes, replacements of a disconnected owner, opens refused for
// capacity or by a limit, which leave the owner's session as it was),
// offloads and reloads of every length (long ones split into pages
// packets and fetched with more),
// cut in the middle (after some pages packets, after the request, during
// the more fetch) and resent with the same sequence number as the Go
// client does, limit refusals, discards, remove_request, close,
// disconnects and new client processes.
//
// Its default run is short. KVPOOL_MODEL_SEEDS (default 6) and
// KVPOOL_MODEL_STEPS (default 300) make it longer; KVPOOL_MODEL_SEED runs
// one seed (the one a failure names).

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/internal/books"
	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/wire"
)

const (
	mPageSize   = 256     // bytes per host page (one region of 256 bytes)
	mChunkBytes = 2 << 20 // 8192 host pages per chunk
	mPPC        = mChunkBytes / mPageSize
	mDevPages   = 30000 // device pages of the layout: lists up to it, longer than a packet
)

// mLimits are small enough that the model reaches every bound often.
var mLimits = server.Limits{MaxStreamsPerSession: 8, MaxNameBytesPerSession: 64, MaxSessionsPerAllocation: 2}

type mKey struct {
	alloc string
	gpu   int
}

// mLayout is the pool: allocation A holds 4 chunks of GPU 0 and one of
// GPUs 1 and 2, B four of GPU 0. Sessions bind by locality and share an
// allocation fairly among its ranks, one per GPU its chunks name (pool
// OpenNear): the model books each session's share by the same rule
// (predictOpen), not its GPU's own chunks.
var mLayout = map[mKey]int{{"A", 0}: 4, {"A", 1}: 1, {"A", 2}: 1, {"B", 0}: 4}

var mTokens = map[string]string{"tok-a": "A", "tok-b": "B"}

var mGPUs = map[string]int{gpuUUID(0): 0, gpuUUID(1): 1, gpuUUID(2): 2}

// mRig is the server under test, restartable from its books.
type mRig struct {
	t      testing.TB
	chunks map[string]*hostmem.Chunk
	store  *fdStore
	pool   *pool.Pool
	books  *books.Books
	srv    *server.Server
	socket string
	cancel context.CancelFunc
	done   chan error
}

func newRig(t testing.TB) *mRig {
	r := &mRig{t: t, chunks: map[string]*hostmem.Chunk{}, store: &fdStore{}, pool: pool.New(),
		socket: filepath.Join(t.TempDir(), "kv.sock")}
	b, err := books.Start(books.NewState(), 0, r.store, func(err error) { t.Errorf("books: %v", err) })
	if err != nil {
		t.Fatal(err)
	}
	r.books = b
	r.pool.SetJournal(b)
	grants := map[string][]string{}
	for _, k := range []mKey{{"A", 0}, {"A", 1}, {"A", 2}, {"B", 0}} {
		for i := range mLayout[k] {
			id := fmt.Sprintf("%s-gpu%d-%d", k.alloc, k.gpu, i)
			hc, err := hostmem.Alloc(hostmem.Options{Size: mChunkBytes})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { hc.Close() })
			r.chunks[id] = hc
			if err := r.pool.AddChunk(pool.Chunk{ID: id, GPU: k.gpu, NUMA: -1, Size: mChunkBytes}); err != nil {
				t.Fatal(err)
			}
			grants[k.alloc] = append(grants[k.alloc], id)
		}
	}
	for alloc, ids := range grants {
		if err := r.pool.Grant(alloc, ids); err != nil {
			t.Fatal(err)
		}
	}
	r.serve(nil)
	t.Cleanup(r.stop)
	return r
}

func (r *mRig) serve(restore []server.RestoredSession) {
	srv, err := server.New(server.Options{Pool: r.pool, Logger: quiet, Journal: r.books, GPUs: mGPUs,
		Limits: mLimits, SweepInterval: time.Hour,
		Chunks:    func(id string) (*hostmem.Chunk, bool) { c, ok := r.chunks[id]; return c, ok },
		Authorize: server.StaticTokens(mTokens)})
	if err != nil {
		r.t.Fatal(err)
	}
	if err := srv.Restore(restore); err != nil {
		r.t.Fatal(err)
	}
	l, err := server.Listen(r.socket)
	if err != nil {
		r.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.srv, r.cancel, r.done = srv, cancel, make(chan error, 1)
	go func() { r.done <- srv.Serve(ctx, l) }()
}

// stop ends the server and unmaps the books, as the death of the agent
// does; the store keeps the books' memfd.
func (r *mRig) stop() {
	if r.cancel == nil {
		return
	}
	r.cancel()
	<-r.done
	r.cancel = nil
	r.books.Close()
}

// restart rebuilds the pool and the server from the books, as a new agent
// does at start.
func (r *mRig) restart() error {
	r.stop()
	st, info, err := books.Load(r.store.f)
	if err != nil {
		return fmt.Errorf("load the books: %w", err)
	}
	p := pool.New()
	ss, err := p.Restore(st.Image())
	if err != nil {
		return fmt.Errorf("restore the pool from the books: %w", err)
	}
	b, err := books.Start(st, info.Gen, r.store, func(err error) { r.t.Errorf("books: %v", err) })
	if err != nil {
		return err
	}
	p.SetJournal(b)
	r.pool, r.books = p, b
	r.serve(st.Restored(ss))
	return nil
}

// The reference model.

type mStream struct {
	meta  pool.Meta
	pages []int32 // host pages, in device page order
	seed  uint64  // the bytes the client wrote (pattern)
}

type mSession struct {
	id       uint64
	inst     string // hex
	maxPages int    // as opened: a resume must name the same layout
	capacity int
	ticket   uint64
	streams  map[[2]string]*mStream
	order    map[string][]string // rid -> labels in offload order
}

func (s *mSession) names() (n int64) {
	for k := range s.streams {
		n += int64(len(k[0]) + len(k[1]))
	}
	return n
}

func (s *mSession) used() (n int) {
	for _, x := range s.streams {
		n += len(x.pages)
	}
	return n
}

func (s *mSession) drop(rid, label string) {
	delete(s.streams, [2]string{rid, label})
	s.order[rid] = slices.DeleteFunc(s.order[rid], func(l string) bool { return l == label })
	if len(s.order[rid]) == 0 {
		delete(s.order, rid)
	}
}

// mClient is one client process: an instance ID, its sequence numbers and
// its connection (nil while disconnected).
type mClient struct {
	name       string
	token      string
	gpu        int
	inst       []byte
	seq        uint32
	conn       *wire.Conn
	sid        uint64 // the session it holds on conn; 0 none
	chunks     []string
	ppc        int
	lastTicket uint64
	fenceSent  uint64
	buf        []byte
}

func (c *mClient) key() mKey { return mKey{mTokens[c.token], c.gpu} }

type modelRun struct {
	t        *testing.T
	seed     uint64
	rng      *rand.Rand
	rig      *mRig
	sessions map[mKey]*mSession
	clients  []*mClient
	log      []string
	step     int
	content  uint64
}

func (m *modelRun) logf(format string, args ...any) {
	m.log = append(m.log, fmt.Sprintf("%4d ", m.step)+fmt.Sprintf(format, args...))
	if os.Getenv("KVPOOL_MODEL_TRACE") != "" {
		fmt.Println(m.log[len(m.log)-1])
	}
	if len(m.log) > 60 {
		m.log = m.log[1:]
	}
}

// fail reports a difference from the model with the seed and the last
// operations.
func (m *modelRun) fail(format string, args ...any) {
	m.t.Helper()
	m.t.Fatalf("model seed %d, step %d: %s\nrerun: KVPOOL_MODEL_SEED=%d go test -run TestServerModel ./internal/server/\nlast operations:\n%s",
		m.seed, m.step, fmt.Sprintf(format, args...), m.seed, strings.Join(m.log, "\n"))
}

func envNum(t *testing.T, name string, def uint64) uint64 {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		t.Fatalf("%s=%q: %v", name, v, err)
	}
	return n
}

func TestServerModel(t *testing.T) {
	seeds := envNum(t, "KVPOOL_MODEL_SEEDS", 6)
	steps := int(envNum(t, "KVPOOL_MODEL_STEPS", 300))
	first := uint64(1)
	if s := envNum(t, "KVPOOL_MODEL_SEED", 0); s != 0 {
		first, seeds = s, 1
	}
	for seed := first; seed < first+seeds; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) { runModel(t, seed, steps) })
	}
}

func runModel(t *testing.T, seed uint64, steps int) {
	m := &modelRun{t: t, seed: seed, rng: rand.New(rand.NewPCG(seed, 0x6b76)), rig: newRig(t), sessions: map[mKey]*mSession{}}
	for i, spec := range []struct {
		tok string
		gpu int
	}{{"tok-a", 0}, {"tok-a", 0}, {"tok-a", 1}, {"tok-a", 2}, {"tok-b", 0}, {"tok-b", 0}} {
		c := &mClient{name: fmt.Sprint("c", i), token: spec.tok, gpu: spec.gpu, buf: make([]byte, wire.MaxMessage+1)}
		c.inst = m.newInstance()
		m.clients = append(m.clients, c)
	}
	for m.step = 0; m.step < steps; m.step++ {
		m.doStep()
		if m.step%20 == 19 {
			m.check("periodic")
		}
	}
	m.restart(true)
}

func (m *modelRun) newInstance() []byte {
	b := make([]byte, 16)
	for i := range b {
		b[i] = byte(m.rng.UintN(256))
	}
	return b
}

func (m *modelRun) doStep() {
	if m.rng.IntN(100) < 3 {
		m.restart(true)
		return
	}
	c := m.clients[m.rng.IntN(len(m.clients))]
	if c.conn == nil && m.rng.IntN(100) < 70 {
		// Mostly a client that holds its session: most of a client's
		// life is its requests.
		for _, i := range m.rng.Perm(len(m.clients)) {
			if m.clients[i].sid != 0 {
				c = m.clients[i]
				break
			}
		}
	}
	if c.conn == nil {
		if m.rng.IntN(100) < 10 {
			c.inst = m.newInstance() // a new process of the pod
			c.seq, c.lastTicket = 0, 0
			m.logf("%s is a new process", c.name)
		}
		m.open(c)
		return
	}
	switch x := m.rng.IntN(100); {
	case x < 40:
		m.offload(c)
	case x < 62:
		m.reload(c)
	case x < 70:
		m.discard(c)
	case x < 75:
		m.removeRequest(c)
	case x < 88:
		m.usage(c)
	case x < 90:
		m.closeSession(c)
	default:
		m.disconnect(c)
	}
}

// restart restarts the server from its books and compares it with the
// model, unless an exchange is cut and unresolved (check false): its
// request may or may not have been carried out until it is resent.
func (m *modelRun) restart(check bool) {
	m.logf("restart")
	for _, c := range m.clients {
		if c.conn != nil {
			c.conn.Close()
			c.conn, c.sid = nil, 0
		}
	}
	if err := m.rig.restart(); err != nil {
		m.fail("%v", err)
	}
	if check {
		m.check("after a restart")
	}
}

// check compares the server's sessions, the pool's streams and their
// bytes, and the books with the model.
func (m *modelRun) check(when string) {
	m.t.Helper()
	infos := m.rig.srv.Sessions()
	if len(infos) != len(m.sessions) {
		m.fail("%s: the server holds %d sessions %v, the model %d %v", when, len(infos), sessionKeys(infos), len(m.sessions), m.keys())
	}
	for _, in := range infos {
		ms := m.sessions[mKey{in.Allocation, in.GPU}]
		if ms == nil || ms.id != in.ID || in.Instance != short(ms.inst) {
			m.fail("%s: the server holds session %d of %s GPU %d (instance %s); the model %+v", when, in.ID, in.Allocation, in.GPU, in.Instance, ms)
		}
	}
	img := m.rig.pool.Export()
	for _, si := range img.Sessions {
		ms := m.sessions[mKey{si.Allocation, si.Spec.GPU}]
		if ms == nil || ms.id != si.ID {
			m.fail("%s: the pool holds session %d of %s GPU %d, the model does not", when, si.ID, si.Allocation, si.Spec.GPU)
		}
		if si.Capacity != ms.capacity {
			m.fail("%s: session %d capacity %d, the model %d", when, si.ID, si.Capacity, ms.capacity)
		}
		n := 0
		for _, q := range si.Requests {
			n += len(q.Streams)
		}
		if n != len(ms.streams) {
			m.fail("%s: session %d holds %d streams %+v, the model %d", when, si.ID, n, si.Requests, len(ms.streams))
		}
		for _, q := range si.Requests {
			for _, st := range q.Streams {
				x := ms.streams[[2]string{q.Rid, st.Label}]
				if x == nil || x.meta != st.Meta || !slices.Equal(x.pages, st.Pages) {
					m.fail("%s: session %d stream %s/%s: pool %v %v, model %+v", when, si.ID, q.Rid, st.Label, st.Meta, short32(st.Pages), x)
				}
				m.verify(si.Chunks, si.PPC, x, when)
			}
		}
	}
	if err := m.rig.books.Check(img); err != nil {
		m.fail("%s: %v", when, err)
	}
}

func sessionKeys(infos []server.SessionInfo) []string {
	var out []string
	for _, in := range infos {
		out = append(out, fmt.Sprintf("%s/%d#%d", in.Allocation, in.GPU, in.ID))
	}
	return out
}

func (m *modelRun) keys() []string {
	var out []string
	for k, s := range m.sessions {
		out = append(out, fmt.Sprintf("%s/%d#%d", k.alloc, k.gpu, s.id))
	}
	return out
}

func short(inst string) string {
	h := sha256.Sum256([]byte(inst))
	return hex.EncodeToString(h[:4])
}

func short32(p []int32) string {
	if len(p) > 8 {
		return fmt.Sprintf("%v...(%d)", p[:8], len(p))
	}
	return fmt.Sprint(p)
}

// page returns host page p of a session bound to chunks.
func (m *modelRun) page(chunks []string, ppc int, p int32) []byte {
	ch := m.rig.chunks[chunks[int(p)/ppc]]
	off := (int(p) % ppc) * mPageSize
	return ch.Mem[off : off+mPageSize]
}

func word(seed uint64, i int) uint64 {
	x := seed ^ uint64(i)*0x9e3779b97f4a7c15
	x ^= x >> 31
	x *= 0xbf58476d1ce4e5b9
	return x ^ x>>29
}

// write fills the stream's host pages with its pattern, as the client's
// copies would.
func (m *modelRun) write(c *mClient, x *mStream) {
	for i, p := range x.pages {
		pg := m.page(c.chunks, c.ppc, p)
		w := word(x.seed, i)
		for o := 0; o < mPageSize; o += 8 {
			binary.LittleEndian.PutUint64(pg[o:], w+uint64(o))
		}
	}
}

func (m *modelRun) verify(chunks []string, ppc int, x *mStream, when string) {
	m.t.Helper()
	for i, p := range x.pages {
		pg := m.page(chunks, ppc, p)
		w := word(x.seed, i)
		for o := 0; o < mPageSize; o += 8 {
			if binary.LittleEndian.Uint64(pg[o:]) != w+uint64(o) {
				m.fail("%s: stream page %d (host page %d) holds other bytes than the stream's", when, i, p)
			}
		}
	}
}

// The client side: packets by hand, as test/adversarial and raw do.

var errCut = errors.New("connection closed")

func (c *mClient) send(op wire.Op, seq uint32, fence uint64, m proto.Message) error {
	pkt, err := wire.AppendPacket(nil, wire.Header{Op: op, Seq: seq, Fence: fence}, m)
	if err != nil {
		return err
	}
	return c.conn.Send(pkt, nil)
}

// recv reads the reply to seq: its status, and its body decoded into rep
// (or the error message).
func (c *mClient) recv(seq uint32, rep proto.Message) (wire.Status, string, error) {
	c.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	pkt, files, err := c.conn.Recv(c.buf)
	for _, f := range files {
		f.Close()
	}
	if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
		return 0, "", errCut
	}
	if err != nil {
		return 0, "", err
	}
	h, body, err := wire.ParseHeader(pkt)
	if err != nil {
		return 0, "", err
	}
	if h.Seq != seq {
		return 0, "", fmt.Errorf("reply seq %d, want %d", h.Seq, seq)
	}
	if h.Status != wire.StatusOK {
		var e wire.Error
		if err := wire.DecodeBody(body, &e); err != nil {
			return 0, "", err
		}
		return h.Status, e.Message, nil
	}
	if rep == nil {
		if len(body) != 0 {
			return 0, "", fmt.Errorf("%d bytes of body where none belong", len(body))
		}
		return 0, "", nil
	}
	return 0, "", wire.DecodeBody(body, rep)
}

// do sends one request of the session (with the fence of its last
// reload) and reads its reply.
func (m *modelRun) do(c *mClient, op wire.Op, seq uint32, req, rep proto.Message) (wire.Status, string) {
	m.t.Helper()
	if err := c.send(op, seq, c.fence(), req); err != nil {
		m.fail("%s %s: send: %v", c.name, op, err)
	}
	st, msg, err := c.recv(seq, rep)
	if err != nil {
		m.fail("%s %s: %v", c.name, op, err)
	}
	c.fenceSent = c.lastTicket
	return st, msg
}

func (c *mClient) fence() uint64 {
	if c.lastTicket > c.fenceSent {
		return c.lastTicket
	}
	return 0
}

func (c *mClient) next() uint32 { c.seq++; return c.seq }

// disconnect closes c's connection and waits until the server has seen it.
func (m *modelRun) disconnect(c *mClient) {
	m.logf("%s disconnects", c.name)
	m.drop(c)
}

func (m *modelRun) drop(c *mClient) {
	if c.conn == nil {
		return
	}
	c.conn.Close()
	c.conn = nil
	sid := c.sid
	c.sid = 0
	if sid == 0 {
		return
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		busy := false
		for _, in := range m.rig.srv.Sessions() {
			if in.ID == sid && in.Connected {
				busy = true
			}
		}
		if !busy {
			return
		}
		if time.Now().After(deadline) {
			m.fail("session %d still connected 10s after its connection closed", sid)
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// open connects c and opens (or resumes) its session, checking the answer
// against the model.
func (m *modelRun) open(c *mClient) {
	maxPages := []int{0, 0, 5000, mPPC, 30000, 40000}[m.rng.IntN(6)]
	if s := m.sessions[c.key()]; s != nil && s.inst == hex.EncodeToString(c.inst) {
		maxPages = s.maxPages // its own session: resumed with its layout
	}
	m.openWith(c, maxPages, false)
}

// openWith connects and opens; mustResume is set when c reconnects after
// a cut, and the model says the session is its.
func (m *modelRun) openWith(c *mClient, maxPages int, mustResume bool) bool {
	m.t.Helper()
	k := c.key()
	conn, err := wire.Dial(m.rig.socket)
	if err != nil {
		m.fail("dial: %v", err)
	}
	c.conn, c.fenceSent = conn, 0
	seq := c.next()
	if err := c.send(wire.OpHello, seq, 0, &wire.Hello{Version: wire.Version, Client: c.name}); err != nil {
		m.fail("hello: %v", err)
	}
	if st, msg, err := c.recv(seq, &wire.HelloReply{}); err != nil || st != 0 {
		m.fail("hello: %v %s %s", err, st, msg)
	}
	inst := hex.EncodeToString(c.inst)
	want, capacity, wantSt := m.predictOpen(c, k, inst, maxPages)
	seq = c.next()
	open := &wire.Open{Token: c.token, GpuUuid: gpuUUID(uint32(c.gpu)), InstanceId: c.inst, MaxPages: uint32(maxPages),
		Regions: []*wire.Region{{BytesPerPage: mPageSize, PageCount: mDevPages}}}
	if err := c.send(wire.OpOpen, seq, 0, open); err != nil {
		m.fail("open: %v", err)
	}
	var rep wire.OpenReply
	st, msg, err := c.recv(seq, &rep)
	if err != nil {
		m.fail("open: %v", err)
	}
	m.logf("%s opens %s/%d max %d: %s %s (session %d resumed %v; model %s)", c.name, k.alloc, k.gpu, maxPages, st, msg, rep.Session, rep.Resumed, wantSt)
	if st != wantSt {
		m.fail("%s open: status %s %q, the model says %s", c.name, st, msg, wantSt)
	}
	if mustResume && (st != 0 || !rep.Resumed) {
		m.fail("%s: reconnecting after a cut did not resume its session", c.name)
	}
	if st != 0 {
		m.drop(c) // the client gives up
		return false
	}
	s := m.sessions[k]
	if want == "resume" {
		if !rep.Resumed || rep.Session != s.id || int(rep.Capacity) != s.capacity {
			m.fail("%s: want a resume of session %d (capacity %d), got %+v", c.name, s.id, s.capacity, &rep)
		}
	} else {
		if rep.Resumed {
			m.fail("%s: a new session came back resumed: %+v", c.name, &rep)
		}
		if s != nil && rep.Session <= s.id {
			m.fail("%s: the new session has ID %d, not above the replaced one's %d", c.name, rep.Session, s.id)
		}
		if int(rep.Capacity) != capacity {
			m.fail("%s: capacity %d, the model %d", c.name, rep.Capacity, capacity)
		}
		m.sessions[k] = &mSession{id: rep.Session, inst: inst, maxPages: maxPages, capacity: capacity, streams: map[[2]string]*mStream{}, order: map[string][]string{}}
		c.lastTicket = 0
	}
	c.sid, c.ppc = rep.Session, int(rep.PagesPerChunk)
	c.chunks = c.chunks[:0]
	for _, g := range rep.Chunks {
		c.chunks = append(c.chunks, g.Id)
	}
	return true
}

// predictOpen is what the model expects of an open: "resume" or "new"
// with status 0 and the new session's capacity, or the refusal's status.
// A replacement counts the disconnected owner's session as gone for the
// bounds and the share; the session is gone only once the open succeeds
// (openWith puts the new one in its place), a refusal leaves it as it was.
func (m *modelRun) predictOpen(c *mClient, k mKey, inst string, maxPages int) (string, int, wire.Status) {
	s := m.sessions[k]
	if s != nil && s.inst == inst {
		return "resume", s.capacity, 0
	}
	if s != nil {
		for _, o := range m.clients {
			if o.conn != nil && o.sid == s.id {
				return "", 0, wire.StatusBusy
			}
		}
	}
	replacing := s != nil
	n := 0
	for kk := range m.sessions {
		if kk.alloc == k.alloc && (kk != k || !replacing) {
			n++
		}
	}
	if n >= mLimits.MaxSessionsPerAllocation {
		return "", 0, wire.StatusLimit
	}
	// The share (pkg/pool bind.go): the allocation's unbound chunks, split
	// among its ranks without a session yet (at least this one).
	total, ranks, bound := 0, 0, 0
	for kk, chunks := range mLayout {
		if kk.alloc == k.alloc {
			total += chunks
			ranks++
		}
	}
	for kk, o := range m.sessions {
		if kk.alloc == k.alloc && (kk != k || !replacing) {
			bound += (o.capacity + mPPC - 1) / mPPC
		}
	}
	unbound, waiting := total-bound, max(1, ranks-n)
	if unbound == 0 {
		return "", 0, wire.StatusNoCapacity
	}
	if maxPages == 0 {
		return "new", (unbound + waiting - 1) / waiting * mPPC, 0
	}
	if want, limit := (maxPages+mPPC-1)/mPPC, unbound-(waiting-1)*(unbound/waiting); want > limit {
		return "", 0, wire.StatusNoCapacity
	}
	return "new", maxPages, 0
}

var (
	mRids   = []string{"r0", "r1", "r2", "request-07", "request-08-of-a-long-name"}
	mLabels = []string{"k", "v", "group-2"}
)

// cut is where a long exchange is interrupted.
type cut int

const (
	cutNone       cut = iota
	cutAfterPages     // some pages packets sent, then the connection closes
	cutAfterSend      // the request sent, its reply never read
	cutInMore         // the first packet of a long reply read, then closed
)

func (m *modelRun) pickCut(long bool) cut {
	x := m.rng.IntN(100)
	switch {
	case long && x < 12:
		return cutAfterPages
	case x < 20:
		return cutAfterSend
	case long && x < 30:
		return cutInMore
	}
	return cutNone
}

func (m *modelRun) devPages(n int) []int32 {
	perm := m.rng.Perm(mDevPages)[:n]
	out := make([]int32, n)
	for i, p := range perm {
		out[i] = int32(p)
	}
	return out
}

func (m *modelRun) pickLen(s *mSession) int {
	switch x := m.rng.IntN(100); {
	case x < 5:
		return 0
	case x < 25 && s.capacity > wire.MaxPagesPerPacket:
		return wire.MaxPagesPerPacket + 1 + m.rng.IntN(mDevPages-wire.MaxPagesPerPacket)
	case x < 18:
		return 1 + m.rng.IntN(3000)
	}
	return 1 + m.rng.IntN(12)
}

// exchange sends an offload or reload whose device pages may need pages
// packets, and reads its whole answer (fetching the rest with more). It
// stops where cut says, closing the connection; done reports whether the
// answer came whole.
func (m *modelRun) exchange(c *mClient, op wire.Op, seq uint32, dev []int32, build func(rest []int32) proto.Message,
	rep proto.Message, at cut) (st wire.Status, msg string, pages []int32, done bool) {
	m.t.Helper()
	head := len(dev) - len(dev)%wire.MaxPagesPerPacket
	if head == len(dev) && head > 0 {
		head -= wire.MaxPagesPerPacket
	}
	nPackets := head / wire.MaxPagesPerPacket
	for i := range nPackets {
		if at == cutAfterPages && i == nPackets/2 {
			m.drop(c)
			return 0, "", nil, false
		}
		pseq := c.next()
		part := dev[i*wire.MaxPagesPerPacket : (i+1)*wire.MaxPagesPerPacket]
		if s, msg := m.do(c, wire.OpPages, pseq, &wire.Pages{GpuPages: part}, nil); s != 0 {
			m.fail("%s pages: %s %s", c.name, s, msg)
		}
	}
	if at == cutAfterPages {
		m.drop(c)
		return 0, "", nil, false
	}
	if err := c.send(op, seq, c.fence(), build(dev[head:])); err != nil {
		m.fail("%s %s: send: %v", c.name, op, err)
	}
	if at == cutAfterSend {
		m.drop(c)
		return 0, "", nil, false
	}
	st, msg, err := c.recv(seq, rep)
	if err != nil {
		m.fail("%s %s: %v", c.name, op, err)
	}
	c.fenceSent = c.lastTicket
	if st != 0 {
		return st, msg, nil, true
	}
	var total uint32
	switch r := rep.(type) {
	case *wire.OffloadReply:
		pages, total = slices.Clone(r.HostPages), r.Total
	case *wire.ReloadReply:
		pages, total = slices.Clone(r.HostPages), r.Total
	}
	if total == 0 {
		return st, msg, pages, true
	}
	if at == cutInMore {
		m.drop(c)
		return 0, "", pages, false
	}
	pages, ok := m.more(c, pages, int(total))
	return st, msg, pages, ok
}

func (m *modelRun) more(c *mClient, pages []int32, total int) ([]int32, bool) {
	m.t.Helper()
	for len(pages) < total {
		var mr wire.MoreReply
		st, msg := m.do(c, wire.OpMore, c.next(), &wire.More{Offset: uint32(len(pages))}, &mr)
		if st != 0 || len(mr.HostPages) == 0 {
			m.fail("%s more from %d of %d: %s %s", c.name, len(pages), total, st, msg)
		}
		pages = append(pages, mr.HostPages...)
	}
	return pages, true
}

// finish completes an exchange that was cut: c reconnects (after a
// restart, sometimes), resumes its session and resends the request with
// the same sequence number, as the Go client does; cut in the middle of
// the more fetch and without a restart, it may go on with more instead.
func (m *modelRun) finish(c *mClient, op wire.Op, seq uint32, dev []int32, build func([]int32) proto.Message,
	rep proto.Message, at cut, got []int32) (wire.Status, string, []int32) {
	m.t.Helper()
	restarted := m.rng.IntN(100) < 25
	if restarted {
		m.restart(false)
	}
	m.logf("%s reconnects after a cut (%d) of its %s, seq %d", c.name, at, op, seq)
	if !m.openWith(c, m.sessions[c.key()].maxPages, true) {
		m.fail("unreachable")
	}
	if at == cutInMore && !restarted && m.rng.IntN(2) == 0 {
		total := len(dev)
		pages, _ := m.more(c, got, total)
		var st wire.Status
		return st, "", pages
	}
	st, msg, pages, _ := m.exchange(c, op, seq, dev, build, rep, cutNone)
	return st, msg, pages
}

func (m *modelRun) offload(c *mClient) {
	s := m.sessions[c.key()]
	rid, label := mRids[m.rng.IntN(len(mRids))], mLabels[m.rng.IntN(len(mLabels))]
	n := m.pickLen(s)
	dev := m.devPages(n)
	meta := pool.Meta{StoredLen: m.rng.Int64N(1 << 20), Position: m.rng.Int64N(1 << 20), Released: m.rng.Int64N(4)}
	at := m.pickCut(n > wire.MaxPagesPerPacket)
	seq := c.next()
	build := func(rest []int32) proto.Message {
		return &wire.Offload{Rid: rid, Label: label, GpuPages: rest, StoredLen: meta.StoredLen, Position: meta.Position, Released: meta.Released}
	}
	var rep wire.OffloadReply
	st, msg, pages, done := m.exchange(c, wire.OpOffload, seq, dev, build, &rep, at)
	if !done && at == cutAfterPages {
		m.logf("%s offload %s/%s of %d pages cut after its pages packets: abandoned", c.name, rid, label, n)
		return
	}
	if !done {
		st, msg, pages = m.finish(c, wire.OpOffload, seq, dev, build, &rep, at, pages)
		s = m.sessions[c.key()]
	}
	ok := st == 0 && rep.Ok
	m.logf("%s offload %s/%s of %d pages (cut %d): %s %s ok %v, %d host pages", c.name, rid, label, n, at, st, msg, ok, len(pages))
	// The model's answer.
	k := [2]string{rid, label}
	var want wire.Status
	wantOK := false
	switch {
	case len(s.streams) >= mLimits.MaxStreamsPerSession,
		s.names()+int64(len(rid)+len(label)) > mLimits.MaxNameBytesPerSession:
		want = wire.StatusLimit
	case s.streams[k] != nil:
		want = wire.StatusDuplicateStream
	case n == 0, n > s.capacity-s.used():
	default:
		wantOK = true
	}
	if st != want || ok != wantOK {
		m.fail("%s offload %s/%s of %d pages: status %s ok %v (%s), the model says %s ok %v", c.name, rid, label, n, st, ok, msg, want, wantOK)
	}
	if st == wire.StatusLimit && m.rng.IntN(100) < 60 {
		// The engine makes room: it reloads a stream next.
		m.reload(c)
		return
	}
	if !ok {
		return
	}
	if len(pages) != n {
		m.fail("%s offload of %d pages: %d host pages (total %d)", c.name, n, len(pages), rep.Total)
	}
	taken := map[int32]bool{}
	for _, x := range s.streams {
		for _, p := range x.pages {
			taken[p] = true
		}
	}
	for _, p := range pages {
		if p < 0 || int(p) >= s.capacity || taken[p] {
			m.fail("%s offload: host page %d outside the session or held by another stream", c.name, p)
		}
		taken[p] = true
	}
	m.content++
	x := &mStream{meta: meta, pages: pages, seed: m.seed<<32 ^ m.content}
	s.streams[k] = x
	s.order[rid] = append(s.order[rid], label)
	m.write(c, x)
}

// pickStream picks one of the session's streams, or (sometimes) one it
// does not hold.
func (m *modelRun) pickStream(s *mSession) (string, string) {
	if len(s.streams) == 0 || m.rng.IntN(100) < 10 {
		return mRids[m.rng.IntN(len(mRids))], mLabels[m.rng.IntN(len(mLabels))]
	}
	ks := make([][2]string, 0, len(s.streams))
	for k := range s.streams {
		ks = append(ks, k)
	}
	slices.SortFunc(ks, func(a, b [2]string) int { return strings.Compare(a[0]+"/"+a[1], b[0]+"/"+b[1]) })
	k := ks[m.rng.IntN(len(ks))]
	return k[0], k[1]
}

func (m *modelRun) reload(c *mClient) {
	s := m.sessions[c.key()]
	rid, label := m.pickStream(s)
	x := s.streams[[2]string{rid, label}]
	n := m.rng.IntN(5)
	if x != nil && m.rng.IntN(100) < 95 {
		n = len(x.pages)
	}
	dev := m.devPages(n)
	at := m.pickCut(n > wire.MaxPagesPerPacket)
	seq := c.next()
	build := func(rest []int32) proto.Message { return &wire.Reload{Rid: rid, Label: label, GpuPages: rest} }
	var rep wire.ReloadReply
	st, msg, pages, done := m.exchange(c, wire.OpReload, seq, dev, build, &rep, at)
	if !done && at == cutAfterPages {
		m.logf("%s reload %s/%s cut after its pages packets: abandoned", c.name, rid, label)
		return
	}
	if !done {
		st, msg, pages = m.finish(c, wire.OpReload, seq, dev, build, &rep, at, pages)
		s = m.sessions[c.key()]
	}
	m.logf("%s reload %s/%s of %d pages (cut %d): %s %s, %d host pages, ticket %d", c.name, rid, label, n, at, st, msg, len(pages), rep.Ticket)
	var want wire.Status
	switch {
	case x == nil:
		want = wire.StatusUnknownStream
	case n != len(x.pages):
		want = wire.StatusPageCount
	}
	if st != want {
		m.fail("%s reload %s/%s: status %s (%s), the model says %s", c.name, rid, label, st, msg, want)
	}
	if st != 0 {
		return
	}
	got := pool.Meta{StoredLen: rep.StoredLen, Position: rep.Position, Released: rep.Released}
	if !slices.Equal(pages, x.pages) || got != x.meta {
		m.fail("%s reload %s/%s: pages %s meta %v, the model %s %v", c.name, rid, label, short32(pages), got, short32(x.pages), x.meta)
	}
	m.verify(c.chunks, c.ppc, x, "reload")
	if n > 0 {
		s.ticket++
		if rep.Ticket != s.ticket {
			m.fail("%s reload: ticket %d, the model %d", c.name, rep.Ticket, s.ticket)
		}
		c.lastTicket = rep.Ticket // the copy is done: fenced on the next request
	}
	s.drop(rid, label)
}

func (m *modelRun) discard(c *mClient) {
	s := m.sessions[c.key()]
	rid, label := m.pickStream(s)
	st, msg := m.do(c, wire.OpDiscard, c.next(), &wire.Stream{Rid: rid, Label: label}, nil)
	m.logf("%s discard %s/%s: %s %s", c.name, rid, label, st, msg)
	if st != 0 {
		m.fail("%s discard: %s %s", c.name, st, msg)
	}
	s.drop(rid, label)
}

func (m *modelRun) removeRequest(c *mClient) {
	s := m.sessions[c.key()]
	rid, _ := m.pickStream(s)
	var rep wire.RemoveRequestReply
	st, msg := m.do(c, wire.OpRemoveRequest, c.next(), &wire.Request{Rid: rid}, &rep)
	m.logf("%s remove_request %s: %s %s removed %d", c.name, rid, st, msg, rep.Removed)
	if st != 0 || int(rep.Removed) != len(s.order[rid]) {
		m.fail("%s remove_request %s: %s %s removed %d, the model %d", c.name, rid, st, msg, rep.Removed, len(s.order[rid]))
	}
	for _, l := range slices.Clone(s.order[rid]) {
		s.drop(rid, l)
	}
}

func (m *modelRun) usage(c *mClient) {
	s := m.sessions[c.key()]
	var u wire.UsageReply
	st, msg := m.do(c, wire.OpUsage, c.next(), nil, &u)
	if st != 0 || int(u.Capacity) != s.capacity || int(u.Used) != s.used() || int(u.Streams) != len(s.streams) ||
		int(u.Requests) != len(s.order) || u.Pending != 0 {
		m.fail("%s usage: %s %s %+v, the model capacity %d used %d streams %d requests %d", c.name, st, msg, &u,
			s.capacity, s.used(), len(s.streams), len(s.order))
	}
	rid, _ := m.pickStream(s)
	var lr wire.LabelsReply
	if st, msg := m.do(c, wire.OpLabels, c.next(), &wire.Request{Rid: rid}, &lr); st != 0 || !slices.Equal(lr.Labels, s.order[rid]) {
		m.fail("%s labels %s: %s %s %q, the model %q", c.name, rid, st, msg, lr.Labels, s.order[rid])
	}
}

func (m *modelRun) closeSession(c *mClient) {
	st, msg := m.do(c, wire.OpClose, c.next(), nil, nil)
	m.logf("%s closes its session: %s %s", c.name, st, msg)
	if st != 0 {
		m.fail("%s close: %s %s", c.name, st, msg)
	}
	delete(m.sessions, c.key())
	c.sid = 0
	m.drop(c)
}
