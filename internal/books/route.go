package books

import (
	"encoding/binary"
	"fmt"
	"sync/atomic"

	"golang.org/x/sync/errgroup"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/wire"
)

// A replay routes each session's own changes (routed ops) to a queue of
// that session and applies the queues once the records are read, one
// goroutine per session up to GOMAXPROCS, while it applies every other
// record (chunks, grants, opens, closes) in order as it reads it. A
// session's changes keep their order and touch that session alone, and the
// records replay applies in order never read what they change (the
// streams, pending reloads, ticket and last reply of a session), so the
// state is the one an in-order replay makes; a restarted agent with many
// sessions' books rebuilds them on all its CPUs.
//
// sideBySide is off in the tests that compare a replay by session (routed
// records, a snapshot's sessions decoded apart) with one in order.
var sideBySide = true

type sessionQueue struct {
	s    *Session
	mem  []byte // the books the records are in
	recs []queuedRecord
	ar   *arena // where its streams go (nil: a fresh one)
	// After apply: the records that named something already gone, and
	// the first record that did not decode (at errOff).
	skipped int
	err     error
	errOff  uint64
}

// queuedRecord is the offset of a record in the books, whose length
// replay checked (8 bytes a record where a slice of the payload took 32: a
// large session queues 131,072 of them).
type queuedRecord struct{ off uint64 }

func (q *sessionQueue) payload(rec queuedRecord) []byte {
	n := uint64(binary.LittleEndian.Uint32(q.mem[rec.off:]))
	return q.mem[rec.off+8 : rec.off+8+n]
}

// router holds the queues of one replay, in the order sessions first
// got a record.
type router struct {
	queues []*sessionQueue
	by     map[*Session]*sessionQueue
	last   *sessionQueue
	procs  int // goroutines at a time that apply and decode the queues
	// batch, when set, is the most records queued before they are
	// applied (replayer.batch): no queue is made room for more, and each
	// session's streams go on in an arena of its own (Session.ar), not in
	// fresh small blocks each batch.
	batch int
}

// route queues the record at off in mem, whose payload is payload, when
// it is a routed op of a session open in st, and reports whether it did.
func (r *router) route(st *State, mem []byte, off uint64, payload []byte) bool {
	if len(payload) < 3 || payload[0] != recSession {
		return false
	}
	id, k := binary.Uvarint(payload[1:])
	if k <= 0 || 1+k >= len(payload) || !routed(wire.Op(payload[1+k])) {
		return false
	}
	q := r.last
	if q == nil || q.s.Image.ID != id {
		s := st.sessions[id]
		if s == nil {
			return false // replayed in order: it is skipped there
		}
		if r.by == nil {
			r.by = map[*Session]*sessionQueue{}
		}
		if q = r.by[s]; q == nil {
			// Room for the session's offloads still to come (the
			// replay's hints), at least.
			room := min(st.ridHints[id], maxRidHint)
			if r.batch > 0 {
				room = min(room, r.batch)
			}
			q = &sessionQueue{s: s, mem: mem, recs: make([]queuedRecord, 0, room)}
			if r.batch > 0 {
				if s.ar == nil {
					s.ar = &arena{}
				}
				q.ar = s.ar
			}
			r.by[s] = q
			r.queues = append(r.queues, q)
		}
		r.last = q
	}
	q.recs = append(q.recs, queuedRecord{off: off})
	return true
}

// inOrder is told of a record replay applied in order: it may have
// opened or closed a session, so the next routed record looks its session
// up again.
func (r *router) inOrder() { r.last = nil }

// apply applies every queue to its session and adds what they skipped to
// st. It returns the error of the record that failed first in the books,
// with its offset; then nothing is applied that a replay in order would
// not have applied before failing, but the state is to be dropped anyway.
func (r *router) apply(st *State) (uint64, error) {
	// A session closed or replaced meanwhile gets its changes too: they
	// vanish with it, but must decode, as in order.
	live := r.queues
	procs := max(r.procs, 1)
	// With CPUs to spare, each queue's records are decoded ahead of
	// applying them, on CPUs of their own: one session's on up to
	// decodeLanes of them.
	lanes := 0
	if n := len(live); n > 0 && n < procs {
		lanes = min(procs/n, decodeLanes)
	}
	if len(live) == 1 {
		live[0].apply(st.labels, lanes)
	} else {
		var g errgroup.Group
		g.SetLimit(procs)
		for _, q := range live {
			g.Go(func() error { q.apply(map[string]string{}, lanes); return nil })
		}
		_ = g.Wait()
	}
	var first *sessionQueue
	for _, q := range live {
		st.Skipped += q.skipped
		if q.err != nil && (first == nil || q.errOff < first.errOff) {
			first = q
		}
	}
	r.queues, r.by, r.last = nil, nil, nil
	if first != nil {
		return first.errOff, first.err
	}
	return 0, nil
}

// apply decodes and applies the queue's records in order, up to the first
// that does not decode. With lanes > 0 the decoding runs ahead of the
// applying, in that many goroutines of its own: batch i on lane i%lanes,
// applied in order.
func (q *sessionQueue) apply(labels map[string]string, lanes int) {
	if lanes == 0 || len(q.recs) < 2*decodeBatch {
		q.applyHere(labels)
		return
	}
	type lane struct {
		labels map[string]string
		ar     *arena // the lane's own, as its labels
		// Three batches go round each lane (being decoded, waiting,
		// being applied): the collector is off while the agent
		// restores, and a fresh batch each time would hold some 170
		// bytes a record until it runs.
		free, done chan []decoded
	}
	nb := (len(q.recs) + decodeBatch - 1) / decodeBatch
	lanes = min(lanes, nb)
	// failed is the first batch known to hold a record that does not
	// decode: no lane decodes a batch after it.
	var failed atomic.Int64
	failed.Store(int64(nb))
	ls := make([]lane, lanes)
	for l := range ls {
		ls[l] = lane{labels: labels, ar: &arena{}, free: make(chan []decoded, 3), done: make(chan []decoded, 2)}
		if l > 0 {
			ls[l].labels = map[string]string{} // a map is one goroutine's
		}
		for range cap(ls[l].free) {
			ls[l].free <- make([]decoded, 0, decodeBatch)
		}
		// The decoding also hashes each request ID, and the applying
		// reads the index where a batch's offloads will look
		// (prefetch) before it applies them.
		go func(ln lane) {
			defer close(ln.done)
			for i := l; i < nb && int64(i) < failed.Load(); i += lanes {
				b := (<-ln.free)[:0]
				for _, rec := range q.recs[i*decodeBatch : min((i+1)*decodeBatch, len(q.recs))] {
					op, err := decodeQueued(q.payload(rec), ln.labels, ln.ar)
					b = append(b, decoded{op, offloadHash(op), err, rec.off})
					if err != nil {
						for f := failed.Load(); int64(i) < f && !failed.CompareAndSwap(f, int64(i)); f = failed.Load() {
						}
						break // nothing after a failure is applied
					}
				}
				ln.done <- b
			}
		}(ls[l])
	}
	stopped := false
	hs := make([]uint64, 0, decodeBatch)
	for i := range nb {
		ln := ls[i%lanes]
		b, ok := <-ln.done
		if !ok {
			break // past a failure: its batch came first
		}
		if !stopped {
			hs = hs[:0]
			for j := range b {
				if b[j].op.Op == wire.OpOffload {
					hs = append(hs, b[j].h)
				}
			}
			q.s.reqs.prefetch(hs)
			for j := range b {
				if !q.applyOne(b[j].op, b[j].h, b[j].err, b[j].off) {
					stopped = true
					break
				}
			}
		}
		ln.free <- b
	}
	// Every lane ends (past the failure, or at the last batch); what a
	// lane decoded after the failure goes unapplied.
	for _, ln := range ls {
		for b := range ln.done {
			ln.free <- b
		}
	}
}

type decoded struct {
	op  server.SessionOp
	h   uint64 // offloadHash(op)
	err error
	off uint64
}

// applyHere decodes and applies the queue's records in order, on this
// goroutine: a few records at a time, whose offloads' index slots are
// read together (prefetch) before they are applied. One lookup after
// the other, each missed the caches in turn: 4 sessions at their bound,
// replayed side by side, spent a sixth of their CPU there.
func (q *sessionQueue) applyHere(labels map[string]string) {
	var batch [prefetchBatch]decoded
	hs := make([]uint64, 0, prefetchBatch)
	ar := q.ar
	if ar == nil {
		ar = &arena{}
	}
	for lo := 0; lo < len(q.recs); lo += prefetchBatch {
		b := batch[:0]
		hs = hs[:0]
		for _, rec := range q.recs[lo:min(lo+prefetchBatch, len(q.recs))] {
			op, err := decodeQueued(q.payload(rec), labels, ar)
			h := offloadHash(op)
			b = append(b, decoded{op, h, err, rec.off})
			if err != nil {
				break // applied up to it, which then stops the queue
			}
			if op.Op == wire.OpOffload {
				hs = append(hs, h)
			}
		}
		q.s.reqs.prefetch(hs)
		for i := range b {
			if !q.applyOne(b[i].op, b[i].h, b[i].err, b[i].off) {
				return
			}
		}
	}
}

const (
	// prefetchBatch is how many records applyHere decodes before it
	// applies them.
	prefetchBatch = 16
	// decodeBatch is how many records a batch of the decoding ahead holds.
	decodeBatch = 1024
	// decodeLanes bounds the goroutines that decode one session's
	// records ahead: a record takes about twice as long to decode as
	// to apply, so a third lane rarely finds the applying behind.
	decodeLanes = 2
)

// decodeQueued decodes one queued record, a routed session op.
func decodeQueued(payload []byte, labels map[string]string, ar *arena) (server.SessionOp, error) {
	d := &dec{b: payload, labels: labels, alias: true, ar: ar}
	d.byte() // recSession
	op := d.sessionOp()
	err := d.err
	if err == nil && d.left() != 0 {
		err = fmt.Errorf("%w: %d bytes after the record", ErrCorrupt, d.left())
	}
	return op, err
}

// applyOne applies one decoded record (h: its offloadHash), or
// records its failure at off; it reports whether the queue goes on.
func (q *sessionQueue) applyOne(op server.SessionOp, h uint64, err error, off uint64) bool {
	if err != nil {
		q.err, q.errOff = err, off
		return false
	}
	if !q.s.apply(op, h) {
		q.skipped++
	}
	return true
}
