package wire

import (
	"runtime"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// The hot path's encoding cost, to set against a round trip of ~7-25 µs:
//
//	go test -run XXX -bench Codec ./pkg/wire

func hotPages() []int32 {
	p := make([]int32, 64)
	for i := range p {
		p[i] = int32(i*37 + 1000)
	}
	return p
}

func BenchmarkCodecEncodeOffload(b *testing.B) {
	m := &Offload{Rid: "request-0001", Label: "attention", GpuPages: hotPages(), StoredLen: 1000, Position: 1024}
	var buf []byte
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		var err error
		buf, err = AppendPacket(buf[:0], Header{Op: OpOffload, Seq: uint32(i)}, m)
		if err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(len(buf)), "bytes")
}

func BenchmarkCodecDecodeOffload(b *testing.B) {
	pkt, _ := AppendPacket(nil, Header{Op: OpOffload}, &Offload{Rid: "request-0001", Label: "attention", GpuPages: hotPages(), StoredLen: 1000, Position: 1024})
	var m Offload
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		_, body, err := ParseHeader(pkt)
		if err == nil {
			err = DecodeBody(body, &m)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkCodecReloadReply(b *testing.B) {
	rep := &ReloadReply{HostPages: hotPages(), StoredLen: 1000, Position: 1024, Ticket: 12345}
	var buf []byte
	var m ReloadReply
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		var err error
		buf, err = AppendPacket(buf[:0], Header{Op: OpReload}, rep)
		if err == nil {
			_, body, _ := ParseHeader(buf)
			err = DecodeBody(body, &m)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkKernelWaitWindow measures how long one direct recvmsg with
// nothing to read really waits in the kernel before it gives up, for the
// default kernel wait and the limit: SO_RCVTIMEO is counted in scheduler
// ticks, so the window is longer than asked (window-ms):
//
//	go test -run XXX -bench KernelWaitWindow -benchtime 20x ./pkg/wire
func BenchmarkKernelWaitWindow(b *testing.B) {
	for _, d := range []time.Duration{BlockWindow, KernelWaitLimit} {
		b.Run(d.String(), func(b *testing.B) {
			defer SetKernelWait(KernelWait())
			if err := SetKernelWait(d); err != nil {
				b.Fatal(err)
			}
			_, s := pairIn(b, true)
			buf := make([]byte, 64)
			iov := unix.Iovec{Base: &buf[0]}
			iov.SetLen(len(buf))
			m := unix.Msghdr{Iov: &iov}
			m.SetIovlen(1)
			var total time.Duration
			for range b.N {
				var errno syscall.Errno
				start := time.Now()
				s.rc.Control(func(fd uintptr) {
					_, _, errno = syscall.RawSyscall(unix.SYS_RECVMSG, fd, uintptr(unsafe.Pointer(&m)), unix.MSG_CMSG_CLOEXEC)
				})
				total += time.Since(start)
				if errno != unix.EAGAIN && errno != unix.EINTR {
					b.Fatalf("recvmsg on an empty socket: errno %v", errno)
				}
			}
			b.ReportMetric(float64(total.Microseconds())/float64(b.N)/1e3, "window-ms")
		})
	}
}

// BenchmarkHotEncode sets the hand encoders of hot.go against protobuf-go
// on the same messages and a reused buffer (the bytes are the same; see
// FuzzHotCodec). Besides ns/op it reports cpu-ns/op, the thread's own CPU
// time per encode, which a busy machine's preemptions do not inflate:
//
//	go test -run XXX -bench 'Encode|Hot' ./pkg/wire
func BenchmarkHotEncode(b *testing.B) {
	msgs := []struct {
		name string
		m    proto.Message
	}{
		{"offload", &Offload{Rid: "request-0001", Label: "attention", GpuPages: hotPages(), StoredLen: 1000, Position: 1024}},
		{"reload", &Reload{Rid: "request-0001", Label: "attention", GpuPages: hotPages()}},
		{"offloadReply", &OffloadReply{Ok: true, HostPages: hotPages(), Total: 70000}},
		{"reloadReply", &ReloadReply{HostPages: hotPages(), StoredLen: 1000, Position: 1024, Ticket: 12345, Total: 70000}},
	}
	for _, c := range msgs {
		b.Run(c.name+"/hand", func(b *testing.B) {
			var buf []byte
			threadCPU(b, func() {
				var err error
				buf, err = AppendPacket(buf[:0], Header{}, c.m)
				if err != nil {
					b.Fatal(err)
				}
			})
		})
		b.Run(c.name+"/protobuf-go", func(b *testing.B) {
			var buf []byte
			threadCPU(b, func() {
				var err error
				buf = AppendHeader(buf[:0], Header{})
				buf, err = proto.MarshalOptions{}.MarshalAppend(buf, c.m)
				if err != nil {
					b.Fatal(err)
				}
			})
		})
	}
}

// threadCPU runs f b.N times on one locked OS thread and reports that
// thread's CPU time per run as cpu-ns/op.
func threadCPU(b *testing.B, f func()) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var before, after unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_THREAD, &before); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		f()
	}
	b.StopTimer()
	if err := unix.Getrusage(unix.RUSAGE_THREAD, &after); err != nil {
		b.Fatal(err)
	}
	cpu := func(r *unix.Rusage) int64 { return r.Utime.Nano() + r.Stime.Nano() }
	b.ReportMetric(float64(cpu(&after)-cpu(&before))/float64(b.N), "cpu-ns/op")
}

// What a Recv pays to know the direct Conns' limit, against asking the
// runtime (runtime.GOMAXPROCS(0), which answers under the scheduler's
// global lock) in the same run; "parallel" has every P asking at once, as
// the direct Conns of a busy process do:
//
//	go test -run XXX -bench BlockLimit ./pkg/wire
func BenchmarkBlockLimit(b *testing.B) {
	for _, bc := range []struct {
		name string
		f    func() int
	}{
		{"cached", blockLimit},
		{"runtime", func() int { return max(1, runtime.GOMAXPROCS(0)-1) }},
	} {
		b.Run(bc.name, func(b *testing.B) {
			n := 0
			for b.Loop() {
				n += bc.f()
			}
			_ = n
		})
		b.Run(bc.name+"/parallel", func(b *testing.B) {
			b.RunParallel(func(pb *testing.PB) {
				n := 0
				for pb.Next() {
					n += bc.f()
				}
				_ = n
			})
		})
	}
}

// BenchmarkConnRoundTrip times a 40-byte request and its echo between two
// Conns of this process, each mode on the socket and on a lane: direct
// (waiting in the kernel), polled with more Conns open than blockLimit
// (a lane's pipe registered with Go's poller for good), and polled alone
// (within blockLimit, but with no direct place: a lane registers a
// duplicate of its pipe for each wait).
func BenchmarkConnRoundTrip(b *testing.B) {
	for _, mode := range []string{"direct", "poller", "poller-alone"} {
		for _, lane := range []bool{false, true} {
			name := mode + "/socket"
			if lane {
				name = mode + "/lane"
			}
			b.Run(name, func(b *testing.B) {
				c, s := pairIn(b, mode == "direct")
				if mode == "poller-alone" {
					blockLimit = func() int { return 1 << 20 } // pairIn restores it
				}
				if lane {
					withLane(b, c, s)
				}
				go func() {
					buf := make([]byte, MaxMessage+1)
					for {
						pkt, _, err := s.Recv(buf)
						if err != nil || s.Send(pkt, nil) != nil {
							return
						}
					}
				}()
				req, buf := make([]byte, 40), make([]byte, MaxMessage+1)
				b.ResetTimer()
				for range b.N {
					if err := c.Send(req, nil); err != nil {
						b.Fatal(err)
					}
					if _, _, err := c.Recv(buf); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
