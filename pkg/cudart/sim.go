package cudart

import (
	"slices"
	"sort"
	"sync"
	"time"
	"unsafe"
)

// SimOptions configures the simulator.
type SimOptions struct {
	// Devices is the number of simulated GPUs (default 1).
	Devices int
	// MemoryBytes is each device's memory (default 1 GiB).
	MemoryBytes uint64
	// CopyDelay is slept before each batch of copies runs, so that code
	// which reads before waiting sees stale bytes instead of passing by luck.
	CopyDelay time.Duration
	// UUIDs names the devices in ordinal order (as a container sees the
	// host's GPUs 4 and 5 as its ordinals 0 and 1); a device past the end
	// of the list is SimulatedUUID(ordinal).
	UUIDs []string
}

// Sim is a Driver whose devices live in host memory. Copies are queued on
// their stream and run later, in stream order, on that stream's goroutine
// or on a thread that waits for the stream (StreamSynchronize,
// EventSynchronize, or a stream waiting on an event of it): the waiter runs
// the queued work itself instead of sleeping until the stream's goroutine
// has. Without a CopyDelay, a batch of at most InlineCopyBytes enqueued on
// an idle stream (nothing queued or running) runs at once, inside
// MemcpyBatchAsync; a stream wait on an event that has completed adds
// nothing to the stream. Both are what the hardware could do too (a copy
// engine may finish before the enqueueing call returns), so every ordering
// the CUDA driver documents still holds; with a CopyDelay every batch is
// queued and delayed, so that code which reads before waiting sees stale
// bytes. Events and stream waits order streams against each other exactly
// as the CUDA driver documents. Every address is checked against live
// allocations and registrations, so an out-of-range copy is an error
// instead of memory corruption.
type Sim struct {
	devs []*simDevice
}

// NewSim returns a simulator with the given options.
func NewSim(o SimOptions) *Sim {
	if o.Devices <= 0 {
		o.Devices = 1
	}
	if o.MemoryBytes == 0 {
		o.MemoryBytes = 1 << 30
	}
	s := &Sim{}
	for i := 0; i < o.Devices; i++ {
		s.devs = append(s.devs, newSimDevice(i, o))
	}
	return s
}

func (s *Sim) Name() string { return "sim" }

func (s *Sim) DeviceCount() (int, error) { return len(s.devs), nil }

// Open returns device ordinal. Every Open of one ordinal returns the same
// device, as every cuCtx of a process shares the primary context.
func (s *Sim) Open(ordinal int) (Device, error) {
	if ordinal < 0 || ordinal >= len(s.devs) {
		return nil, callErr("cuDeviceGet", ErrInvalidDevice, "ordinal %d, have %d simulated devices", ordinal, len(s.devs))
	}
	return s.devs[ordinal], nil
}

const simAlign = 512

// InlineCopyBytes is the largest batch of copies (in bytes) that
// MemcpyBatchAsync runs at once on an idle stream when the simulator has no
// CopyDelay: waking the stream's goroutine for it would cost more than the
// copy.
const InlineCopyBytes = 1 << 20

type devAlloc struct {
	base     uintptr
	mem      []byte
	external bool // RegisterDeviceMemory: the caller's memory, not MemAlloc's
}

type hostReg struct {
	base uintptr
	mem  []byte
}

type simDevice struct {
	ordinal int
	opts    SimOptions

	mu      sync.Mutex
	next    uintptr
	used    uint64
	allocs  []devAlloc // sorted by base
	hosts   []hostReg  // sorted by base
	streams map[Stream]*simStream
	events  map[Event]*simEvent
	handle  uintptr
	closed  bool

	// memMu serializes the bytes of copies and synchronous transfers so
	// that ordering mistakes show up as wrong bytes rather than data races.
	memMu sync.Mutex
}

type simEvent struct {
	st  *simStream // nil: never recorded
	seq uint64
}

func newSimDevice(ordinal int, o SimOptions) *simDevice {
	d := &simDevice{
		ordinal: ordinal,
		opts:    o,
		next:    0x7000_0000_0000 + uintptr(ordinal)<<40,
		streams: map[Stream]*simStream{},
		events:  map[Event]*simEvent{},
	}
	d.streams[0] = newSimStream()
	return d
}

func (d *simDevice) Ordinal() int { return d.ordinal }

func (d *simDevice) UUID() string {
	if d.ordinal < len(d.opts.UUIDs) {
		return d.opts.UUIDs[d.ordinal]
	}
	return SimulatedUUID(d.ordinal)
}

func (d *simDevice) checkOpen(call string) error {
	if d.closed {
		return callErr(call, ErrInvalidHandle, "device %d is closed", d.ordinal)
	}
	return nil
}

func (d *simDevice) MemAlloc(n uint64) (DevicePtr, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("cuMemAlloc"); err != nil {
		return 0, err
	}
	if n == 0 {
		return 0, callErr("cuMemAlloc", ErrInvalidValue, "zero bytes")
	}
	if n > d.opts.MemoryBytes-d.used {
		return 0, callErr("cuMemAlloc", ErrOutOfMemory, "%d bytes requested, %d of %d free", n, d.opts.MemoryBytes-d.used, d.opts.MemoryBytes)
	}
	base := d.skipExternal(d.next, n)
	d.insertAlloc(devAlloc{base: base, mem: make([]byte, n)})
	d.used += n
	// Leave a gap after each allocation so that overruns do not land in
	// a neighbour.
	d.next = base + (uintptr(n)+simAlign-1)/simAlign*simAlign + 64<<10
	return DevicePtr(base), nil
}

func (d *simDevice) MemFree(p DevicePtr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("cuMemFree"); err != nil {
		return err
	}
	i := sort.Search(len(d.allocs), func(i int) bool { return d.allocs[i].base >= uintptr(p) })
	if i == len(d.allocs) || d.allocs[i].base != uintptr(p) || d.allocs[i].external {
		return callErr("cuMemFree", ErrInvalidValue, "%#x is not the start of an allocation", uintptr(p))
	}
	d.used -= uint64(len(d.allocs[i].mem))
	d.allocs = append(d.allocs[:i], d.allocs[i+1:]...)
	return nil
}

// devRange returns the bytes of [p, p+n) in device memory.
func (d *simDevice) devRange(p uintptr, n uint64) ([]byte, bool) {
	i := sort.Search(len(d.allocs), func(i int) bool { return d.allocs[i].base > p }) - 1
	if i < 0 {
		return nil, false
	}
	a := d.allocs[i]
	off := uint64(p - a.base)
	if off > uint64(len(a.mem)) || n > uint64(len(a.mem))-off {
		return nil, false
	}
	return a.mem[off : off+n : off+n], true
}

// hostRange returns the bytes of [p, p+n) in registered host memory.
func (d *simDevice) hostRange(p uintptr, n uint64) ([]byte, bool) {
	i := sort.Search(len(d.hosts), func(i int) bool { return d.hosts[i].base > p }) - 1
	if i < 0 {
		return nil, false
	}
	h := d.hosts[i]
	off := uint64(p - h.base)
	if off > uint64(len(h.mem)) || n > uint64(len(h.mem))-off {
		return nil, false
	}
	return h.mem[off : off+n : off+n], true
}

func (d *simDevice) MemcpyHtoD(dst DevicePtr, src []byte) error {
	d.mu.Lock()
	b, ok := d.devRange(uintptr(dst), uint64(len(src)))
	err := d.checkOpen("cuMemcpyHtoD")
	d.mu.Unlock()
	if err != nil {
		return err
	}
	if !ok {
		return callErr("cuMemcpyHtoD", ErrInvalidValue, "device range %#x+%d is not allocated", uintptr(dst), len(src))
	}
	d.memMu.Lock()
	copy(b, src)
	d.memMu.Unlock()
	return nil
}

func (d *simDevice) MemcpyDtoH(dst []byte, src DevicePtr) error {
	d.mu.Lock()
	b, ok := d.devRange(uintptr(src), uint64(len(dst)))
	err := d.checkOpen("cuMemcpyDtoH")
	d.mu.Unlock()
	if err != nil {
		return err
	}
	if !ok {
		return callErr("cuMemcpyDtoH", ErrInvalidValue, "device range %#x+%d is not allocated", uintptr(src), len(dst))
	}
	d.memMu.Lock()
	copy(dst, b)
	d.memMu.Unlock()
	return nil
}

// addr returns the address of b's first byte. The simulator never turns an
// address back into a pointer; it looks addresses up in its tables.
func addr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

func (d *simDevice) HostRegister(b []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("cuMemHostRegister"); err != nil {
		return err
	}
	if len(b) == 0 {
		return callErr("cuMemHostRegister", ErrInvalidValue, "empty range")
	}
	base := addr(b)
	end := base + uintptr(len(b))
	i := sort.Search(len(d.hosts), func(i int) bool { return d.hosts[i].base >= base })
	if (i < len(d.hosts) && d.hosts[i].base < end) ||
		(i > 0 && d.hosts[i-1].base+uintptr(len(d.hosts[i-1].mem)) > base) {
		return callErr("cuMemHostRegister", ErrHostRegistered, "range %#x+%d overlaps a registered range", base, len(b))
	}
	d.hosts = append(d.hosts, hostReg{})
	copy(d.hosts[i+1:], d.hosts[i:])
	d.hosts[i] = hostReg{base: base, mem: b}
	return nil
}

func (d *simDevice) HostUnregister(b []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("cuMemHostUnregister"); err != nil {
		return err
	}
	base := addr(b)
	i := sort.Search(len(d.hosts), func(i int) bool { return d.hosts[i].base >= base })
	if len(b) == 0 || i == len(d.hosts) || d.hosts[i].base != base {
		return callErr("cuMemHostUnregister", ErrHostNotRegistered, "%#x was not registered", base)
	}
	d.hosts = append(d.hosts[:i], d.hosts[i+1:]...)
	return nil
}

func (d *simDevice) StreamCreate() (Stream, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("cuStreamCreate"); err != nil {
		return 0, err
	}
	d.handle++
	s := Stream(d.handle)
	d.streams[s] = newSimStream()
	return s, nil
}

func (d *simDevice) stream(call string, s Stream) (*simStream, error) {
	if err := d.checkOpen(call); err != nil {
		return nil, err
	}
	st, ok := d.streams[s]
	if !ok {
		return nil, callErr(call, ErrInvalidHandle, "unknown stream %#x", uintptr(s))
	}
	return st, nil
}

func (d *simDevice) event(call string, e Event) (*simEvent, error) {
	if err := d.checkOpen(call); err != nil {
		return nil, err
	}
	ev, ok := d.events[e]
	if !ok {
		return nil, callErr(call, ErrInvalidHandle, "unknown event %#x", uintptr(e))
	}
	return ev, nil
}

func (d *simDevice) StreamDestroy(s Stream) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	st, err := d.stream("cuStreamDestroy", s)
	if err != nil {
		return err
	}
	if s == 0 {
		return callErr("cuStreamDestroy", ErrInvalidHandle, "the default stream cannot be destroyed")
	}
	delete(d.streams, s)
	st.stop() // queued work still runs, as in CUDA
	return nil
}

func (d *simDevice) StreamSynchronize(s Stream) error {
	d.mu.Lock()
	st, err := d.stream("cuStreamSynchronize", s)
	d.mu.Unlock()
	if err != nil {
		return err
	}
	st.wait(st.tail())
	return nil
}

func (d *simDevice) EventCreate() (Event, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("cuEventCreate"); err != nil {
		return 0, err
	}
	d.handle++
	e := Event(d.handle)
	d.events[e] = &simEvent{}
	return e, nil
}

func (d *simDevice) EventDestroy(e Event) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.event("cuEventDestroy", e); err != nil {
		return err
	}
	delete(d.events, e)
	return nil
}

func (d *simDevice) EventRecord(e Event, s Stream) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	ev, err := d.event("cuEventRecord", e)
	if err != nil {
		return err
	}
	st, err := d.stream("cuEventRecord", s)
	if err != nil {
		return err
	}
	ev.st, ev.seq = st, st.tail()
	return nil
}

// mark returns the stream and position an event currently stands for.
func (d *simDevice) mark(call string, e Event) (*simStream, uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	ev, err := d.event(call, e)
	if err != nil {
		return nil, 0, err
	}
	return ev.st, ev.seq, nil
}

func (d *simDevice) EventSynchronize(e Event) error {
	st, seq, err := d.mark("cuEventSynchronize", e)
	if err != nil || st == nil {
		return err
	}
	st.wait(seq)
	return nil
}

func (d *simDevice) EventQuery(e Event) (bool, error) {
	st, seq, err := d.mark("cuEventQuery", e)
	if err != nil || st == nil {
		return err == nil, err
	}
	return st.reached(seq), nil
}

func (d *simDevice) StreamWaitEvent(s Stream, e Event) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	st, err := d.stream("cuStreamWaitEvent", s)
	if err != nil {
		return err
	}
	ev, err := d.event("cuStreamWaitEvent", e)
	if err != nil {
		return err
	}
	if ev.st == nil || ev.st == st {
		return nil // never recorded, or already ordered by the stream itself
	}
	other, seq := ev.st, ev.seq
	if other.reached(seq) {
		return nil // the event has completed: nothing to wait for
	}
	st.push(func() { other.wait(seq) })
	return nil
}

// simPair is one resolved copy of a batch the simulator has queued.
type simPair struct{ dst, src []byte }

// simPairs recycles batches' resolved copies: a batch is on every offload
// and reload, and the simulator stands in for the GPU in benchmarks, where
// its garbage would be counted against the client.
var simPairs = sync.Pool{New: func() any { return new([]simPair) }}

func (d *simDevice) MemcpyBatchAsync(copies []Copy, dir Direction, s Stream) error {
	const call = "cuMemcpyBatchAsync"
	d.mu.Lock()
	defer d.mu.Unlock()
	st, err := d.stream(call, s)
	if err != nil {
		return err
	}
	if len(copies) == 0 {
		return callErr(call, ErrInvalidValue, "empty batch")
	}
	pp := simPairs.Get().(*[]simPair)
	pairs := slices.Grow((*pp)[:0], len(copies))[:len(copies)]
	recycle := func() {
		clear(pairs)
		*pp = pairs[:0]
		simPairs.Put(pp)
	}
	var total uint64
	for i, c := range copies {
		var dst, src []byte
		var okD, okS bool
		switch dir {
		case HostToDevice:
			src, okS = d.hostRange(c.Src, c.Bytes)
			dst, okD = d.devRange(c.Dst, c.Bytes)
		case DeviceToHost:
			src, okS = d.devRange(c.Src, c.Bytes)
			dst, okD = d.hostRange(c.Dst, c.Bytes)
		default:
			return callErr(call, ErrInvalidValue, "bad direction %v", dir)
		}
		if c.Bytes == 0 {
			return callErr(call, ErrInvalidValue, "copy %d: zero bytes", i)
		}
		if !okS {
			return callErr(call, ErrInvalidValue, "copy %d (%v): source %#x+%d is outside %s", i, dir, c.Src, c.Bytes, side(dir, true))
		}
		if !okD {
			return callErr(call, ErrInvalidValue, "copy %d (%v): destination %#x+%d is outside %s", i, dir, c.Dst, c.Bytes, side(dir, false))
		}
		pairs[i] = simPair{dst, src}
		total += c.Bytes
	}
	delay := d.opts.CopyDelay
	run := func() {
		if delay > 0 {
			time.Sleep(delay)
		}
		d.memMu.Lock()
		for _, p := range pairs {
			copy(p.dst, p.src)
		}
		d.memMu.Unlock()
		recycle()
	}
	if delay == 0 && total <= InlineCopyBytes && st.runIfIdle(run) {
		return nil
	}
	st.push(run)
	return nil
}

func side(dir Direction, src bool) string {
	if (dir == HostToDevice) == src {
		return "registered host memory"
	}
	return "device allocations"
}

func (d *simDevice) LaunchHostFunc(s Stream, fn func()) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	st, err := d.stream("cuLaunchHostFunc", s)
	if err != nil {
		return err
	}
	if fn == nil {
		return callErr("cuLaunchHostFunc", ErrInvalidValue, "nil function")
	}
	st.push(fn)
	return nil
}

// Close waits for queued work, stops every stream and frees the device's
// memory. Later calls fail with CUDA_ERROR_INVALID_HANDLE.
func (d *simDevice) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	streams := d.streams
	d.streams, d.events, d.allocs, d.hosts = nil, nil, nil, nil
	d.mu.Unlock()
	for _, st := range streams {
		st.stop()
		st.wait(st.tail())
	}
	return nil
}

// simStream runs queued work in order, one item at a time: on its own
// goroutine, or on a thread waiting for it (wait), or at once in the
// enqueueing call when it is idle (runIfIdle). done counts finished items;
// a position p is reached when done >= p.
type simStream struct {
	mu      sync.Mutex
	cond    sync.Cond
	queue   []func()
	pushed  uint64
	done    uint64
	running bool // an item is running (on whichever thread took it)
	waiters int  // threads in wait, sleeping on cond
	stopped bool
}

func newSimStream() *simStream {
	st := &simStream{}
	st.cond.L = &st.mu
	go st.run()
	return st
}

func (st *simStream) run() {
	st.mu.Lock()
	defer st.mu.Unlock()
	for {
		for len(st.queue) == 0 || st.running {
			if st.stopped && len(st.queue) == 0 {
				return
			}
			st.cond.Wait()
		}
		st.runNext()
	}
}

// runNext runs the first queued item. Called with st.mu held, the queue
// not empty and nothing running; it lets go of st.mu while the item runs.
func (st *simStream) runNext() {
	fn := st.queue[0]
	st.queue[0] = nil
	st.queue = st.queue[1:]
	st.running = true
	st.mu.Unlock()
	fn()
	st.mu.Lock()
	st.running = false
	st.done++
	// Wake whoever needs it: waiters for a position, or the stream's
	// goroutine when work is queued behind this item. An item run on an
	// idle stream with nobody waiting wakes nobody (waking the goroutine
	// for nothing costs a thread wake-up per copy).
	if st.waiters > 0 || len(st.queue) > 0 {
		st.cond.Broadcast()
	}
}

func (st *simStream) push(fn func()) {
	st.mu.Lock()
	st.queue = append(st.queue, fn)
	st.pushed++
	st.mu.Unlock()
	st.cond.Broadcast()
}

// runIfIdle runs fn now, as the stream's next item, when nothing is queued
// or running; it reports whether it did.
func (st *simStream) runIfIdle(fn func()) bool {
	st.mu.Lock()
	if len(st.queue) > 0 || st.running || st.stopped {
		st.mu.Unlock()
		return false
	}
	st.pushed++
	st.queue = append(st.queue, fn)
	st.runNext()
	st.mu.Unlock()
	return true
}

func (st *simStream) tail() uint64 {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.pushed
}

func (st *simStream) reached(seq uint64) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.done >= seq
}

// wait returns once position seq is reached. While the stream has work
// queued and none running, the caller runs it itself rather than sleeping
// until the stream's goroutine has: the same items in the same order.
func (st *simStream) wait(seq uint64) {
	st.mu.Lock()
	for st.done < seq {
		if !st.running && len(st.queue) > 0 {
			st.runNext()
			continue
		}
		st.waiters++
		st.cond.Wait()
		st.waiters--
	}
	st.mu.Unlock()
}

func (st *simStream) stop() {
	st.mu.Lock()
	st.stopped = true
	st.mu.Unlock()
	st.cond.Broadcast()
}
