package cudart

import (
	"errors"
	"fmt"
	"sync"
)

// Ticket names one batch of a Mover. An offload's ticket lets a later
// reload of the same host pages be ordered after it without waiting for
// every other offload; a reload's tells when its host pages may be reused
// (Completed, WaitFor). The zero Ticket names nothing.
type Ticket uint64

// Mover moves pages between device memory and registered host memory on
// two copy streams of its own, one per direction, so that offloads and
// reloads overlap on the link. It orders copies against the caller's
// stream (the engine's current stream) with events:
//
//   - an offload starts after the work already enqueued on the caller's
//     stream (which wrote the device pages);
//   - a reload starts after that work too (which may still read the device
//     pages it overwrites), and after the offloads named by its tickets;
//   - Sync makes the caller's stream wait for every copy enqueued so far.
//
// The host never blocks in any of these. A Mover is safe for concurrent
// use.
type Mover struct {
	dev Device

	mu       sync.Mutex
	closed   bool
	d2h, h2d Stream
	fence    Stream // runs Done's functions behind both copy streams
	caller   Event  // recorded on the caller's stream, waited on by a copy stream
	lastD2H  Event
	lastH2D  Event
	d2hUsed  bool
	h2dUsed  bool
	next     Ticket
	pending  map[Ticket]Event // offload batches that may not have completed
	free     []Event
	// waiting counts the WaitFor calls waiting (without m.mu) on each
	// event; an event retired meanwhile goes to free only once they are
	// done with it (held), so that it is not recorded for another batch
	// while they wait on it.
	waiting map[Event]int
	held    map[Event]bool
}

// NewMover creates the Mover's streams and events on dev.
func NewMover(dev Device) (*Mover, error) {
	m := &Mover{dev: dev, pending: map[Ticket]Event{}, waiting: map[Event]int{}, held: map[Event]bool{}}
	var err error
	if m.d2h, err = dev.StreamCreate(); err != nil {
		return nil, fmt.Errorf("mover: device-to-host stream: %w", err)
	}
	if m.h2d, err = dev.StreamCreate(); err != nil {
		return nil, errors.Join(fmt.Errorf("mover: host-to-device stream: %w", err), m.release())
	}
	if m.fence, err = dev.StreamCreate(); err != nil {
		return nil, errors.Join(fmt.Errorf("mover: fence stream: %w", err), m.release())
	}
	for _, e := range []*Event{&m.caller, &m.lastD2H, &m.lastH2D} {
		if *e, err = dev.EventCreate(); err != nil {
			return nil, errors.Join(fmt.Errorf("mover: event: %w", err), m.release())
		}
	}
	return m, nil
}

// ErrMoverClosed is returned by calls on a closed Mover.
var ErrMoverClosed = errors.New("cudart: mover is closed")

// Offload enqueues device-to-host copies after the work on caller and
// returns the batch's ticket. When it fails, no copy of the batch is left
// in flight.
func (m *Mover) Offload(caller Stream, copies []Copy) (Ticket, error) {
	return m.batch("offload", DeviceToHost, caller, copies, nil)
}

// Reload enqueues host-to-device copies after the work on caller and after
// the offload batches in after (tickets that completed or never existed
// add no wait), and returns the batch's ticket, which Completed and WaitFor
// accept: a reload's host pages may be reused once it has completed. When
// it fails, no copy of the batch is left in flight.
func (m *Mover) Reload(caller Stream, copies []Copy, after ...Ticket) (Ticket, error) {
	return m.batch("reload", HostToDevice, caller, copies, after)
}

// batch enqueues copies on dir's stream after the work on caller and the
// batches named by after, and tracks them under a new ticket.
func (m *Mover) batch(op string, dir Direction, caller Stream, copies []Copy, after []Ticket) (Ticket, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return 0, ErrMoverClosed
	}
	s, last, used := m.d2h, m.lastD2H, &m.d2hUsed
	if dir == HostToDevice {
		s, last, used = m.h2d, m.lastH2D, &m.h2dUsed
	}
	ev, err := m.event(op)
	if err != nil {
		return 0, err
	}
	// Record and wait before the copies: a failed wait leaves nothing
	// behind on the copy stream but an ordering that is harmless.
	if err := m.after(s, caller); err != nil {
		m.free = append(m.free, ev)
		return 0, err
	}
	for _, t := range after {
		if pev, ok := m.pending[t]; ok {
			if err := m.dev.StreamWaitEvent(s, pev); err != nil {
				m.free = append(m.free, ev)
				return 0, fmt.Errorf("%s: wait for batch %d: %w", op, t, err)
			}
		}
	}
	if err := m.dev.MemcpyBatchAsync(copies, dir, s); err != nil {
		m.free = append(m.free, ev)
		return 0, fmt.Errorf("%s: %w", op, err)
	}
	*used = true
	err = m.dev.EventRecord(ev, s)
	if err == nil {
		err = m.dev.EventRecord(last, s)
	}
	if err != nil {
		// The copies are enqueued but cannot be tracked: let them finish,
		// so that the caller may treat their pages as free.
		m.free = append(m.free, ev)
		return 0, errors.Join(fmt.Errorf("%s: %w", op, err), m.dev.StreamSynchronize(s))
	}
	m.next++
	m.pending[m.next] = ev
	return m.next, nil
}

// Completed reports whether the batch of ticket t, offload or reload, has
// completed. Batches of one direction complete in the order they were
// enqueued. A ticket this Mover never returned is an error.
func (m *Mover) Completed(t Ticket) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return false, ErrMoverClosed
	}
	ev, ok, err := m.lookup(t)
	if !ok || err != nil {
		return !ok && err == nil, err
	}
	done, err := m.dev.EventQuery(ev)
	if err != nil {
		return false, fmt.Errorf("completed %d: %w", t, err)
	}
	if done {
		m.retire(t, ev)
	}
	return done, nil
}

// WaitFor blocks until the batch of ticket t has completed. The Mover's
// other calls go on while it waits.
func (m *Mover) WaitFor(t Ticket) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return ErrMoverClosed
	}
	ev, ok, err := m.lookup(t)
	if !ok || err != nil {
		return err
	}
	m.waiting[ev]++
	m.mu.Unlock()
	err = m.dev.EventSynchronize(ev)
	m.mu.Lock()
	if m.waiting[ev]--; m.waiting[ev] == 0 {
		delete(m.waiting, ev)
		if m.held[ev] {
			delete(m.held, ev)
			m.free = append(m.free, ev)
		}
	}
	if m.closed {
		// Close waited for every copy, this batch's included, and
		// destroyed the events.
		return ErrMoverClosed
	}
	if err != nil {
		return fmt.Errorf("wait for %d: %w", t, err)
	}
	if m.pending[t] == ev {
		m.retire(t, ev)
	}
	return nil
}

// lookup returns the event of ticket t while its batch may be running; ok
// is false when it is known to have completed.
func (m *Mover) lookup(t Ticket) (ev Event, ok bool, err error) {
	if t == 0 || t > m.next {
		return 0, false, fmt.Errorf("mover: unknown ticket %d", t)
	}
	ev, ok = m.pending[t]
	return ev, ok, nil
}

func (m *Mover) retire(t Ticket, ev Event) {
	delete(m.pending, t)
	if m.waiting[ev] > 0 {
		m.held[ev] = true // WaitFor puts it in free when done with it
		return
	}
	m.free = append(m.free, ev)
}

// Sync makes later work on caller wait for every copy enqueued so far in
// both directions. It does not block the host.
func (m *Mover) Sync(caller Stream) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return ErrMoverClosed
	}
	if m.d2hUsed {
		if err := m.dev.StreamWaitEvent(caller, m.lastD2H); err != nil {
			return fmt.Errorf("sync: %w", err)
		}
	}
	if m.h2dUsed {
		if err := m.dev.StreamWaitEvent(caller, m.lastH2D); err != nil {
			return fmt.Errorf("sync: %w", err)
		}
	}
	return nil
}

// Done calls fn on a driver thread once every copy enqueued so far in both
// directions has completed: the moment host pages read by a reload, or
// written by a discarded offload, may be handed out again. fn must not
// call into the Mover or its Device.
func (m *Mover) Done(fn func()) error {
	if fn == nil {
		return fmt.Errorf("mover: nil function")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return ErrMoverClosed
	}
	// The host function goes on a third stream behind waits for both copy
	// streams, so neither copy stream waits for the other.
	if m.d2hUsed {
		if err := m.dev.StreamWaitEvent(m.fence, m.lastD2H); err != nil {
			return fmt.Errorf("done: %w", err)
		}
	}
	if m.h2dUsed {
		if err := m.dev.StreamWaitEvent(m.fence, m.lastH2D); err != nil {
			return fmt.Errorf("done: %w", err)
		}
	}
	return m.dev.LaunchHostFunc(m.fence, fn)
}

// Wait blocks until every copy enqueued so far has completed.
func (m *Mover) Wait() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return ErrMoverClosed
	}
	if err := m.dev.StreamSynchronize(m.d2h); err != nil {
		return err
	}
	return m.dev.StreamSynchronize(m.h2d)
}

// Close waits for the Mover's copies and destroys its streams and events.
func (m *Mover) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	err := errors.Join(m.dev.StreamSynchronize(m.d2h), m.dev.StreamSynchronize(m.h2d), m.dev.StreamSynchronize(m.fence))
	return errors.Join(err, m.release())
}

// after makes copy stream s wait for the work enqueued on caller so far.
func (m *Mover) after(s, caller Stream) error {
	if err := m.dev.EventRecord(m.caller, caller); err != nil {
		return fmt.Errorf("order after the caller's stream: %w", err)
	}
	if err := m.dev.StreamWaitEvent(s, m.caller); err != nil {
		return fmt.Errorf("order after the caller's stream: %w", err)
	}
	return nil
}

// event returns an event for a new batch, first recycling the events of
// batches that have completed.
func (m *Mover) event(op string) (Event, error) {
	for t, ev := range m.pending {
		done, err := m.dev.EventQuery(ev)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", op, err)
		}
		if done {
			m.retire(t, ev)
		}
	}
	if n := len(m.free); n > 0 {
		ev := m.free[n-1]
		m.free = m.free[:n-1]
		return ev, nil
	}
	ev, err := m.dev.EventCreate()
	if err != nil {
		return 0, fmt.Errorf("%s: %w", op, err)
	}
	return ev, nil
}

func (m *Mover) release() error {
	var errs []error
	for _, ev := range m.pending {
		errs = append(errs, m.dev.EventDestroy(ev))
	}
	for _, ev := range m.free {
		errs = append(errs, m.dev.EventDestroy(ev))
	}
	for ev := range m.held {
		errs = append(errs, m.dev.EventDestroy(ev))
	}
	for _, ev := range []Event{m.caller, m.lastD2H, m.lastH2D} {
		if ev != 0 {
			errs = append(errs, m.dev.EventDestroy(ev))
		}
	}
	for _, s := range []Stream{m.d2h, m.h2d, m.fence} {
		if s != 0 {
			errs = append(errs, m.dev.StreamDestroy(s))
		}
	}
	m.pending, m.free, m.held = nil, nil, nil
	return errors.Join(errs...)
}
