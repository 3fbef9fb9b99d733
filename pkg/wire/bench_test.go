package wire

import (
	"testing"
	"time"

	"golang.org/x/sys/unix"
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
			_, s := pair(b)
			buf := make([]byte, 64)
			s.rmsg = unix.Msghdr{}
			s.riov.Base = &buf[0]
			s.riov.SetLen(len(buf))
			s.rmsg.Iov = &s.riov
			s.rmsg.SetIovlen(1)
			s.rmsg.Control = &s.oob[0]
			var total time.Duration
			for range b.N {
				s.rblock = true
				start := time.Now()
				s.rc.Control(func(fd uintptr) { s.recvStep(fd) })
				total += time.Since(start)
				if s.rerrno != unix.EAGAIN && s.rerrno != unix.EINTR {
					b.Fatalf("recvmsg on an empty socket: errno %v", s.rerrno)
				}
			}
			b.ReportMetric(float64(total.Microseconds())/float64(b.N)/1e3, "window-ms")
		})
	}
}
