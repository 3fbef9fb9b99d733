package books

import (
	"encoding/binary"
	"errors"
	"fmt"

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

type dec struct {
	b   []byte
	err error
}

func (d *dec) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s", ErrCorrupt, what)
	}
	d.b = nil
}

func (d *dec) u() uint64 {
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail("bad unsigned varint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *dec) i() int64 {
	v, n := binary.Varint(d.b)
	if n <= 0 {
		d.fail("bad varint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

// n reads a count of elements of at least one byte each.
func (d *dec) n() int {
	v := d.u()
	if v > uint64(len(d.b)) {
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
	if len(d.b) == 0 {
		d.fail("short record")
		return 0
	}
	c := d.b[0]
	d.b = d.b[1:]
	return c
}

func (d *dec) raw() []byte {
	n := d.n()
	if d.err != nil {
		return nil
	}
	out := append([]byte{}, d.b[:n]...)
	d.b = d.b[n:]
	return out
}

func (d *dec) str() string { return string(d.raw()) }

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
	out := make([]int32, 0, n)
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
	op.Fence, op.Rid, op.Label, op.Meta = d.u(), d.str(), d.str(), d.meta()
	op.Pages, op.Ticket = d.pages(), d.u()
	op.Status, op.Reply = wire.Status(d.byte()), d.raw()
	if d.byte() == 1 {
		o := &server.OpenInfo{Replaces: d.u(), Allocation: d.str(), Instance: d.str(), UUID: d.str(), Peer: d.peer()}
		o.Regions = d.regions()
		o.Image = d.sessionImage()
		op.Open = o
	}
	return op
}

func appendSnapshot(e enc, st *State) enc {
	e = append(e, recSnapshot).u(st.lastSession)
	e = e.u(uint64(len(st.chunks)))
	for _, c := range st.chunks {
		g := st.gens[c.ID]
		e = e.str(c.ID).i(int64(c.GPU)).i(int64(c.NUMA)).i(c.Size)
		e = append(e, byte(c.State)).u(g.gen).i(int64(g.seals))
	}
	ids := sortedKeys(st.allocs)
	e = e.u(uint64(len(ids)))
	for _, id := range ids {
		e = e.str(id).strs(st.allocs[id])
	}
	e = e.u(uint64(len(st.sessions)))
	for _, s := range st.sessions {
		e = appendSessionImage(e, &s.Image)
		e = appendLayout(e.str(s.Instance).str(s.UUID).peer(s.Peer), s.Image.Spec, s.Regions)
		e = append(e.u(uint64(s.Last.Seq)), byte(s.Last.Op), byte(s.Last.Status)).bytes(s.Last.Body).pages(s.Last.Pages)
		rids := sortedKeys(s.rids)
		e = e.u(uint64(len(rids)))
		for _, rid := range rids {
			e = e.str(rid).u(uint64(len(s.rids[rid])))
			for _, x := range s.rids[rid] {
				e = e.str(x.label).meta(x.meta).pages(x.pages)
			}
		}
		e = e.u(uint64(len(s.pending)))
		for _, p := range s.pending {
			e = e.u(p.Ticket).pages(p.Pages)
		}
	}
	return e
}

func (d *dec) snapshot() *State {
	st := NewState()
	st.lastSession = d.u()
	for range d.n() {
		c := &Chunk{}
		c.Chunk = pool.Chunk{ID: d.str(), GPU: d.int(), NUMA: d.int(), Size: d.i()}
		c.State = pool.ChunkState(d.byte())
		g := gen{gen: d.u(), seals: d.int()}
		if d.err != nil {
			return nil
		}
		st.gens[c.ID] = g
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
	for range d.n() {
		s := &Session{Image: d.sessionImage(), rids: map[string][]*stream{}}
		s.Instance, s.UUID, s.Peer = d.str(), d.str(), d.peer()
		s.Regions = d.regions()
		seq := d.u()
		s.Last = server.LastReply{Seq: uint32(seq), Op: wire.Op(d.byte()), Status: wire.Status(d.byte()), Body: d.raw()}
		if s.Last.Pages = d.pages(); len(s.Last.Pages) == 0 {
			s.Last.Pages = nil
		}
		for range d.n() {
			rid := d.str()
			for range d.n() {
				s.rids[rid] = append(s.rids[rid], &stream{label: d.str(), meta: d.meta(), pages: d.pages()})
			}
		}
		for range d.n() {
			s.pending = append(s.pending, pool.PendingImage{Ticket: d.u(), Pages: d.pages()})
		}
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

// decodeRecord applies one record's payload to st (nil before the
// snapshot: only a snapshot may come first). It returns the state.
func decodeRecord(st *State, payload []byte) (*State, error) {
	d := &dec{b: payload}
	typ := d.byte()
	if st == nil && typ != recSnapshot {
		return nil, fmt.Errorf("%w: the books start with record type %d, not a snapshot", ErrCorrupt, typ)
	}
	switch typ {
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
	if len(d.b) != 0 {
		return nil, fmt.Errorf("%w: %d bytes after the record", ErrCorrupt, len(d.b))
	}
	return st, nil
}
