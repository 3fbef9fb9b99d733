package client

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/wire"
)

func unsafePointer(b []byte) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(b)) }

func hostmemUnmap(b []byte) { unix.Munmap(b) }

// mapChunk maps size bytes of a chunk's memfd, received from the agent,
// shared and read-write.
func mapChunk(f *os.File, size int64) ([]byte, error) {
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s (%d bytes): %w", f.Name(), size, err)
	}
	return mem, nil
}

// begin readies p for a request: open, connected, completed reloads noted.
// Called with p.mu held.
func (p *CPUPagePool) begin() error {
	if p.closed {
		return errors.New("kvpool: pool is closed")
	}
	p.pollFences()
	return nil
}

// pollFences notes every pending reload whose copy has completed.
func (p *CPUPagePool) pollFences() {
	for len(p.pending) > 0 {
		if t := p.pending[0].copy; t != 0 {
			done, err := p.mover.Completed(t)
			if err != nil || !done {
				return
			}
		}
		p.retire(1)
	}
}

// retire drops the first n pending reloads, whose copies have completed.
func (p *CPUPagePool) retire(n int) {
	p.fenceDone = p.pending[n-1].ticket
	p.pending = append(p.pending[:0], p.pending[n:]...)
}

// waitTicket blocks until the reload of ticket has completed. Called with
// p.mu held, it lets go of p.mu while it waits, so that the pool's other
// calls (from other threads of the engine) go on meanwhile.
func (p *CPUPagePool) waitTicket(ticket uint64) error {
	n := 0
	for n < len(p.pending) && p.pending[n].ticket <= ticket {
		n++
	}
	if n == 0 {
		if ticket <= p.fenceDone {
			return nil
		}
		return fmt.Errorf("%w: agent asks to fence reload %d, which this client never made", ErrProtocol, ticket)
	}
	// Reloads share one copy stream and their copy tickets never decrease
	// along p.pending, so the n-th completing means the first n have.
	if t := p.pending[n-1].copy; t != 0 {
		session, mover := p.session, p.mover
		p.mu.Unlock()
		err := mover.WaitFor(t)
		p.mu.Lock()
		if err != nil {
			return err
		}
		if p.closed {
			return errors.New("kvpool: pool is closed")
		}
		if p.session != session {
			return nil // a new session: its tickets are not these
		}
	}
	// Other calls may have retired some of them meanwhile.
	n = 0
	for n < len(p.pending) && p.pending[n].ticket <= ticket {
		n++
	}
	if n > 0 {
		p.retire(n)
	}
	return nil
}

// stagePages sends the device pages of a long offload or reload that do
// not fit in its own packet as OpPages packets (the first carries the
// fence), and returns the pages the offload or reload itself carries.
func (p *CPUPagePool) stagePages(pages []int32) ([]int32, error) {
	if len(pages) <= wire.MaxPagesPerPacket {
		return pages, nil
	}
	last := len(pages) % wire.MaxPagesPerPacket
	if last == 0 {
		last = wire.MaxPagesPerPacket
	}
	head := pages[:len(pages)-last]
	for off := 0; off < len(head); off += wire.MaxPagesPerPacket {
		part := head[off:min(len(head), off+wire.MaxPagesPerPacket)]
		if _, err := p.roundTrip(wire.OpPages, p.fence(), &wire.Pages{GpuPages: part}, nil); err != nil {
			return nil, err
		}
	}
	return pages[len(head):], nil
}

// longPages returns the host pages of a reply: first when total is 0, else
// first followed by the rest, fetched with OpMore. A dropped connection is
// the caller's to retry (callWith resends the request, whose answer the
// agent keeps, and fetches again).
func (p *CPUPagePool) longPages(op wire.Op, first []int32, total uint32, want int) ([]int32, error) {
	if total == 0 {
		return first, nil
	}
	if int(total) != want || len(first) > want {
		p.dropConn()
		return nil, fmt.Errorf("%w: %s reply of %d host pages says it has %d, for %d device pages", ErrProtocol, op, len(first), total, want)
	}
	all := make([]int32, len(first), total)
	copy(all, first)
	for len(all) < int(total) {
		var rep wire.MoreReply
		if _, err := p.roundTrip(wire.OpMore, 0, &wire.More{Offset: uint32(len(all))}, &rep); err != nil {
			return nil, fmt.Errorf("kvpool %s: host pages %d to %d: %w", op, len(all), total, err)
		}
		if len(rep.HostPages) == 0 || len(all)+len(rep.HostPages) > int(total) {
			p.dropConn()
			return nil, fmt.Errorf("%w: more of %s: %d host pages after %d of %d", ErrProtocol, op, len(rep.HostPages), len(all), total)
		}
		all = append(all, rep.HostPages...)
	}
	return all, nil
}

func (p *CPUPagePool) fence() uint64 {
	if p.fenceDone > p.fenceSent {
		return p.fenceDone
	}
	return 0
}

// OffloadStream copies the device pages gpuPages into fresh host pages and
// records the stream (rid, label) with its metadata. It returns false, having
// changed nothing, when the pool cannot hold every page, and for an offload
// of zero pages (as the seed's engine expects). A second offload of an
// existing (rid, label) is an error (poolerr.ErrDuplicateStream) and leaves the
// existing stream as it was: the seed's Python pool would silently leak the
// old stream's pages instead; reload or discard it first. A stream may be of
// any length up to the session's capacity (long page lists travel in several
// packets). The device pages may be reused once Sync has ordered the reuse
// behind the copy.
//
// When only pages still being read by earlier reloads' copies would make
// room, it waits for the oldest such copy; other calls of the pool go on
// while it waits.
func (p *CPUPagePool) OffloadStream(rid, label string, gpuPages []int32, storedLen, position, released int64) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	m := &p.offReq
	defer func() { m.GpuPages = nil }()
	var host []int32
	stage := func() error {
		m.Rid, m.Label, m.StoredLen, m.Position, m.Released = rid, label, storedLen, position, released
		var err error
		m.GpuPages, err = p.stagePages(gpuPages)
		return err
	}
	fetch := func() error {
		host = nil
		if !p.offRep.Ok {
			return nil
		}
		var err error
		host, err = p.longPages(wire.OpOffload, p.offRep.HostPages, p.offRep.Total, len(gpuPages))
		return err
	}
	var waited uint64 // the last reload this call waited for
	for {
		if err := p.begin(); err != nil {
			return false, err
		}
		_, err := p.callWith(wire.OpOffload, stage, m, &p.offRep, fetch)
		var e *Error
		if errors.As(err, &e) && e.Status == wire.StatusPending && e.Ticket > waited {
			// Only pages still read by reload copies would make room: wait
			// for the oldest such copy, without holding up other calls.
			// Other threads may take the room it makes while this one
			// waits, and the agent then names a later reload: each wait is
			// progress, as reload tickets only grow and waitTicket refuses
			// one this client never made. The same or an earlier ticket
			// again, after its fence went out, would not be.
			waited = e.Ticket
			if werr := p.waitTicket(e.Ticket); werr != nil {
				return false, fmt.Errorf("kvpool offload %q/%q: wait for reload %d: %w", rid, label, e.Ticket, werr)
			}
			continue
		}
		if errors.Is(err, ErrUnavailable) {
			// Fail safe: the engine keeps its device pages.
			p.log.Warn("kvpool: offload refused: the agent is unavailable", "rid", rid, "label", label, "err", err)
			return false, nil
		}
		if err != nil {
			return false, err
		}
		break
	}
	if !p.offRep.Ok {
		return false, nil
	}
	if _, err := p.enqueue(cudart.DeviceToHost, gpuPages, host); err != nil {
		// Nothing was copied: give the pages back so the call changes nothing.
		if _, derr := p.call(wire.OpDiscard, &wire.Stream{Rid: rid, Label: label}, nil); derr != nil {
			err = errors.Join(err, derr)
		}
		return false, fmt.Errorf("kvpool offload %q/%q: %w", rid, label, err)
	}
	return true, nil
}

// ReloadStream copies the stream's host pages onto gpuPages, releases the
// host pages and returns the metadata saved at offload. The device pages
// hold the bytes once Sync has ordered the reader behind the copy.
func (p *CPUPagePool) ReloadStream(rid, label string, gpuPages []int32) (OffloadedStream, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.begin(); err != nil {
		return OffloadedStream{}, err
	}
	m := &p.relReq
	defer func() { m.GpuPages = nil }()
	var host []int32
	var ticket uint64
	released := false
	stage := func() error {
		m.Rid, m.Label = rid, label
		var err error
		m.GpuPages, err = p.stagePages(gpuPages)
		return err
	}
	fetch := func() error {
		released, ticket = true, p.relRep.Ticket
		var err error
		host, err = p.longPages(wire.OpReload, p.relRep.HostPages, p.relRep.Total, len(gpuPages))
		return err
	}
	_, err := p.callWith(wire.OpReload, stage, m, &p.relRep, fetch)
	r := &p.relRep
	out := OffloadedStream{StoredLen: r.StoredLen, Position: r.Position, Released: r.Released}
	if err != nil {
		if !released {
			return OffloadedStream{}, err
		}
		// The agent released the stream; its pages wait for a fence that
		// comes once the reloads before it complete.
		if ticket != 0 {
			p.pending = append(p.pending, pendingReload{ticket: ticket, copy: p.lastReload})
		}
		return out, fmt.Errorf("kvpool reload %q/%q: the stream was released but its host pages did not all arrive: %w", rid, label, err)
	}
	out.CPUPageIndices = append([]int32(nil), host...)
	if len(host) == 0 {
		return out, nil
	}
	t, err := p.enqueue(cudart.HostToDevice, gpuPages, host)
	if err != nil {
		// Nothing of this reload is in flight; its pages may be fenced
		// once the reloads before it have completed.
		t = p.lastReload
	}
	p.pending = append(p.pending, pendingReload{ticket: ticket, copy: t})
	if err != nil {
		return out, fmt.Errorf("kvpool reload %q/%q: the stream was released but its copy failed: %w", rid, label, err)
	}
	return out, nil
}

// enqueue copies device pages dev to host pages host (or back) on the
// mover's stream for dir, after the work on p.o.Order, merging runs that
// are contiguous on both sides. A reload also follows every offload so
// far: the host pages it reads were written by one of them. It returns
// the batch's ticket; when it fails, nothing of the batch is in flight.
func (p *CPUPagePool) enqueue(dir cudart.Direction, dev, host []int32) (cudart.Ticket, error) {
	if len(dev) != len(host) {
		return 0, fmt.Errorf("%w: %d device pages but %d host pages", ErrProtocol, len(dev), len(host))
	}
	if len(dev) == 0 {
		return 0, nil
	}
	p.devIdx, p.hostAddr = p.devIdx[:0], p.hostAddr[:0]
	for i, dp := range dev {
		hp := host[i]
		if hp < 0 || int(hp) >= p.capacity {
			return 0, fmt.Errorf("%w: host page %d outside [0, %d)", ErrProtocol, hp, p.capacity)
		}
		ch := &p.chunks[int(hp)/p.ppc]
		p.devIdx = append(p.devIdx, int(dp))
		p.hostAddr = append(p.hostAddr, ch.base+uintptr(uint64(int(hp)%p.ppc)*p.pageSize))
	}
	copies, err := p.layout.AppendCopies(p.copies[:0], dir, p.devIdx, p.hostAddr)
	if err != nil {
		return 0, fmt.Errorf("kvpool: %w", err)
	}
	copies = cudart.MergeRunsInPlace(copies)
	p.copies = copies // the device is done with it when the batch call returns
	if dir == cudart.DeviceToHost {
		t, err := p.mover.Offload(p.o.Order, copies)
		if err != nil {
			return 0, err
		}
		p.lastOffload = t
		return t, nil
	}
	t, err := p.mover.Reload(p.o.Order, copies, p.lastOffload)
	if err != nil {
		return 0, err
	}
	p.lastReload = t
	return t, nil
}

// Discard drops a stream whose offload was abandoned after the copy: the
// device pages stay live and the host pages go back to the pool. Discarding
// a stream that does not exist is a no-op, as the seed's engine expects (it
// discards every label it claimed after an offload returned false).
func (p *CPUPagePool) Discard(rid, label string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.begin(); err != nil {
		return err
	}
	_, err := p.call(wire.OpDiscard, &wire.Stream{Rid: rid, Label: label}, nil)
	return err
}

// RemoveRequest drops every stream of rid. A request with no streams is not
// an error.
func (p *CPUPagePool) RemoveRequest(rid string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.begin(); err != nil {
		return err
	}
	var rep wire.RemoveRequestReply
	_, err := p.call(wire.OpRemoveRequest, &wire.Request{Rid: rid}, &rep)
	return err
}

// IsOffloaded reports whether rid has any stream on the host.
func (p *CPUPagePool) IsOffloaded(rid string) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.begin(); err != nil {
		return false, err
	}
	p.ridReq.Rid = rid
	_, err := p.call(wire.OpIsOffloaded, &p.ridReq, &p.offd)
	return err == nil && p.offd.Offloaded, err
}

// Labels lists rid's labels in the order they were offloaded.
func (p *CPUPagePool) Labels(rid string) ([]string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.begin(); err != nil {
		return nil, err
	}
	var rep wire.LabelsReply
	var labels []string
	fetch := func() error {
		labels = rep.Labels
		if rep.Total != 0 && int(rep.Total) < len(labels) {
			p.dropConn()
			return fmt.Errorf("%w: labels reply of %d labels says it has %d", ErrProtocol, len(labels), rep.Total)
		}
		for len(labels) < int(rep.Total) {
			var more wire.MoreReply
			if _, err := p.roundTrip(wire.OpMore, 0, &wire.More{Offset: uint32(len(labels))}, &more); err != nil {
				return err
			}
			if len(more.Labels) == 0 || len(labels)+len(more.Labels) > int(rep.Total) {
				p.dropConn()
				return fmt.Errorf("%w: more labels: %d after %d of %d", ErrProtocol, len(more.Labels), len(labels), rep.Total)
			}
			labels = append(labels, more.Labels...)
		}
		return nil
	}
	if _, err := p.callWith(wire.OpLabels, nil, &wire.Request{Rid: rid}, &rep, fetch); err != nil {
		return nil, err
	}
	return labels, nil
}

// NumPages returns the host pages the stream (rid, label) holds: 0 when
// there is no such stream.
func (p *CPUPagePool) NumPages(rid, label string) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.begin(); err != nil {
		return 0, err
	}
	var rep wire.NumPagesReply
	_, err := p.call(wire.OpNumPages, &wire.Stream{Rid: rid, Label: label}, &rep)
	return int(rep.Pages), err
}

// Usage is the session's page accounting as the agent reports it.
type Usage struct {
	Capacity, Used, Pending, Streams, Requests, Free int
}

// Usage returns the session's page accounting.
func (p *CPUPagePool) Usage() (Usage, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.begin(); err != nil {
		return Usage{}, err
	}
	var r wire.UsageReply
	if _, err := p.call(wire.OpUsage, nil, &r); err != nil {
		return Usage{}, err
	}
	return Usage{Capacity: int(r.Capacity), Used: int(r.Used), Pending: int(r.Pending), Streams: int(r.Streams),
		Requests: int(r.Requests), Free: int(r.Free)}, nil
}

// NumFreePages is the seed's num_free_pages: host pages no stream holds.
func (p *CPUPagePool) NumFreePages() (int, error) {
	u, err := p.Usage()
	return u.Free, err
}

// Sync makes later work on s wait for every copy enqueued so far, in both
// directions. It does not block the caller.
func (p *CPUPagePool) Sync(s cudart.Stream) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errors.New("kvpool: pool is closed")
	}
	return p.mover.Sync(s)
}

// Synchronize blocks until every copy enqueued so far has completed and
// reports completed reloads to the agent.
func (p *CPUPagePool) Synchronize() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errors.New("kvpool: pool is closed")
	}
	if err := p.mover.Wait(); err != nil {
		return err
	}
	p.pollFences()
	if f := p.fence(); f != 0 && p.wc != nil {
		if _, err := p.call(wire.OpFence, nil, nil); err != nil {
			return err
		}
	}
	return nil
}

// Session returns the agent's ID of the session and its capacity in pages.
func (p *CPUPagePool) Session() (id uint64, capacity int, pageSize uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.session, p.capacity, p.pageSize
}

// Locality says where the session's chunks lie relative to its GPU, as the
// agent told it when the session was opened (or last resumed).
func (p *CPUPagePool) Locality() Locality {
	p.mu.Lock()
	defer p.mu.Unlock()
	l := p.locality
	l.Chunks = slices.Clone(l.Chunks)
	return l
}

// Disconnect drops the connection without ending the session, as a crash
// of the socket would; the next call reconnects and resumes. For tests and
// for clients that idle for long.
func (p *CPUPagePool) Disconnect() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dropConn()
}

// Close waits for pending copies, ends the session on the agent (its pages
// go back to the allocation) and releases the mappings and streams.
func (p *CPUPagePool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	// The copies touch the session's host pages: they finish before the
	// agent may hand those pages to anyone else.
	err := p.mover.Wait()
	if p.wc != nil {
		_, cerr := p.roundTrip(wire.OpClose, 0, nil, nil)
		err = errors.Join(err, cerr)
		p.dropConn()
	}
	err = errors.Join(err, p.mover.Close())
	p.unmapChunks()
	return err
}
