package client

import (
	"context"
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/wire"
)

func unsafePointer(b []byte) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(b)) }

func hostmemUnmap(b []byte) { unix.Munmap(b) }

// begin readies p for a request: open, connected, completed reloads noted.
// Called with p.mu held.
func (p *CPUPagePool) begin() error {
	if p.closed {
		return errors.New("kvpool: pool is closed")
	}
	if p.wc == nil {
		if err := p.connect(context.Background()); err != nil {
			return fmt.Errorf("kvpool: reconnect: %w", err)
		}
	}
	p.pollFences()
	return nil
}

// pollFences notes every pending reload whose copy has completed.
func (p *CPUPagePool) pollFences() {
	for len(p.pending) > 0 {
		r := p.pending[0]
		done, err := p.dev.EventQuery(r.ev)
		if err != nil || !done {
			return
		}
		p.retire(1)
	}
}

// retire drops the first n pending reloads, whose copies have completed.
func (p *CPUPagePool) retire(n int) {
	for _, r := range p.pending[:n] {
		p.fenceDone = r.ticket
		p.freeEvs = append(p.freeEvs, r.ev)
	}
	p.pending = append(p.pending[:0], p.pending[n:]...)
}

// waitTicket blocks until the reload of ticket has completed.
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
	if err := p.dev.EventSynchronize(p.pending[n-1].ev); err != nil {
		return err
	}
	p.retire(n)
	return nil
}

func (p *CPUPagePool) fence() uint64 {
	if p.fenceDone > p.fenceSent {
		return p.fenceDone
	}
	return 0
}

// OffloadStream copies the device pages gpuPages into fresh host pages and
// records the stream (rid, label) with its metadata. It returns false, having
// changed nothing, when the pool cannot hold every page. The device pages may
// be reused once Sync has ordered the reuse behind the copy.
func (p *CPUPagePool) OffloadStream(rid, label string, gpuPages []int32, storedLen, position, released int64) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.begin(); err != nil {
		return false, err
	}
	m := &p.offReq
	m.Rid, m.Label, m.GpuPages, m.StoredLen, m.Position, m.Released = rid, label, gpuPages, storedLen, position, released
	defer func() { m.GpuPages = nil }()
	for try := 0; ; try++ {
		_, err := p.roundTrip(wire.OpOffload, p.fence(), m, &p.offRep)
		var e *Error
		if errors.As(err, &e) && e.Status == wire.StatusPending && try <= len(p.pending) {
			if werr := p.waitTicket(e.Ticket); werr != nil {
				return false, fmt.Errorf("kvpool offload %q/%q: wait for reload %d: %w", rid, label, e.Ticket, werr)
			}
			continue
		}
		if err != nil {
			return false, err
		}
		break
	}
	if !p.offRep.Ok {
		return false, nil
	}
	if err := p.enqueue(cudart.DeviceToHost, gpuPages, p.offRep.HostPages); err != nil {
		// Nothing was copied: give the pages back so the call changes nothing.
		if _, derr := p.roundTrip(wire.OpDiscard, p.fence(), &wire.Stream{Rid: rid, Label: label}, nil); derr != nil {
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
	m.Rid, m.Label, m.GpuPages = rid, label, gpuPages
	defer func() { m.GpuPages = nil }()
	if _, err := p.roundTrip(wire.OpReload, p.fence(), m, &p.relRep); err != nil {
		return OffloadedStream{}, err
	}
	r := &p.relRep
	out := OffloadedStream{CPUPageIndices: append([]int32(nil), r.HostPages...), StoredLen: r.StoredLen, Position: r.Position, Released: r.Released}
	if len(r.HostPages) == 0 {
		return out, nil
	}
	// The host pages were written by offload copies on the D2H stream.
	if err := p.dev.EventRecord(p.d2hEv, p.d2h); err != nil {
		return out, err
	}
	if err := p.dev.StreamWaitEvent(p.h2d, p.d2hEv); err != nil {
		return out, err
	}
	cerr := p.enqueue(cudart.HostToDevice, gpuPages, r.HostPages)
	// Record the ticket's event even when the copy failed: the pages must
	// be fenced either way, and an event after no work completes at once.
	ev, err := p.event()
	if err == nil {
		err = p.dev.EventRecord(ev, p.h2d)
	}
	if err != nil {
		p.dev.StreamSynchronize(p.h2d)
		p.fenceDone = r.Ticket
		p.pending = p.pending[:0]
	} else {
		p.pending = append(p.pending, pendingReload{ticket: r.Ticket, ev: ev})
	}
	if cerr != nil {
		return out, fmt.Errorf("kvpool reload %q/%q: the stream was released but its copy failed: %w", rid, label, cerr)
	}
	return out, err
}

func (p *CPUPagePool) event() (cudart.Event, error) {
	if n := len(p.freeEvs); n > 0 {
		ev := p.freeEvs[n-1]
		p.freeEvs = p.freeEvs[:n-1]
		return ev, nil
	}
	return p.dev.EventCreate()
}

// enqueue orders dir's stream behind p.o.Order and enqueues one batch
// copying device pages dev to host pages host (or back), merging runs that
// are contiguous on both sides.
func (p *CPUPagePool) enqueue(dir cudart.Direction, dev, host []int32) error {
	if len(dev) != len(host) {
		return fmt.Errorf("%w: %d device pages but %d host pages", ErrProtocol, len(dev), len(host))
	}
	if len(dev) == 0 {
		return nil
	}
	s := p.d2h
	if dir == cudart.HostToDevice {
		s = p.h2d
	}
	cs := p.copies[:0]
	for ri, r := range p.o.Regions {
		off := p.offsets[ri]
		for i, dp := range dev {
			hp := host[i]
			if dp < 0 || int(dp) >= p.devPages {
				return fmt.Errorf("kvpool: device page %d outside [0, %d)", dp, p.devPages)
			}
			if hp < 0 || int(hp) >= p.capacity {
				return fmt.Errorf("%w: host page %d outside [0, %d)", ErrProtocol, hp, p.capacity)
			}
			ch := &p.chunks[int(hp)/p.ppc]
			h := ch.base + uintptr(uint64(int(hp)%p.ppc)*p.pageSize+off)
			d := uintptr(r.Base) + uintptr(uint64(dp)*r.Stride)
			c := cudart.Copy{Dst: h, Src: d, Bytes: r.BytesPerPage}
			if dir == cudart.HostToDevice {
				c.Dst, c.Src = d, h
			}
			if n := len(cs); n > 0 && cs[n-1].Dst+uintptr(cs[n-1].Bytes) == c.Dst && cs[n-1].Src+uintptr(cs[n-1].Bytes) == c.Src {
				cs[n-1].Bytes += c.Bytes
				continue
			}
			cs = append(cs, c)
		}
	}
	p.copies = cs
	if err := p.dev.EventRecord(p.orderEv, p.o.Order); err != nil {
		return err
	}
	if err := p.dev.StreamWaitEvent(s, p.orderEv); err != nil {
		return err
	}
	return p.dev.MemcpyBatchAsync(cs, dir, s)
}

// Discard drops a stream whose offload was abandoned after the copy: the
// device pages stay live and the host pages go back to the pool.
func (p *CPUPagePool) Discard(rid, label string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.begin(); err != nil {
		return err
	}
	_, err := p.roundTrip(wire.OpDiscard, p.fence(), &wire.Stream{Rid: rid, Label: label}, nil)
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
	_, err := p.roundTrip(wire.OpRemoveRequest, p.fence(), &wire.Request{Rid: rid}, &rep)
	return err
}

// IsOffloaded reports whether rid has any stream on the host.
func (p *CPUPagePool) IsOffloaded(rid string) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.begin(); err != nil {
		return false, err
	}
	var rep wire.IsOffloadedReply
	_, err := p.roundTrip(wire.OpIsOffloaded, p.fence(), &wire.Request{Rid: rid}, &rep)
	return rep.Offloaded, err
}

// Labels lists rid's labels in the order they were offloaded.
func (p *CPUPagePool) Labels(rid string) ([]string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.begin(); err != nil {
		return nil, err
	}
	var rep wire.LabelsReply
	_, err := p.roundTrip(wire.OpLabels, p.fence(), &wire.Request{Rid: rid}, &rep)
	return rep.Labels, err
}

// NumPages returns the host pages the stream (rid, label) holds.
func (p *CPUPagePool) NumPages(rid, label string) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.begin(); err != nil {
		return 0, err
	}
	var rep wire.NumPagesReply
	_, err := p.roundTrip(wire.OpNumPages, p.fence(), &wire.Stream{Rid: rid, Label: label}, &rep)
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
	if _, err := p.roundTrip(wire.OpUsage, p.fence(), nil, &r); err != nil {
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
	for _, x := range []struct {
		ev cudart.Event
		st cudart.Stream
	}{{p.syncD2H, p.d2h}, {p.syncH2D, p.h2d}} {
		if err := p.dev.EventRecord(x.ev, x.st); err != nil {
			return err
		}
		if err := p.dev.StreamWaitEvent(s, x.ev); err != nil {
			return err
		}
	}
	return nil
}

// Synchronize blocks until every copy enqueued so far has completed and
// reports completed reloads to the agent.
func (p *CPUPagePool) Synchronize() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errors.New("kvpool: pool is closed")
	}
	if err := p.dev.StreamSynchronize(p.d2h); err != nil {
		return err
	}
	if err := p.dev.StreamSynchronize(p.h2d); err != nil {
		return err
	}
	p.pollFences()
	if f := p.fence(); f != 0 && p.wc != nil {
		if _, err := p.roundTrip(wire.OpFence, f, nil, nil); err != nil {
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
	var err error
	if p.wc != nil {
		_, err = p.roundTrip(wire.OpClose, 0, nil, nil)
		p.dropConn()
	}
	p.destroyStreams()
	p.unmapChunks()
	return err
}
