package books

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sync/errgroup"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/unixsock"
	"github.com/kvpool/kvpool/pkg/wire"
)

// Record types: the first byte of a record's payload.
const (
	recSnapshot = 1
	recEvent    = 2
	recChunkGen = 3
	recSession  = 4
	// recSnapshotPart is one part of a snapshot (format version 2): a
	// flags byte (partLast, partSession), then the next bytes of the
	// snapshot.
	recSnapshotPart = 5
)

// Flags of a snapshot part. partSession marks a part that begins a
// session: a writer begins each session in a part of its own, so that a
// reader decodes the sessions side by side (decodeSnapshot). A reader
// that ignores it (an agent before it) reads the same snapshot.
const (
	partLast    = 1
	partSession = 2
)

// ErrCorrupt wraps every decoding failure of a record.
var ErrCorrupt = errors.New("books: corrupt record")

type enc []byte

func (e enc) u(v uint64) enc { return binary.AppendUvarint(e, v) }
func (e enc) i(v int64) enc  { return binary.AppendVarint(e, v) }
func (e enc) str(s string) enc {
	return append(e.u(uint64(len(s))), s...)
}
func (e enc) bytes(b []byte) enc { return append(e.u(uint64(len(b))), b...) }
func (e enc) strs(ss []string) enc {
	e = e.u(uint64(len(ss)))
	for _, s := range ss {
		e = e.str(s)
	}
	return e
}
func (e enc) pages(ps []int32) enc {
	e = e.u(uint64(len(ps)))
	for _, p := range ps {
		e = e.u(uint64(uint32(p)))
	}
	return e
}
func (e enc) meta(m pool.Meta) enc { return e.i(m.StoredLen).i(m.Position).i(m.Released) }
func (e enc) peer(p unixsock.Peer) enc {
	return e.i(int64(p.PID)).u(uint64(p.UID)).u(uint64(p.GID))
}

// dec reads a record's payload, or a snapshot written in parts
// (segments): a value may span two segments.
type dec struct {
	b       []byte   // the unread bytes of the current segment
	rest    [][]byte // the segments after it
	restLen int      // bytes in rest
	err     error
	// labels, when set, interns the labels of session ops (State.labels):
	// a replay of many records makes each label once, not once a record.
	labels map[string]string
	// alias: session ops' replies are slices of the payload, not copies
	// (replay copies the one each session keeps, at its end).
	alias bool
	// more: the offloads of each session the books hold after the
	// snapshot (offloadHints), for which its request table is made room.
	more map[uint64]int
	// ar, when set, holds the request IDs and page lists of the streams
	// read (arena): a replay's state is dropped once the pool is rebuilt.
	ar *arena
	// halt, when set and true, stops a snapshot's decoding between
	// batches of requests with errHalted (a Follower cut at its turn).
	halt *atomic.Bool
}

// errHalted is a decoding stopped by its halt.
var errHalted = errors.New("books: halted")

// arena holds many short strings and page lists in a few blocks, for a
// replay: a stream of the books then costs no allocation of its own
// (about three a stream without: its request ID, its label and its
// pages). A block's bytes are never written again once a string or list
// holds them, and a list is capped so that appending to it copies.
type arena struct {
	names []byte
	pages []int32
}

// nameBlock and pageBlock are the largest blocks an arena allocates; its
// first are firstBlock times smaller, and each next one twice the last, so
// that a replay of many small sessions (an arena each) takes little more
// than their streams.
const (
	nameBlock  = 64 << 10
	pageBlock  = 4096
	firstBlock = 64
)

// nextBlock is the capacity of the block after one of capacity last, for
// at least n more elements, of at most most.
func nextBlock(last, n, most int) int {
	return max(n, min(most, max(most/firstBlock, 2*last)))
}

func newDec(segs ...[]byte) *dec {
	d := &dec{}
	if len(segs) > 0 {
		d.b, d.rest = segs[0], segs[1:]
	}
	for _, s := range d.rest {
		d.restLen += len(s)
	}
	return d
}

// left is the unread bytes, in b and rest together.
func (d *dec) left() int { return len(d.b) + d.restLen }

func (d *dec) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s", ErrCorrupt, what)
	}
	d.b, d.rest, d.restLen = nil, nil, 0
}

// settle moves past exhausted segments.
func (d *dec) settle() {
	for len(d.b) == 0 && len(d.rest) > 0 {
		d.b, d.rest = d.rest[0], d.rest[1:]
		d.restLen -= len(d.b)
	}
}

// skip consumes n bytes, which must be unread.
func (d *dec) skip(n int) {
	for n > 0 {
		d.settle()
		k := min(n, len(d.b))
		d.b, n = d.b[k:], n-k
	}
}

// head returns the next bytes, at least want of them when that many are
// left: the current segment's, or a copy into tmp of those that span
// segments.
func (d *dec) head(want int, tmp []byte) []byte {
	d.settle()
	if len(d.b) >= want || len(d.rest) == 0 {
		return d.b
	}
	n := 0
	b, rest := d.b, d.rest
	for n < want {
		k := copy(tmp[n:want], b)
		n += k
		if len(rest) == 0 {
			break
		}
		b, rest = rest[0], rest[1:]
	}
	return tmp[:n]
}

// u reads an unsigned varint; the one-byte case (most of a session op's
// fields) without calling the general reader (uLong).
func (d *dec) u() uint64 {
	if b := d.b; len(b) > 0 && b[0] < 0x80 {
		d.b = b[1:]
		return uint64(b[0])
	}
	return d.uLong()
}

func (d *dec) uLong() uint64 {
	// Within the current segment (a record's payload always is), the
	// varint is read in place.
	if v, n := binary.Uvarint(d.b); n > 0 {
		d.b = d.b[n:]
		return v
	}
	var tmp [binary.MaxVarintLen64]byte
	v, n := binary.Uvarint(d.head(len(tmp), tmp[:]))
	if n <= 0 {
		d.fail("bad unsigned varint")
		return 0
	}
	d.skip(n)
	return v
}

// i reads a signed varint, the one-byte case as u does.
func (d *dec) i() int64 {
	if b := d.b; len(b) > 0 && b[0] < 0x80 {
		d.b = b[1:]
		return int64(b[0]>>1) ^ -int64(b[0]&1)
	}
	return d.iLong()
}

func (d *dec) iLong() int64 {
	if v, n := binary.Varint(d.b); n > 0 {
		d.b = d.b[n:]
		return v
	}
	var tmp [binary.MaxVarintLen64]byte
	v, n := binary.Varint(d.head(len(tmp), tmp[:]))
	if n <= 0 {
		d.fail("bad varint")
		return 0
	}
	d.skip(n)
	return v
}

// n reads a count of elements of at least one byte each.
func (d *dec) n() int {
	v := d.u()
	if v > uint64(d.left()) {
		d.fail("count beyond the record")
		return 0
	}
	return int(v)
}

func (d *dec) int() int {
	v := d.i()
	if v < -1<<40 || v > 1<<40 {
		d.fail("integer out of range")
		return 0
	}
	return int(v)
}

func (d *dec) byte() byte {
	if b := d.b; len(b) > 0 {
		d.b = b[1:]
		return b[0]
	}
	return d.byteLong()
}

func (d *dec) byteLong() byte {
	d.settle()
	if len(d.b) == 0 {
		d.fail("short record")
		return 0
	}
	c := d.b[0]
	d.skip(1)
	return c
}

// bytes reads a length-prefixed byte string; in calls it the slice to
// copy it into (every segment it spans).
func (d *dec) bytesInto(n int, out []byte) {
	for off := 0; off < n; {
		d.settle()
		k := copy(out[off:n], d.b)
		off += k
		d.b = d.b[k:]
	}
}

func (d *dec) raw() []byte {
	n := d.n()
	if d.err != nil {
		return nil
	}
	if d.settle(); d.alias && n <= len(d.b) {
		out := d.b[:n:n]
		d.b = d.b[n:]
		return out
	}
	out := make([]byte, n)
	d.bytesInto(n, out)
	return out
}

func (d *dec) str() string {
	b, s := d.strBytes(math.MaxInt)
	if b == nil {
		return s
	}
	return string(b)
}

// strBytes reads a string's length and, when its bytes lie whole in the
// current segment and are at most most, returns them (a slice of the
// segment, nil for an empty string); else it returns the string read
// into an allocation of its own (one that spans segments, or one longer
// than most).
func (d *dec) strBytes(most int) ([]byte, string) {
	n := d.n()
	if d.err != nil || n == 0 {
		return nil, ""
	}
	if d.settle(); n > len(d.b) || n > most {
		out := make([]byte, n)
		d.bytesInto(n, out)
		return nil, string(out)
	}
	b := d.b[:n]
	d.b = d.b[n:]
	return b, ""
}

// label reads a string as str does, from the intern table when there is
// one (d.labels, at most maxLabels entries).
func (d *dec) label() string {
	if d.labels == nil {
		return d.str()
	}
	b, s := d.strBytes(math.MaxInt)
	if b == nil {
		return s
	}
	if l, ok := d.labels[string(b)]; ok {
		return l
	}
	l := string(b)
	if len(d.labels) < maxLabels {
		d.labels[l] = l
	}
	return l
}

// maxLabels bounds the labels a replay interns.
const maxLabels = 256

func (d *dec) strs() []string {
	n := d.n()
	var out []string
	for range n {
		out = append(out, d.str())
	}
	return out
}

func (d *dec) pages() []int32 {
	n := d.n()
	return d.appendPages(make([]int32, 0, n), n)
}

// appendPages reads n page indices onto out (nil on an error).
func (d *dec) appendPages(out []int32, n int) []int32 {
	for range n {
		v := d.u()
		if v > 1<<31-1 {
			d.fail("page index out of range")
			return nil
		}
		out = append(out, int32(v))
	}
	return out
}

// rid reads a string as str does, into the arena when there is one. A
// string longer than a quarter block, or split across segments, gets an
// allocation of its own.
func (d *dec) rid() string {
	if d.ar == nil {
		return d.str()
	}
	b, s := d.strBytes(nameBlock / 4)
	if b == nil {
		return s
	}
	a := d.ar.names
	if cap(a)-len(a) < len(b) {
		a = make([]byte, 0, nextBlock(cap(a), len(b), nameBlock))
	}
	from := len(a)
	a = append(a, b...)
	d.ar.names = a
	return unsafe.String(&a[from], len(b))
}

// streamPages reads a page list as pages does, into the arena when there
// is one (a list longer than a quarter block gets an allocation of its
// own: a long reload's pages, which a session keeps for its last reply,
// never hold a block).
func (d *dec) streamPages() []int32 {
	if d.ar == nil {
		return d.pages()
	}
	n := d.n()
	if d.err != nil {
		return nil
	}
	if n == 0 {
		return []int32{} // as pages reads it
	}
	if n > pageBlock/4 {
		return d.appendPages(make([]int32, 0, n), n)
	}
	a := d.ar.pages
	if cap(a)-len(a) < n {
		a = make([]int32, 0, nextBlock(cap(a), n, pageBlock))
	}
	from := len(a)
	if a = d.appendPages(a, n); a == nil {
		return nil
	}
	d.ar.pages = a
	return a[from:len(a):len(a)]
}

func (d *dec) meta() pool.Meta { return pool.Meta{StoredLen: d.i(), Position: d.i(), Released: d.i()} }

func (d *dec) peer() unixsock.Peer {
	pid, uid, gid := d.i(), d.u(), d.u()
	if pid < 0 || pid > 1<<31-1 || uid > 1<<32-1 || gid > 1<<32-1 {
		d.fail("peer credentials out of range")
	}
	return unixsock.Peer{PID: int32(pid), UID: uint32(uid), GID: uint32(gid)}
}

func appendEvent(e enc, ev pool.Event) enc {
	e = append(e, recEvent, byte(ev.Kind))
	e = e.str(ev.Chunk.ID).i(int64(ev.Chunk.GPU)).i(int64(ev.Chunk.NUMA)).i(ev.Chunk.Size)
	return e.str(ev.Allocation).strs(ev.Chunks)
}

func (d *dec) event() pool.Event {
	ev := pool.Event{Kind: pool.EventKind(d.byte())}
	ev.Chunk = pool.Chunk{ID: d.str(), GPU: d.int(), NUMA: d.int(), Size: d.i()}
	ev.Allocation, ev.Chunks = d.str(), d.strs()
	return ev
}

func appendChunkGen(e enc, id string, gen uint64, seals int) enc {
	return append(e, recChunkGen).str(id).u(gen).i(int64(seals))
}

// appendLayout writes a session's layout as the format has it: the page
// size, device pages and max pages of its spec (the session image's
// again, kept so that books read the same both ways across an upgrade)
// and its count of regions.
func appendLayout(e enc, spec pool.Spec, regions int) enc {
	return e.i(spec.PageSize).i(int64(spec.DevicePages)).i(int64(spec.MaxPages)).i(int64(regions))
}

// regions reads a layout and returns its count of regions; the rest is
// the session image's spec, which is read there.
func (d *dec) regions() int {
	d.i()
	d.int()
	d.int()
	return d.int()
}

func appendSessionImage(e enc, s *pool.SessionImage) enc {
	e = e.u(s.ID).str(s.Allocation)
	e = e.i(int64(s.Spec.GPU)).i(s.Spec.PageSize).i(int64(s.Spec.DevicePages)).i(int64(s.Spec.MaxPages))
	return e.strs(s.Chunks).i(int64(s.PPC)).i(int64(s.Capacity)).u(s.Ticket)
}

func (d *dec) sessionImage() pool.SessionImage {
	s := pool.SessionImage{ID: d.u(), Allocation: d.str()}
	s.Spec = pool.Spec{GPU: d.int(), PageSize: d.i(), DevicePages: d.int(), MaxPages: d.int()}
	s.Chunks, s.PPC, s.Capacity, s.Ticket = d.strs(), d.int(), d.int(), d.u()
	return s
}

func appendSessionOp(e enc, op *server.SessionOp) enc {
	e = append(e, recSession).u(op.Session)
	e = append(e, byte(op.Op)).u(uint64(op.Seq)).u(op.Fence).str(op.Rid).str(op.Label).meta(op.Meta)
	e = e.pages(op.Pages).u(op.Ticket)
	e = append(e, byte(op.Status)).bytes(op.Reply)
	if op.Open == nil {
		return append(e, 0)
	}
	o := op.Open
	e = append(e, 1).u(o.Replaces).str(o.Allocation).str(o.Instance).str(o.UUID).peer(o.Peer)
	e = appendLayout(e, o.Image.Spec, o.Regions)
	return appendSessionImage(e, &o.Image)
}

func (d *dec) sessionOp() server.SessionOp {
	op := server.SessionOp{Session: d.u(), Op: wire.Op(d.byte())}
	seq := d.u()
	if seq > 1<<32-1 {
		d.fail("sequence number out of range")
	}
	op.Seq = uint32(seq)
	op.Fence, op.Rid, op.Label, op.Meta = d.u(), d.rid(), d.label(), d.meta()
	op.Pages, op.Ticket = d.streamPages(), d.u()
	op.Status, op.Reply = wire.Status(d.byte()), d.raw()
	if d.byte() == 1 {
		o := &server.OpenInfo{Replaces: d.u(), Allocation: d.str(), Instance: d.str(), UUID: d.str(), Peer: d.peer()}
		o.Regions = d.regions()
		o.Image = d.sessionImage()
		op.Open = o
	}
	return op
}

// snapPart bounds the bytes of one snapshot part, far below maxRecord,
// whatever the state's size: a snapshot is written as parts, each a
// record of its own (recSnapshotPart), the last one flagged.
var snapPart = 4 << 20

// cutEvery is how many page indices a snapshot writes between two
// chances to end a part: with the longest names written whole, a part is
// at most snapPart plus partSlack bytes.
const (
	cutEvery  = 1024
	partSlack = 2 + 2*binary.MaxVarintLen64 + 2*1024 + 3*binary.MaxVarintLen64 + cutEvery*binary.MaxVarintLen32
)

// snapWriter encodes a snapshot into parts of about snapPart bytes and
// hands each, as a record's payload, to emit. A part may end anywhere,
// inside a value too: the decoder reads across parts.
type snapWriter struct {
	e    enc // [recSnapshotPart, flags] then the part's bytes
	emit func(payload []byte) error
	err  error
}

func newSnapWriter(buf enc, emit func([]byte) error) *snapWriter {
	return &snapWriter{e: append(buf[:0], recSnapshotPart, 0), emit: emit}
}

// cut emits the part once it is full.
func (w *snapWriter) cut() {
	if len(w.e) >= snapPart+2 {
		w.flush(false)
	}
}

func (w *snapWriter) flush(last bool) {
	if last {
		w.e[1] |= partLast
	}
	if w.err == nil {
		w.err = w.emit(w.e)
	}
	w.e = append(w.e[:0], recSnapshotPart, 0)
}

// pages writes a page list, cutting parts inside a long one.
func (w *snapWriter) pages(ps []int32) {
	w.e = w.e.u(uint64(len(ps)))
	for i, p := range ps {
		w.e = w.e.u(uint64(uint32(p)))
		if i%cutEvery == cutEvery-1 {
			w.cut()
		}
	}
}

// strs writes a list of names (an allocation's or a session's chunk
// IDs), cutting parts inside a long one.
func (w *snapWriter) strs(ss []string) {
	w.e = w.e.u(uint64(len(ss)))
	for _, x := range ss {
		w.e = w.e.str(x)
		w.cut()
	}
}

// writeSnapshot writes st through w, the last part flagged; it returns the
// first error of emit.
func writeSnapshot(w *snapWriter, st *State) error {
	w.e = w.e.u(st.lastSession)
	w.e = w.e.u(uint64(len(st.chunks)))
	for _, c := range st.chunks {
		w.e = w.e.str(c.ID).i(int64(c.GPU)).i(int64(c.NUMA)).i(c.Size)
		w.e = append(w.e, byte(c.State)).u(c.Gen).i(int64(c.Seals))
		w.cut()
	}
	ids := sortedKeys(st.allocs)
	w.e = w.e.u(uint64(len(ids)))
	for _, id := range ids {
		w.e = w.e.str(id)
		w.strs(st.allocs[id])
	}
	w.e = w.e.u(uint64(len(st.sessions)))
	for _, sid := range sortedIDs(st.sessions) {
		w.flush(false)
		w.e[1] = partSession
		s := st.sessions[sid]
		si := &s.Image
		w.e = w.e.u(si.ID).str(si.Allocation)
		w.e = w.e.i(int64(si.Spec.GPU)).i(si.Spec.PageSize).i(int64(si.Spec.DevicePages)).i(int64(si.Spec.MaxPages))
		w.strs(si.Chunks)
		w.e = w.e.i(int64(si.PPC)).i(int64(si.Capacity)).u(si.Ticket)
		w.e = appendLayout(w.e.str(s.Instance).str(s.UUID).peer(s.Peer), s.Image.Spec, s.Regions)
		w.e = append(w.e.u(uint64(s.Last.Seq)), byte(s.Last.Op), byte(s.Last.Status)).bytes(s.Last.Body)
		w.pages(s.Last.Pages)
		// Requests in the order they came (requests), which the
		// replay of this snapshot keeps.
		s.closeUpAll()
		w.e = w.e.u(uint64(s.reqs.len()))
		for rid, list := range s.reqs.all() {
			w.e = w.e.str(rid).u(uint64(len(list)))
			for _, x := range list {
				w.e = w.e.str(x.Label).meta(x.Meta)
				w.pages(x.Pages)
				w.cut()
			}
		}
		w.e = w.e.u(uint64(len(s.pending)))
		for _, p := range s.pending {
			w.e = w.e.u(p.Ticket)
			w.pages(p.Pages)
			w.cut()
		}
	}
	w.flush(true)
	return w.err
}

// appendSnapshot appends st as one snapshot record (recSnapshot, the
// format's first version wrote these; tests and the fuzzer build them).
func appendSnapshot(e enc, st *State) enc {
	e = append(e, recSnapshot)
	w := newSnapWriter(nil, func(p []byte) error { e = append(e, p[2:]...); return nil })
	_ = writeSnapshot(w, st)
	return e
}

func sortedIDs[V any](m map[uint64]V) []uint64 {
	out := make([]uint64, 0, len(m))
	for id := range m {
		out = append(out, id)
	}
	slices.Sort(out)
	return out
}

func (d *dec) snapshot() *State {
	st := d.snapshotHead()
	n := d.n()
	for range n {
		if d.err != nil {
			break
		}
		s := d.session()
		if d.err != nil {
			return nil
		}
		st.sessions[s.Image.ID] = s
	}
	if d.err != nil {
		return nil
	}
	return st
}

// snapshotHead reads a snapshot up to its sessions: the last session ID,
// the chunks and the allocations (the count of sessions follows).
func (d *dec) snapshotHead() *State {
	st := NewState()
	st.lastSession = d.u()
	for range d.n() {
		c := &Chunk{}
		c.Chunk = pool.Chunk{ID: d.str(), GPU: d.int(), NUMA: d.int(), Size: d.i()}
		c.State = pool.ChunkState(d.byte())
		c.Gen, c.Seals = d.u(), d.int()
		if d.err != nil {
			return nil
		}
		st.gens[c.ID] = gen{gen: c.Gen, seals: c.Seals}
		if _, dup := st.byID[c.ID]; dup {
			d.fail("chunk listed twice")
			return nil
		}
		st.chunks = append(st.chunks, c)
		st.byID[c.ID] = c
	}
	for range d.n() {
		id := d.str()
		st.allocs[id] = d.strs()
	}
	return st
}

// session reads one session of a snapshot.
func (d *dec) session() *Session {
	s := &Session{Image: d.sessionImage()}
	s.Instance, s.UUID, s.Peer = d.str(), d.str(), d.peer()
	s.Regions = d.regions()
	seq := d.u()
	s.Last = server.LastReply{Seq: uint32(seq), Op: wire.Op(d.byte()), Status: wire.Status(d.byte()), Body: d.raw()}
	if s.Last.Pages = d.pages(); len(s.Last.Pages) == 0 {
		s.Last.Pages = nil
	}
	// The table sized for its requests at once (a count the record
	// bounds, and no more than 2^20 entries ahead): growing it a
	// request at a time rehashed it again and again.
	nrids := d.n()
	s.reqs = newRequests(min(nrids+d.more[s.Image.ID], maxRidHint))
	// A few requests at a time, whose index slots are read together
	// (prefetch) before they are opened, as a replay's records are.
	var rids [prefetchBatch]string
	var hs [prefetchBatch]uint64
	var ends [prefetchBatch]int
	var streams []stream
	// A session's streams share its labels (an engine uses a handful),
	// and their IDs and pages lie in an arena.
	if d.labels == nil {
		d.labels = map[string]string{}
	}
	if d.ar == nil {
		d.ar = &arena{}
	}
	for left := nrids; left > 0 && d.err == nil; {
		k := 0
		streams = streams[:0]
		for ; k < prefetchBatch && left > 0; left-- {
			rid := d.rid()
			n := d.n()
			if n == 0 {
				continue
			}
			for range n {
				streams = append(streams, stream{Label: d.label(), Meta: d.meta(), Pages: d.streamPages()})
			}
			rids[k], hs[k], ends[k] = rid, ridHash(rid), len(streams)
			k++
		}
		s.reqs.prefetch(hs[:k])
		from := 0
		for j := range k {
			list := s.reqs.openHashed(rids[j], hs[j])
			*list = append(*list, streams[from:ends[j]]...)
			from = ends[j]
		}
		if d.err == nil && haltNow(d.halt) {
			d.err = errHalted
		}
	}
	for range d.n() {
		s.pending = append(s.pending, pool.PendingImage{Ticket: d.u(), Pages: d.pages()})
	}
	return s
}

// decodeSnapshot reads a snapshot written in parts: the parts' bytes
// after their record type and flags, in order; sessionAt lists the parts
// flagged partSession. Where they begin the sessions, one each, the
// sessions are decoded side by side (sessionsApart); else, or when that
// fails, the parts are read as one (as an agent that ignores the flag
// does).
func decodeSnapshot(parts [][]byte, sessionAt []int, more map[uint64]int, procs int, halt *atomic.Bool) (*State, error) {
	if len(sessionAt) > 0 && sideBySide {
		if st := sessionsApart(parts, sessionAt, more, procs, halt); st != nil {
			return st, nil
		}
	}
	if haltNow(halt) {
		return nil, errHalted
	}
	d := newDec(parts...)
	d.more, d.halt = more, halt
	st := d.snapshot()
	if d.err != nil {
		return nil, d.err
	}
	if d.left() != 0 {
		return nil, fmt.Errorf("%w: %d bytes after the snapshot", ErrCorrupt, d.left())
	}
	return st, nil
}

// decodeRecord applies one record's payload to st (nil before the
// snapshot: only a snapshot may come first: a recSnapshot record, or here
// a snapshot in one part; replay gathers the parts of a longer one). It
// returns the state.
func decodeRecord(st *State, payload []byte) (*State, error) {
	d := &dec{b: payload}
	if st != nil {
		d.labels, d.alias = st.labels, st.aliasReplies
	}
	typ := d.byte()
	if st == nil && typ != recSnapshot && typ != recSnapshotPart {
		return nil, fmt.Errorf("%w: the books start with record type %d, not a snapshot", ErrCorrupt, typ)
	}
	switch typ {
	case recSnapshotPart:
		if st != nil {
			return nil, fmt.Errorf("%w: a second snapshot", ErrCorrupt)
		}
		if d.byte()&1 == 0 {
			return nil, fmt.Errorf("%w: a snapshot part without the rest", ErrCorrupt)
		}
		st = d.snapshot()
	case recSnapshot:
		if st != nil {
			return nil, fmt.Errorf("%w: a second snapshot", ErrCorrupt)
		}
		st = d.snapshot()
	case recEvent:
		ev := d.event()
		if d.err == nil {
			st.applyEvent(ev)
		}
	case recChunkGen:
		id, gen, seals := d.str(), d.u(), d.int()
		if d.err == nil {
			st.SetGen(id, gen, seals)
		}
	case recSession:
		op := d.sessionOp()
		if d.err == nil {
			st.applySession(op)
		}
	default:
		return nil, fmt.Errorf("%w: unknown record type %d", ErrCorrupt, typ)
	}
	if d.err != nil {
		return nil, d.err
	}
	if d.left() != 0 {
		return nil, fmt.Errorf("%w: %d bytes after the record", ErrCorrupt, d.left())
	}
	return st, nil
}

// sessionsApart decodes a snapshot whose sessions each begin a part (at
// the parts sessionAt lists, ascending), one goroutine a session up to
// procs at a time. It returns nil unless the head ends where the first session
// begins, each session's parts hold exactly one session and there are as
// many as the head counts.
func sessionsApart(parts [][]byte, sessionAt []int, more map[uint64]int, procs int, halt *atomic.Bool) *State {
	if sessionAt[0] < 1 {
		return nil
	}
	d := newDec(parts[:sessionAt[0]]...)
	st := d.snapshotHead()
	// The count of sessions ends the head: they are in the parts after.
	if n := d.u(); d.err != nil || d.left() != 0 || n != uint64(len(sessionAt)) {
		return nil
	}
	n := len(sessionAt)
	sessions := make([]*Session, n)
	var g errgroup.Group
	g.SetLimit(procs)
	for i, at := range sessionAt {
		end := len(parts)
		if i+1 < n {
			end = sessionAt[i+1]
		}
		g.Go(func() error {
			d := newDec(parts[at:end]...)
			d.more, d.halt = more, halt
			if s := d.session(); d.err == nil && d.left() == 0 {
				sessions[i] = s
			}
			return nil
		})
	}
	_ = g.Wait()
	for _, s := range sessions {
		if s == nil {
			return nil
		}
		st.sessions[s.Image.ID] = s
	}
	return st
}
