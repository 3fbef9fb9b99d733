package wire

import "testing"

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
