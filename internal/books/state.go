package books

import (
	"fmt"
	"os"
	"runtime"
	"slices"
	"sort"
	"strings"

	"golang.org/x/sync/errgroup"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/unixsock"
	"github.com/kvpool/kvpool/pkg/wire"
)

// State is the pool's state as the books keep it: rebuilt by replaying the
// journal, kept current as records are appended, written whole at each
// compaction.
type State struct {
	chunks      []*Chunk
	byID        map[string]*Chunk
	allocs      map[string][]string
	sessions    map[uint64]*Session
	lastSession uint64
	// gens: the memfd generation and seals of each chunk, recorded before
	// the chunk joins the pool (so a chunk the pool never saw has one too).
	// A chunk of byID carries its own copy (Chunk.Gen and Seals), so that
	// a restart's adoption of thousands looks each up once.
	gens map[string]gen
	// Skipped counts records that named something already gone (a session
	// op recorded after a revoke that closed the session, say).
	Skipped int

	// src is the books memfd Load read, in this format, up to srcEnd
	// (its last committed record), for Start to copy; forgot lists the
	// chunks Forget removed since (Start records their removal); dirty: a
	// change Start cannot record that way (SetGen) came after Load.
	src    *os.File
	srcEnd uint64
	// snapEnd is where the snapshot that began the replayed books ended.
	snapEnd uint64
	forgot  []string
	dirty   bool

	// labels interns the labels of replayed session ops; aliasReplies:
	// the replies they keep are slices of the records (replay's, which
	// copies each session's last one at its end: ownReplies).
	labels       map[string]string
	aliasReplies bool
	// ridHints: the offload records of each session still to replay
	// (offloadHints), to size the request table of a session opened in
	// them; nil once the replay is done.
	ridHints map[uint64]int
}

// maxRidHint bounds a request table sized ahead of its entries.
const maxRidHint = 1 << 20

// sizeFor takes the replay's hints: the request table of each session of
// the snapshot that more offloads follow is made again at the size they
// need, and the hints stay for the sessions the records open.
func (st *State) sizeFor(hints map[uint64]int) {
	for id, s := range st.sessions {
		s.reqs.reserve(min(hints[id], maxRidHint))
	}
	st.ridHints = hints
}

type gen struct {
	gen   uint64
	seals int
}

// Chunk is one chunk of the books: where it stands in the pool and which
// memfd (generation, seals) holds it. (Gen and Seals are filled in by
// Chunks and Chunk.)
type Chunk struct {
	pool.ChunkImage
	Gen   uint64
	Seals int
}

// Session is one session of the books.
type Session struct {
	Image    pool.SessionImage // Streams and Pending are kept below instead
	Instance string
	UUID     string
	Peer     unixsock.Peer
	Regions  int // of the layout it was opened with; its geometry is Image.Spec
	Last     server.LastReply

	reqs    requests
	pending []pool.PendingImage
	// bigs: the label index of each request of more than indexFrom
	// streams a replay has looked in (labels.go).
	bigs map[string]*bigRequest
	// ar: where a Follower's batches of its records put its streams
	// (router.batch), so that they fill blocks rather than start small
	// ones each batch; it goes with the session.
	ar *arena
}

// stream is one stream of a request: the pool's own type (request).
type stream = pool.StreamImage

// NewState returns empty books.
func NewState() *State {
	return &State{byID: map[string]*Chunk{}, allocs: map[string][]string{}, sessions: map[uint64]*Session{}, gens: map[string]gen{},
		labels: map[string]string{}}
}

// ownReplies makes the last reply each session keeps its own copy, not a
// slice of a record (aliasReplies), and stops aliasing.
func (st *State) ownReplies() {
	if !st.aliasReplies {
		return
	}
	for _, s := range st.sessions {
		s.Last.Body = slices.Clone(s.Last.Body)
	}
	st.aliasReplies = false
}

// Chunks lists the chunks in the order they were added.
func (st *State) Chunks() []Chunk {
	out := make([]Chunk, len(st.chunks))
	for i, c := range st.chunks {
		out[i] = *c
	}
	return out
}

// NumChunks is how many chunks the books name.
func (st *State) NumChunks() int { return len(st.chunks) }

// Chunk returns the chunk id.
func (st *State) Chunk(id string) (Chunk, bool) {
	c, ok := st.byID[id]
	if !ok {
		return Chunk{}, false
	}
	return *c, true
}

// Sessions is the number of open sessions.
func (st *State) Sessions() int { return len(st.sessions) }

// Streams is the number of streams over every session.
func (st *State) Streams() int {
	n := 0
	for _, s := range st.sessions {
		n += s.streams()
	}
	return n
}

// Image returns the state as pool.Restore takes it. Its sessions' request
// lists and page lists are the state's own: neither may change them while
// the other is in use.
func (st *State) Image() pool.Image {
	img := pool.Image{LastSession: st.lastSession, Chunks: make([]pool.ChunkImage, 0, len(st.chunks))}
	for _, c := range st.chunks {
		img.Chunks = append(img.Chunks, c.ChunkImage)
	}
	for _, id := range sortedKeys(st.allocs) {
		img.Allocations = append(img.Allocations, pool.AllocationImage{ID: id, Chunks: slices.Clone(st.allocs[id])})
	}
	ids := make([]uint64, 0, len(st.sessions))
	for id := range st.sessions {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	// Side by side, as pool.Restore rebuilds them.
	img.Sessions = make([]pool.SessionImage, len(ids))
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for i, id := range ids {
		g.Go(func() error { img.Sessions[i] = st.sessions[id].image(); return nil })
	}
	_ = g.Wait()
	return img
}

func (s *Session) image() pool.SessionImage {
	s.closeUpAll()
	si := s.Image
	si.Chunks = slices.Clone(si.Chunks)
	// The request list as it is, holes and all (the pool skips them): a
	// copy of it was about a third of a restart's rebuild (131,072
	// streams: 22-25 ms, 10 MiB).
	si.Requests, si.Pending = s.reqs.list, nil
	for _, p := range s.pending {
		si.Pending = append(si.Pending, pool.PendingImage{Ticket: p.Ticket, Pages: p.Pages})
	}
	return si
}

// Restored pairs the pool's restored sessions with what the server keeps
// of them. sessions is what pool.Restore returned for Image().
func (st *State) Restored(sessions []*pool.Session) []server.RestoredSession {
	out := make([]server.RestoredSession, 0, len(sessions))
	for _, ps := range sessions {
		s := st.sessions[ps.ID()]
		if s == nil {
			continue
		}
		out = append(out, server.RestoredSession{Session: ps, Instance: s.Instance, UUID: s.UUID, Peer: s.Peer, Regions: s.Regions, Last: s.Last})
	}
	return out
}

// Forget removes a chunk from the books (its memory is gone: the keeper
// lost it, or the plan no longer has it). The allocation holding it is
// revoked, with its sessions.
func (st *State) Forget(id string) {
	if st.src != nil {
		st.forgot = append(st.forgot, id)
	}
	delete(st.gens, id)
	c, ok := st.byID[id]
	if !ok {
		return
	}
	for a, ids := range st.allocs {
		if slices.Contains(ids, id) {
			st.revoke(a)
		}
	}
	delete(st.byID, id)
	delete(st.gens, id)
	st.chunks = slices.DeleteFunc(st.chunks, func(x *Chunk) bool { return x == c })
}

// SetGen records the memfd generation and seals of chunk id.
func (st *State) SetGen(id string, g uint64, seals int) {
	st.dirty = st.dirty || st.src != nil
	st.gens[id] = gen{gen: g, seals: seals}
	if c, ok := st.byID[id]; ok {
		c.Gen, c.Seals = g, seals
	}
}

func (st *State) revoke(alloc string) {
	for _, id := range st.allocs[alloc] {
		if c, ok := st.byID[id]; ok {
			c.State = pool.ChunkDirty
		}
	}
	delete(st.allocs, alloc)
	for id, s := range st.sessions {
		if s.Image.Allocation == alloc {
			delete(st.sessions, id)
		}
	}
}

// applyEvent applies a pool table change.
func (st *State) applyEvent(ev pool.Event) {
	switch ev.Kind {
	case pool.EventAddChunk:
		if _, ok := st.byID[ev.Chunk.ID]; ok {
			st.Skipped++
			return
		}
		g := st.gens[ev.Chunk.ID]
		c := &Chunk{ChunkImage: pool.ChunkImage{Chunk: ev.Chunk, State: pool.ChunkFree}, Gen: g.gen, Seals: g.seals}
		st.chunks = append(st.chunks, c)
		st.byID[c.ID] = c
	case pool.EventRemoveChunk:
		st.Forget(ev.Chunk.ID)
	case pool.EventScrubbed:
		if c, ok := st.byID[ev.Chunk.ID]; ok {
			c.State = pool.ChunkFree
		} else {
			st.Skipped++
		}
	case pool.EventGrant:
		for _, id := range ev.Chunks {
			c, ok := st.byID[id]
			if !ok || c.State != pool.ChunkFree {
				st.Skipped++
				return
			}
		}
		if _, ok := st.allocs[ev.Allocation]; ok {
			st.Skipped++
			return
		}
		for _, id := range ev.Chunks {
			st.byID[id].State = pool.ChunkGranted
		}
		st.allocs[ev.Allocation] = slices.Clone(ev.Chunks)
	case pool.EventRevoke:
		if _, ok := st.allocs[ev.Allocation]; !ok {
			st.Skipped++
			return
		}
		st.revoke(ev.Allocation)
	default:
		st.Skipped++
	}
}

// applySession applies a session change.
func (st *State) applySession(op server.SessionOp) {
	if op.Op == wire.OpOpen {
		st.open(op)
		return
	}
	s := st.sessions[op.Session]
	if s == nil {
		st.Skipped++
		return
	}
	if op.Op == wire.OpClose {
		delete(st.sessions, op.Session)
		return
	}
	if !s.apply(op, offloadHash(op)) {
		st.Skipped++
	}
}

// routed reports whether a session op of kind op on an open session
// changes that session alone (its streams, pending reloads, ticket and
// last reply) and reads nothing else: such ops of different sessions
// replay in any order against each other (replay applies them by session,
// in parallel).
func routed(op wire.Op) bool { return op != wire.OpOpen && op != wire.OpClose }

// apply applies a change of the session's own (routed), h being
// offloadHash(op), and reports whether it applied: false for one that
// named something already gone.
func (s *Session) apply(op server.SessionOp, h uint64) bool {
	if op.Fence != 0 {
		i := 0
		for i < len(s.pending) && s.pending[i].Ticket <= op.Fence {
			i++
		}
		s.pending = s.pending[i:]
	}
	if op.Op == 0 {
		return true
	}
	switch op.Op {
	case wire.OpOffload:
		list := s.reqs.openHashed(op.Rid, h)
		if s.findIn(op.Rid, *list, op.Label) >= 0 {
			return false
		}
		// op is the decoder's own (decodeRecord): its pages are kept.
		*list = append(*list, stream{Label: op.Label, Meta: op.Meta, Pages: op.Pages})
		s.added(op.Rid, *list)
	case wire.OpReload, wire.OpDiscard:
		i := s.find(op.Rid, op.Label)
		if i < 0 && op.Op == wire.OpDiscard {
			break // discarding an unknown stream is a no-op (the seed's)
		}
		if i < 0 {
			return false
		}
		list := s.reqs.get(op.Rid)
		if op.Op == wire.OpReload && len(list[i].Pages) > 0 {
			s.pending = append(s.pending, pool.PendingImage{Ticket: op.Ticket, Pages: list[i].Pages})
		}
		if op.Op == wire.OpReload && op.Ticket > s.Image.Ticket {
			s.Image.Ticket = op.Ticket
		}
		s.drop(op.Rid, list, i)
	case wire.OpRemoveRequest:
		s.reqs.remove(op.Rid)
		delete(s.bigs, op.Rid)
	default:
		return false
	}
	s.Last = server.LastReply{Seq: op.Seq, Op: op.Op, Status: op.Status, Body: op.Reply}
	if len(op.Pages) > wire.MaxPagesPerPacket {
		// The rest of a long reply, for OpMore after a resend (shared
		// with the stream: neither changes them).
		s.Last.Pages = op.Pages
	}
	return true
}

func (s *Session) streams() int {
	s.closeUpAll()
	n := 0
	for _, list := range s.reqs.all() {
		n += len(list)
	}
	return n
}

func (st *State) open(op server.SessionOp) {
	o := op.Open
	if o == nil {
		st.Skipped++
		return
	}
	if o.Replaces != 0 {
		delete(st.sessions, o.Replaces)
	}
	ids, ok := st.allocs[o.Allocation]
	if !ok || o.Image.ID == 0 || st.sessions[o.Image.ID] != nil {
		st.Skipped++
		return
	}
	bound := map[string]bool{}
	for _, s := range st.sessions {
		for _, id := range s.Image.Chunks {
			bound[id] = true
		}
	}
	for _, id := range o.Image.Chunks {
		if bound[id] || !slices.Contains(ids, id) {
			st.Skipped++
			return
		}
	}
	img := o.Image
	img.Chunks = slices.Clone(img.Chunks)
	img.Requests, img.Pending = nil, nil
	st.sessions[img.ID] = &Session{Image: img, Instance: o.Instance, UUID: o.UUID, Peer: o.Peer, Regions: o.Regions,
		reqs: newRequests(min(st.ridHints[img.ID], maxRidHint))}
	st.lastSession = max(st.lastSession, img.ID)
}

// Check compares the books with a pool's export: they must agree on
// everything Restore would rebuild. For tests and the chaos harness.
func (st *State) Check(img pool.Image) error {
	mine := st.Image()
	// The books know the last session ID from the opens they recorded; a
	// pool that has opened none since it was made or restored counts
	// from its own epoch (pool.New), which is higher.
	if mine.LastSession > img.LastSession {
		return fmt.Errorf("books and pool differ: the books' last session %d, the pool's %d", mine.LastSession, img.LastSession)
	}
	mine.LastSession, img.LastSession = 0, 0
	// Streams of one request keep their order; requests are sorted here
	// (the books list them in first-offload order with holes, Export by
	// ID).
	for _, m := range []*pool.Image{&mine, &img} {
		for i := range m.Sessions {
			s := &m.Sessions[i]
			s.Requests = slices.DeleteFunc(slices.Clone(s.Requests), func(q pool.RequestImage) bool { return len(q.Streams) == 0 })
			slices.SortFunc(s.Requests, func(a, b pool.RequestImage) int { return strings.Compare(a.Rid, b.Rid) })
		}
	}
	if fmt.Sprint(mine) != fmt.Sprint(img) {
		return fmt.Errorf("books and pool differ:\nbooks %+v\npool  %+v", mine, img)
	}
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
