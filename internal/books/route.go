package books

import (
	"encoding/binary"
	"fmt"
	"runtime"

	"golang.org/x/sync/errgroup"

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
	recs []queuedRecord
	// After apply: the records that named something already gone, and
	// the first record that did not decode (at errOff).
	skipped int
	err     error
	errOff  uint64
}

type queuedRecord struct {
	off     uint64
	payload []byte
}

// router holds the queues of one replay, in the order sessions first
// got a record.
type router struct {
	queues []*sessionQueue
	by     map[*Session]*sessionQueue
	last   *sessionQueue
}

// route queues the record at off when it is a routed op of a session open
// in st, and reports whether it did.
func (r *router) route(st *State, off uint64, payload []byte) bool {
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
			q = &sessionQueue{s: s, recs: make([]queuedRecord, 0, min(st.ridHints[id], maxRidHint))}
			r.by[s] = q
			r.queues = append(r.queues, q)
		}
		r.last = q
	}
	q.recs = append(q.recs, queuedRecord{off: off, payload: payload})
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
	if len(live) == 1 {
		live[0].apply(st.labels)
	} else {
		var g errgroup.Group
		g.SetLimit(runtime.GOMAXPROCS(0))
		for _, q := range live {
			g.Go(func() error { q.apply(map[string]string{}); return nil })
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
// that does not decode.
func (q *sessionQueue) apply(labels map[string]string) {
	for _, rec := range q.recs {
		d := &dec{b: rec.payload, left: len(rec.payload), labels: labels, alias: true}
		d.byte() // recSession
		op := d.sessionOp()
		err := d.err
		if err == nil && d.left != 0 {
			err = fmt.Errorf("%w: %d bytes after the record", ErrCorrupt, d.left)
		}
		if err != nil {
			q.err, q.errOff = err, rec.off
			return
		}
		if !q.s.apply(op) {
			q.skipped++
		}
	}
}
