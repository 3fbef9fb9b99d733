package cudart

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"testing"
	"time"
)

// fixture: one device with a 64-page device buffer, a registered host
// buffer of the same size, a copy stream and a "compute" stream standing in
// for the engine's current stream.
type fixture struct {
	dev           Device
	dptr          DevicePtr
	host          []byte
	copyS, engine Stream
	ev            Event
}

const (
	pages    = 64
	pageSize = 4096
)

func newFixture(t *testing.T, delay time.Duration) *fixture {
	t.Helper()
	dev, err := NewSim(SimOptions{CopyDelay: delay}).Open(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.Close() })
	f := &fixture{dev: dev, host: make([]byte, pages*pageSize)}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	f.dptr, err = dev.MemAlloc(pages * pageSize)
	must(err)
	must(dev.HostRegister(f.host))
	f.copyS, err = dev.StreamCreate()
	must(err)
	f.engine, err = dev.StreamCreate()
	must(err)
	f.ev, err = dev.EventCreate()
	must(err)
	return f
}

func randBytes(n int, seed uint64) []byte {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed)
	b := make([]byte, n)
	rand.NewChaCha8(key).Read(b)
	return b
}

// TestReloadNeedsEventWait is the reason the simulator exists: a kernel on
// the engine's stream that reads reloaded pages sees them only if the
// engine's stream waited on the copy's event.
func TestReloadNeedsEventWait(t *testing.T) {
	for _, wait := range []bool{false, true} {
		name := map[bool]string{false: "without wait", true: "with wait"}[wait]
		t.Run(name, func(t *testing.T) {
			f := newFixture(t, 30*time.Millisecond)
			want := randBytes(pages*pageSize, 7)
			copy(f.host, want)
			poison := bytes.Repeat([]byte{0xA5}, pages*pageSize)
			if err := f.dev.MemcpyHtoD(f.dptr, poison); err != nil {
				t.Fatal(err)
			}
			// Reload pages in reverse order, one copy per page.
			var batch []Copy
			for i := 0; i < pages; i++ {
				batch = append(batch, Copy{
					Dst:   uintptr(f.dptr) + uintptr((pages-1-i)*pageSize),
					Src:   addr(f.host) + uintptr(i*pageSize),
					Bytes: pageSize,
				})
			}
			if err := f.dev.MemcpyBatchAsync(batch, HostToDevice, f.copyS); err != nil {
				t.Fatal(err)
			}
			if err := f.dev.EventRecord(f.ev, f.copyS); err != nil {
				t.Fatal(err)
			}
			if wait {
				if err := f.dev.StreamWaitEvent(f.engine, f.ev); err != nil {
					t.Fatal(err)
				}
			}
			seen := make([]byte, pages*pageSize)
			if err := f.dev.LaunchHostFunc(f.engine, func() {
				if err := f.dev.MemcpyDtoH(seen, f.dptr); err != nil {
					t.Error(err)
				}
			}); err != nil {
				t.Fatal(err)
			}
			if err := f.dev.StreamSynchronize(f.engine); err != nil {
				t.Fatal(err)
			}
			expect := make([]byte, 0, len(want))
			for i := pages - 1; i >= 0; i-- {
				expect = append(expect, want[i*pageSize:(i+1)*pageSize]...)
			}
			if got := bytes.Equal(seen, expect); got != wait {
				t.Fatalf("engine saw reloaded bytes: %v, want %v", got, wait)
			}
			if !wait && !bytes.Equal(seen, poison) {
				t.Fatal("without a wait the engine should have read the poisoned pages")
			}
			// Once the copy stream is done the bytes are there either way.
			if err := f.dev.StreamSynchronize(f.copyS); err != nil {
				t.Fatal(err)
			}
			if err := f.dev.MemcpyDtoH(seen, f.dptr); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(seen, expect) {
				t.Fatal("bytes wrong after synchronize")
			}
		})
	}
}

func TestOffloadThenReloadOrderedByEvents(t *testing.T) {
	f := newFixture(t, 5*time.Millisecond)
	want := randBytes(pages*pageSize, 3)
	if err := f.dev.MemcpyHtoD(f.dptr, want); err != nil {
		t.Fatal(err)
	}
	d2h, err := f.dev.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	// Offload on d2h, then reload to other device pages on copyS. The
	// reload must wait for the offload through an event.
	half := uintptr(pages / 2 * pageSize)
	if err := f.dev.MemcpyBatchAsync([]Copy{{Dst: addr(f.host), Src: uintptr(f.dptr), Bytes: uint64(half)}}, DeviceToHost, d2h); err != nil {
		t.Fatal(err)
	}
	done, _ := f.dev.EventQuery(f.ev)
	if !done {
		t.Fatal("an event never recorded must count as complete")
	}
	if err := f.dev.EventRecord(f.ev, d2h); err != nil {
		t.Fatal(err)
	}
	if err := f.dev.StreamWaitEvent(f.copyS, f.ev); err != nil {
		t.Fatal(err)
	}
	if err := f.dev.MemcpyBatchAsync([]Copy{{Dst: uintptr(f.dptr) + half, Src: addr(f.host), Bytes: uint64(half)}}, HostToDevice, f.copyS); err != nil {
		t.Fatal(err)
	}
	if err := f.dev.StreamSynchronize(f.copyS); err != nil {
		t.Fatal(err)
	}
	if done, err := f.dev.EventQuery(f.ev); err != nil || !done {
		t.Fatalf("event after the dependent stream finished: %v, %v", done, err)
	}
	got := make([]byte, pages*pageSize)
	if err := f.dev.MemcpyDtoH(got, f.dptr); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[half:], want[:half]) {
		t.Fatal("reload did not see the offloaded bytes")
	}
}

func TestSimErrors(t *testing.T) {
	f := newFixture(t, 0)
	unreg := make([]byte, pageSize)
	cases := []struct {
		name string
		call func() error
		want *Error
	}{
		{"copy past device allocation", func() error {
			return f.dev.MemcpyBatchAsync([]Copy{{Dst: uintptr(f.dptr) + pages*pageSize - 1, Src: addr(f.host), Bytes: 2}}, HostToDevice, f.copyS)
		}, ErrInvalidValue},
		{"copy from unregistered host memory", func() error {
			return f.dev.MemcpyBatchAsync([]Copy{{Dst: uintptr(f.dptr), Src: addr(unreg), Bytes: 1}}, HostToDevice, f.copyS)
		}, ErrInvalidValue},
		{"copy past host registration", func() error {
			return f.dev.MemcpyBatchAsync([]Copy{{Dst: addr(f.host) + 1, Src: uintptr(f.dptr), Bytes: pages * pageSize}}, DeviceToHost, f.copyS)
		}, ErrInvalidValue},
		{"zero-byte copy", func() error {
			return f.dev.MemcpyBatchAsync([]Copy{{Dst: uintptr(f.dptr), Src: addr(f.host)}}, HostToDevice, f.copyS)
		}, ErrInvalidValue},
		{"empty batch", func() error { return f.dev.MemcpyBatchAsync(nil, HostToDevice, f.copyS) }, ErrInvalidValue},
		{"bad direction", func() error {
			return f.dev.MemcpyBatchAsync([]Copy{{Dst: uintptr(f.dptr), Src: addr(f.host), Bytes: 1}}, 9, f.copyS)
		}, ErrInvalidValue},
		{"unknown stream", func() error {
			return f.dev.MemcpyBatchAsync([]Copy{{Dst: uintptr(f.dptr), Src: addr(f.host), Bytes: 1}}, HostToDevice, 999)
		}, ErrInvalidHandle},
		{"unknown event", func() error { return f.dev.EventRecord(999, f.copyS) }, ErrInvalidHandle},
		{"register twice", func() error { return f.dev.HostRegister(f.host[pageSize:]) }, ErrHostRegistered},
		{"unregister unknown", func() error { return f.dev.HostUnregister(unreg) }, ErrHostNotRegistered},
		{"free interior pointer", func() error { return f.dev.MemFree(f.dptr + 8) }, ErrInvalidValue},
		{"alloc too much", func() error { _, err := f.dev.MemAlloc(2 << 30); return err }, ErrOutOfMemory},
		{"destroy default stream", func() error { return f.dev.StreamDestroy(0) }, ErrInvalidHandle},
		{"sync read out of range", func() error { return f.dev.MemcpyDtoH(make([]byte, 2), f.dptr+pages*pageSize-1) }, ErrInvalidValue},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.call()
			if !errors.Is(err, c.want) {
				t.Fatalf("got %v, want %s", err, c.want.Name)
			}
			var ce *Error
			if !errors.As(err, &ce) || ce.Call == "" || ce.Msg == "" {
				t.Fatalf("error %v should name the call and say why", err)
			}
		})
	}
	// Nothing above may have queued work or changed memory.
	if err := f.dev.StreamSynchronize(f.copyS); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, pages*pageSize)
	if err := f.dev.MemcpyDtoH(got, f.dptr); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, make([]byte, pages*pageSize)) {
		t.Fatal("a rejected call changed device memory")
	}
	if _, err := NewSim(SimOptions{Devices: 2}).Open(2); !errors.Is(err, ErrInvalidDevice) {
		t.Fatalf("open ordinal 2 of 2: %v", err)
	}
	f.dev.Close()
	if _, err := f.dev.StreamCreate(); !errors.Is(err, ErrInvalidHandle) {
		t.Fatalf("after Close: %v", err)
	}
}

// TestSimWaiterRunsQueuedWork: a stream whose goroutine never runs still
// makes progress when a thread waits for it, in order.
func TestSimWaiterRunsQueuedWork(t *testing.T) {
	st := &simStream{} // no goroutine: only waiters run its work
	st.cond.L = &st.mu
	var order []int
	for i := range 3 {
		st.push(func() { order = append(order, i) })
	}
	st.wait(2)
	if len(order) != 2 || st.reached(3) {
		t.Fatalf("after wait(2): ran %v", order)
	}
	st.wait(st.tail())
	if len(order) != 3 || order[0] != 0 || order[1] != 1 || order[2] != 2 {
		t.Fatalf("ran %v, want [0 1 2]", order)
	}
}

// TestSimInlineCopies: without a copy delay a small batch on an idle stream
// has completed when MemcpyBatchAsync returns, and a wait on a completed
// event adds nothing to the waiting stream; with a delay, or behind queued
// work, the batch is queued.
func TestSimInlineCopies(t *testing.T) {
	for _, delay := range []time.Duration{0, 20 * time.Millisecond} {
		f := newFixture(t, delay)
		copy(f.host, randBytes(pages*pageSize, 3))
		batch := []Copy{{Dst: uintptr(f.dptr), Src: addr(f.host), Bytes: pageSize}}
		if err := f.dev.MemcpyBatchAsync(batch, HostToDevice, f.copyS); err != nil {
			t.Fatal(err)
		}
		if err := f.dev.EventRecord(f.ev, f.copyS); err != nil {
			t.Fatal(err)
		}
		done, err := f.dev.EventQuery(f.ev)
		if err != nil || done != (delay == 0) {
			t.Fatalf("delay %v: batch completed on return: %v (%v), want %v", delay, done, err, delay == 0)
		}
		d := f.dev.(*simDevice)
		eng := d.streams[f.engine]
		before := eng.tail()
		if err := f.dev.StreamWaitEvent(f.engine, f.ev); err != nil {
			t.Fatal(err)
		}
		if added := eng.tail() - before; added != map[bool]uint64{true: 0, false: 1}[delay == 0] {
			t.Fatalf("delay %v: the wait added %d items to the engine stream", delay, added)
		}
		got := make([]byte, pageSize)
		if err := f.dev.StreamSynchronize(f.engine); err != nil {
			t.Fatal(err)
		}
		if err := f.dev.MemcpyDtoH(got, f.dptr); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, f.host[:pageSize]) {
			t.Fatalf("delay %v: bytes wrong after the wait", delay)
		}
		// Behind queued work (a blocked host function) a batch is queued.
		release := make(chan struct{})
		if err := f.dev.LaunchHostFunc(f.copyS, func() { <-release }); err != nil {
			t.Fatal(err)
		}
		if err := f.dev.MemcpyBatchAsync(batch, HostToDevice, f.copyS); err != nil {
			t.Fatal(err)
		}
		if err := f.dev.EventRecord(f.ev, f.copyS); err != nil {
			t.Fatal(err)
		}
		if done, _ := f.dev.EventQuery(f.ev); done {
			t.Fatalf("delay %v: a batch behind a blocked host function completed", delay)
		}
		close(release)
		if err := f.dev.EventSynchronize(f.ev); err != nil {
			t.Fatal(err)
		}
	}
}
