package cudart

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

func simDev(t *testing.T, delay time.Duration) Device {
	t.Helper()
	dev, err := NewSim(SimOptions{CopyDelay: delay, MemoryBytes: 256 << 20}).Open(0)
	must(t, err)
	t.Cleanup(func() { dev.Close() })
	return dev
}

var simLayouts = []layoutCase{
	{"dense", 16 << 10, 1, 0},
	{"strided", 16 << 10, 1, 4 << 10},
	{"k+v", 8 << 10, 2, 0},
	{"4-layers-strided", 4 << 10, 4, 512},
}

func TestMoverRoundTripSim(t *testing.T) {
	for i, lc := range simLayouts {
		t.Run(lc.String(), func(t *testing.T) {
			// The delay makes every copy land late, so a missing wait
			// shows up as poisoned or stale bytes.
			scenarioRoundTrip(t, simDev(t, 5*time.Millisecond), lc, 64, 48, 12, uint64(i))
		})
	}
}

func TestMoverBackToBackSim(t *testing.T) {
	scenarioBackToBack(t, simDev(t, 5*time.Millisecond), 8<<10, 10, 1)
}

func TestMoverDoneSim(t *testing.T) {
	scenarioDone(t, simDev(t, 10*time.Millisecond), 4<<10)
}

// TestSyncIsWhatOrders is the control for the scenarios: without Sync, a
// copy on the caller's stream races the reload and (with the simulator's
// delay) reads the old bytes. If this ever passes with new bytes, the
// scenarios above could not catch a missing wait.
func TestSyncIsWhatOrders(t *testing.T) {
	dev := simDev(t, 20*time.Millisecond)
	const page = 4096
	dp, err := dev.MemAlloc(2 * page)
	must(t, err)
	must(t, dev.MemcpyHtoD(dp, bytes.Repeat([]byte{1}, page)))
	host := newPinned(t, dev, 2*page)
	fill(host.b[:page], 2)
	fill(host.b[page:], 0)
	engine, err := dev.StreamCreate()
	must(t, err)
	m, err := NewMover(dev)
	must(t, err)
	defer m.Close()
	// A first reload (of another page) holds the reload stream for one
	// delay, so the real one lands a full delay after the engine's read.
	must1(t)(m.Reload(engine, []Copy{{Dst: uintptr(dp) + page, Src: addr(host.b), Bytes: page}}))
	must1(t)(m.Reload(engine, []Copy{{Dst: uintptr(dp), Src: addr(host.b), Bytes: page}}))
	// No Sync here.
	must(t, dev.MemcpyBatchAsync([]Copy{{Dst: addr(host.b[page:]), Src: uintptr(dp), Bytes: page}}, DeviceToHost, engine))
	must(t, dev.StreamSynchronize(engine))
	if host.b[page] != 1 {
		t.Fatalf("without Sync the engine stream saw byte %d; the simulator no longer exposes missing waits", host.b[page])
	}
	must(t, m.Wait())
}

func TestLayoutCopies(t *testing.T) {
	l := Layout{Regions: []Region{
		{Base: 0x10000, Stride: 0x1000, PageBytes: 0x800, Pages: 8},
		{Base: 0x90000, Stride: 0x1000, PageBytes: 0x400, Pages: 8},
	}}
	if got := l.HostPageBytes(); got != 0xC00 {
		t.Fatalf("HostPageBytes = %#x", got)
	}
	got, err := l.Copies(DeviceToHost, []int{3, 4}, []uintptr{0x100000, 0x200000})
	must(t, err)
	want := []Copy{
		{Dst: 0x100000, Src: 0x13000, Bytes: 0x800},
		{Dst: 0x200000, Src: 0x14000, Bytes: 0x800},
		{Dst: 0x100800, Src: 0x93000, Bytes: 0x400},
		{Dst: 0x200800, Src: 0x94000, Bytes: 0x400},
	}
	if !equalCopies(got, want) {
		t.Errorf("D2H copies %v, want %v", got, want)
	}
	got, err = l.Copies(HostToDevice, []int{3}, []uintptr{0x100000})
	must(t, err)
	want = []Copy{{Dst: 0x13000, Src: 0x100000, Bytes: 0x800}, {Dst: 0x93000, Src: 0x100800, Bytes: 0x400}}
	if !equalCopies(got, want) {
		t.Errorf("H2D copies %v, want %v", got, want)
	}
}

func equalCopies(a, b []Copy) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestLayoutRejects(t *testing.T) {
	good := Region{Base: 0x10000, Stride: 0x1000, PageBytes: 0x1000, Pages: 8}
	with := func(f func(*Region)) Layout {
		r := good
		f(&r)
		return Layout{Regions: []Region{r}}
	}
	one := Layout{Regions: []Region{good}}
	cases := []struct {
		name  string
		l     Layout
		dir   Direction
		dev   []int
		host  []uintptr
		error string
	}{
		{"no regions", Layout{}, HostToDevice, []int{0}, []uintptr{1}, "no regions"},
		{"zero base", with(func(r *Region) { r.Base = 0 }), HostToDevice, []int{0}, []uintptr{1}, "zero base"},
		{"zero page", with(func(r *Region) { r.PageBytes = 0 }), HostToDevice, []int{0}, []uintptr{1}, "zero bytes per page"},
		{"stride < page", with(func(r *Region) { r.Stride = 0x800 }), HostToDevice, []int{0}, []uintptr{1}, "stride 2048 is less"},
		{"no pages", with(func(r *Region) { r.Pages = 0 }), HostToDevice, []int{0}, []uintptr{1}, "0 pages"},
		{"overflow", with(func(r *Region) { r.Stride = 1 << 62 }), HostToDevice, []int{0}, []uintptr{1}, "overflow"},
		{"bad direction", one, Direction(0), []int{0}, []uintptr{1}, "bad direction"},
		{"count mismatch", one, HostToDevice, []int{0, 1}, []uintptr{1}, "2 device pages but 1 host pages"},
		{"empty", one, HostToDevice, nil, nil, "no pages"},
		{"negative", one, HostToDevice, []int{-1}, []uintptr{1}, "device page -1 (position 0) is out of range [0, 8)"},
		{"past end", one, DeviceToHost, []int{2, 8}, []uintptr{1, 2}, "device page 8 (position 1) is out of range"},
		{"duplicate", one, DeviceToHost, []int{2, 2}, []uintptr{1, 2}, "device page 2 appears twice"},
		{"nil host", one, DeviceToHost, []int{2}, []uintptr{0}, "address 0"},
		{"second region shorter", Layout{Regions: []Region{good, {Base: 0x90000, Stride: 0x1000, PageBytes: 0x1000, Pages: 4}}},
			HostToDevice, []int{5}, []uintptr{1}, "out of range [0, 4)"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := c.l.Copies(c.dir, c.dev, c.host)
			if err == nil || !strings.Contains(err.Error(), c.error) {
				t.Fatalf("Copies = %v, %v; want error containing %q", got, err, c.error)
			}
		})
	}
}

func TestMergeRuns(t *testing.T) {
	cases := []struct {
		name     string
		in, want []Copy
	}{
		{"empty", nil, nil},
		{"one", []Copy{{10, 100, 5}}, []Copy{{10, 100, 5}}},
		{"adjacent both sides", []Copy{{10, 100, 5}, {15, 105, 5}, {20, 110, 1}}, []Copy{{10, 100, 11}}},
		{"adjacent on dst only", []Copy{{10, 100, 5}, {15, 200, 5}}, []Copy{{10, 100, 5}, {15, 200, 5}}},
		{"adjacent on src only", []Copy{{10, 100, 5}, {50, 105, 5}}, []Copy{{10, 100, 5}, {50, 105, 5}}},
		{"reverse order is not merged", []Copy{{15, 105, 5}, {10, 100, 5}}, []Copy{{15, 105, 5}, {10, 100, 5}}},
		{"runs", []Copy{{0, 0, 4}, {4, 4, 4}, {100, 8, 4}, {104, 12, 4}}, []Copy{{0, 0, 8}, {100, 8, 8}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			in := append([]Copy(nil), c.in...)
			got := MergeRuns(c.in)
			if !equalCopies(got, c.want) {
				t.Errorf("MergeRuns(%v) = %v, want %v", c.in, got, c.want)
			}
			if !equalCopies(in, c.in) {
				t.Errorf("MergeRuns modified its input")
			}
			// Nothing to merge: the input itself, no allocation.
			if len(got) == len(c.in) {
				if n := testing.AllocsPerRun(10, func() { MergeRuns(c.in) }); n != 0 {
					t.Errorf("MergeRuns of copies that do not merge allocated %v times", n)
				}
			}
			// In place: the same result, in the input's own array.
			if got := MergeRunsInPlace(in); !equalCopies(got, c.want) || (len(got) > 0 && &got[0] != &in[0]) {
				t.Errorf("MergeRunsInPlace(%v) = %v, want %v in the input's array", c.in, got, c.want)
			}
		})
	}
}

func TestMoverMisuse(t *testing.T) {
	dev := simDev(t, 0)
	m, err := NewMover(dev)
	must(t, err)
	engine, err := dev.StreamCreate()
	must(t, err)
	if _, err := m.Offload(engine, nil); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("Offload(empty) = %v", err)
	}
	if _, err := m.Offload(Stream(12345), []Copy{{1, 2, 3}}); !errors.Is(err, ErrInvalidHandle) {
		t.Errorf("Offload(unknown caller stream) = %v", err)
	}
	if _, err := m.Reload(engine, []Copy{{1, 2, 3}}); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("Reload(unregistered) = %v", err)
	}
	if err := m.Done(nil); err == nil {
		t.Error("Done(nil) succeeded")
	}
	// A failed offload hands out no ticket and leaves no pending batch.
	if len(m.pending) != 0 {
		t.Errorf("%d pending batches after failed offloads", len(m.pending))
	}
	must(t, m.Sync(engine))
	must(t, m.Close())
	must(t, m.Close())
	if _, err := m.Offload(engine, []Copy{{1, 2, 3}}); !errors.Is(err, ErrMoverClosed) {
		t.Errorf("Offload after Close = %v", err)
	}
	if err := m.Sync(engine); !errors.Is(err, ErrMoverClosed) {
		t.Errorf("Sync after Close = %v", err)
	}
}

// TestMoverConcurrent shares one Mover among goroutines, each moving its
// own pages out and back on its own caller stream, under the race detector.
func TestMoverConcurrent(t *testing.T) {
	dev := simDev(t, time.Millisecond)
	const workers, page, k = 4, 4096, 8
	m, err := NewMover(dev)
	must(t, err)
	defer m.Close()
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		dp, err := dev.MemAlloc(2 * k * page)
		must(t, err)
		host := newPinned(t, dev, k*page)
		engine, err := dev.StreamCreate()
		must(t, err)
		data := randBytes(2*k*page, uint64(w))
		must(t, dev.MemcpyHtoD(dp, data))
		layout := Layout{Regions: []Region{{Base: dp, Stride: page, PageBytes: page, Pages: 2 * k}}}
		go func() {
			errs <- func() error {
				ha := make([]uintptr, k)
				src, dst := make([]int, k), make([]int, k)
				for i := range ha {
					ha[i] = addr(host.b[i*page:])
					src[i], dst[i] = i, k+i
				}
				for round := 0; round < 5; round++ {
					out, err := layout.Copies(DeviceToHost, src, ha)
					if err != nil {
						return err
					}
					in, err := layout.Copies(HostToDevice, dst, ha)
					if err != nil {
						return err
					}
					tk, err := m.Offload(engine, out)
					if err != nil {
						return err
					}
					if _, err := m.Reload(engine, in, tk); err != nil {
						return err
					}
					if err := m.Sync(engine); err != nil {
						return err
					}
					if err := dev.StreamSynchronize(engine); err != nil {
						return err
					}
				}
				got := make([]byte, k*page)
				if err := dev.MemcpyDtoH(got, dp+k*page); err != nil {
					return err
				}
				if !bytes.Equal(got, data[:k*page]) {
					return errors.New("pages moved by concurrent users of one Mover came back wrong")
				}
				return nil
			}()
		}()
	}
	for w := 0; w < workers; w++ {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

// TestMoverReloadTicket checks that a reload's ticket reports completion
// only once its copies have landed: the reload is held behind a host
// function on the caller's stream that blocks until released.
func TestMoverReloadTicket(t *testing.T) {
	dev := simDev(t, 0)
	const page = 4096
	dp, err := dev.MemAlloc(2 * page)
	must(t, err)
	host := newPinned(t, dev, 2*page)
	fill(host.b[:page], 7)
	fill(host.b[page:], 8)
	engine, err := dev.StreamCreate()
	must(t, err)
	m, err := NewMover(dev)
	must(t, err)
	defer m.Close()

	for _, bad := range []Ticket{0, 1} {
		if _, err := m.Completed(bad); err == nil {
			t.Errorf("Completed(%d) before any batch succeeded", bad)
		}
		if err := m.WaitFor(bad); err == nil {
			t.Errorf("WaitFor(%d) before any batch succeeded", bad)
		}
	}

	release := make(chan struct{})
	must(t, dev.LaunchHostFunc(engine, func() { <-release }))
	first := must1(t)(m.Reload(engine, []Copy{{Dst: uintptr(dp), Src: addr(host.b), Bytes: page}}))
	second := must1(t)(m.Reload(engine, []Copy{{Dst: uintptr(dp) + page, Src: addr(host.b[page:]), Bytes: page}}))
	if first == 0 || second <= first {
		t.Fatalf("tickets %d then %d, want increasing and non-zero", first, second)
	}
	for _, tk := range []Ticket{first, second} {
		if done, err := m.Completed(tk); err != nil || done {
			t.Fatalf("Completed(%d) = %v, %v while the caller's stream holds the reload", tk, done, err)
		}
	}
	if _, err := m.Completed(second + 1); err == nil {
		t.Error("Completed of a ticket not yet handed out succeeded")
	}
	// A failed reload hands out no ticket and leaves no batch behind.
	if _, err := m.Reload(engine, []Copy{{1, 2, 3}}); !errors.Is(err, ErrInvalidValue) {
		t.Fatalf("Reload(unregistered) = %v", err)
	}
	if len(m.pending) != 2 {
		t.Fatalf("%d pending batches, want the 2 reloads", len(m.pending))
	}

	close(release)
	must(t, m.WaitFor(second))
	// The second reload completing implies the first did: one stream.
	for _, tk := range []Ticket{first, second} {
		if done, err := m.Completed(tk); err != nil || !done {
			t.Fatalf("Completed(%d) = %v, %v after WaitFor(%d)", tk, done, err, second)
		}
	}
	got := make([]byte, 2*page)
	must(t, dev.MemcpyDtoH(got, dp))
	if got[0] != 7 || got[page-1] != 7 || got[page] != 8 || got[2*page-1] != 8 {
		t.Fatalf("after WaitFor the device holds %d..%d, %d..%d", got[0], got[page-1], got[page], got[2*page-1])
	}
	// Completed batches give their events back for reuse.
	if len(m.pending) != 0 {
		t.Fatalf("%d pending batches after both completed", len(m.pending))
	}
	must(t, m.WaitFor(first))
	must(t, m.Close())
	if _, err := m.Completed(first); !errors.Is(err, ErrMoverClosed) {
		t.Errorf("Completed after Close = %v", err)
	}
	if err := m.WaitFor(first); !errors.Is(err, ErrMoverClosed) {
		t.Errorf("WaitFor after Close = %v", err)
	}
}

func TestLayoutCopiesFindsDuplicatesInLongLists(t *testing.T) {
	l := Layout{Regions: []Region{{Base: 0x1000, Stride: 16, PageBytes: 16, Pages: 1000}}}
	for _, n := range []int{2, 47, 48, 49, 64, 500} {
		dev, host := make([]int, n), make([]uintptr, n)
		for i := range dev {
			dev[i], host[i] = (i*37)%1000, uintptr(0x100000+i*16)
		}
		if _, err := l.Copies(DeviceToHost, dev, host); err != nil {
			t.Fatalf("%d distinct pages: %v", n, err)
		}
		dev[n-1] = dev[0]
		want := fmt.Sprintf("device page %d appears twice", dev[0])
		if _, err := l.Copies(DeviceToHost, dev, host); err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("%d pages with a duplicate: %v, want %q", n, err, want)
		}
	}
}

// TestMoverWaitForDoesNotBlockOthers: while WaitFor waits for a batch, the
// Mover's other calls go on (they do not wait for that batch), and the
// batch's event is not handed to another batch before WaitFor is done.
func TestMoverWaitForDoesNotBlockOthers(t *testing.T) {
	dev := simDev(t, 0)
	const page = 4096
	dp, err := dev.MemAlloc(4 * page)
	must(t, err)
	host := newPinned(t, dev, 4*page)
	fill(host.b, 3)
	engine, err := dev.StreamCreate()
	must(t, err)
	m, err := NewMover(dev)
	must(t, err)
	defer m.Close()

	release := make(chan struct{})
	must(t, dev.LaunchHostFunc(engine, func() { <-release })) // holds every batch behind it
	first := must1(t)(m.Reload(engine, []Copy{{Dst: uintptr(dp), Src: addr(host.b), Bytes: page}}))
	waited := make(chan error, 1)
	go func() { waited <- m.WaitFor(first) }()
	for {
		m.mu.Lock()
		n := len(m.waiting)
		m.mu.Unlock()
		if n > 0 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	// WaitFor is waiting: these return without the batch having completed.
	if done, err := m.Completed(first); err != nil || done {
		t.Fatalf("Completed(%d) = %v, %v while the batch is held", first, done, err)
	}
	second := must1(t)(m.Offload(engine, []Copy{{Dst: addr(host.b[page:]), Src: uintptr(dp) + page, Bytes: page}}))
	if done, err := m.Completed(second); err != nil || done {
		t.Fatalf("Completed(%d) = %v, %v while the batch is held", second, done, err)
	}
	must(t, m.Sync(engine))
	select {
	case err := <-waited:
		t.Fatalf("WaitFor returned (%v) while its batch was held", err)
	default:
	}
	close(release)
	if err := <-waited; err != nil {
		t.Fatal(err)
	}
	if done, err := m.Completed(first); err != nil || !done {
		t.Fatalf("Completed(%d) = %v, %v after WaitFor", first, done, err)
	}
	must(t, m.WaitFor(second))
	// Every event is back in use once: more batches run and complete.
	for i := range 4 {
		tk := must1(t)(m.Reload(engine, []Copy{{Dst: uintptr(dp) + uintptr(i%4)*page, Src: addr(host.b), Bytes: page}}))
		must(t, m.WaitFor(tk))
	}
	if len(m.waiting) != 0 || len(m.held) != 0 {
		t.Fatalf("waiting %v, held %v after every wait returned", m.waiting, m.held)
	}
}
