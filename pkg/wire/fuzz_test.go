package wire

import (
	"bytes"
	"testing"

	"google.golang.org/protobuf/proto"
)

func seedPackets(f *testing.F, reply bool) {
	add := func(h Header, m proto.Message) {
		b, err := AppendPacket(nil, h, m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	if !reply {
		add(Header{Op: OpHello, Seq: 1}, &Hello{Version: Version, Client: "fuzz"})
		add(Header{Op: OpOpen, Seq: 2}, &Open{Token: "t", GpuUuid: "GPU-00000000-0000-0000-0000-000000000001", InstanceId: []byte("0123456789abcdef"),
			Regions: []*Region{{BytesPerPage: 1 << 18, PageCount: 1024}, {BytesPerPage: 100, PageCount: 7}}, MaxPages: 64})
		add(Header{Op: OpOffload, Seq: 3, Fence: 9}, &Offload{Rid: "req-1", Label: "kv", GpuPages: []int32{0, 5, 1 << 30, -1}, StoredLen: 1, Position: 2, Released: 3})
		add(Header{Op: OpReload, Seq: 4}, &Reload{Rid: "req-1", Label: "kv", GpuPages: []int32{7, 7}})
		add(Header{Op: OpDiscard, Seq: 5}, &Stream{Rid: "r", Label: "l"})
		add(Header{Op: OpLabels, Seq: 6}, &Request{Rid: "r"})
		add(Header{Op: OpUsage, Seq: 7}, nil)
		add(Header{Op: OpFence, Seq: 8, Fence: 3}, nil)
		add(Header{Op: OpPages, Seq: 9}, &Pages{GpuPages: []int32{1 << 14, 1<<21 - 1, 1 << 21, 0}})
		add(Header{Op: OpMore, Seq: 10}, &More{Offset: MaxPagesPerPacket})
	} else {
		add(Header{Op: OpHello, Seq: 1}, &HelloReply{Version: Version, Server: "s", MaxMessage: MaxMessage})
		add(Header{Op: OpOpen, Seq: 2}, &OpenReply{Session: 1, PageSize: 4096, PagesPerChunk: 16, Capacity: 32,
			Chunks: []*ChunkGrant{{Id: "gpu0-numa0-0", Size: 65536}, {Id: "gpu0-numa0-1", Size: 65536}}})
		add(Header{Op: OpOffload, Seq: 3}, &OffloadReply{Ok: true, HostPages: []int32{0, 1, 2}})
		add(Header{Op: OpReload, Seq: 4}, &ReloadReply{HostPages: []int32{3}, StoredLen: 1, Ticket: 7})
		add(Header{Op: OpLabels, Seq: 5}, &LabelsReply{Labels: []string{"a", "b"}})
		add(Header{Op: OpUsage, Seq: 6}, &UsageReply{Capacity: 10, Used: 3, Free: 7})
		add(Header{Op: OpOffload, Seq: 7, Status: StatusPending}, &Error{Message: "pending", Ticket: 7})
		add(Header{Op: OpOffload, Seq: 8}, &OffloadReply{Ok: true, HostPages: []int32{1 << 21}, Total: 30000})
		add(Header{Op: OpReload, Seq: 9}, &ReloadReply{HostPages: []int32{1 << 14}, Ticket: 2, Total: 30000})
		add(Header{Op: OpLabels, Seq: 10}, &LabelsReply{Labels: []string{"a"}, Total: 3})
		add(Header{Op: OpMore, Seq: 11}, &MoreReply{HostPages: []int32{5, 6}, Labels: []string{"x"}})
	}
	f.Add([]byte{})
	f.Add(make([]byte, HeaderSize))
	f.Add([]byte{3, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
}

// checkDecode decodes a packet the way the server (reply false) or the
// client (reply true) does, and checks that whatever decodes re-encodes to
// a packet that decodes to the same message.
func checkDecode(t *testing.T, pkt []byte, reply bool) {
	h, body, err := ParseHeader(pkt)
	if err != nil {
		return
	}
	if !bytes.Equal(AppendHeader(nil, h), pkt[:HeaderSize]) {
		t.Fatalf("header %+v re-encodes differently", h)
	}
	newMsg := func() (proto.Message, error) {
		if reply {
			return NewReply(h.Op, h.Status)
		}
		return NewRequest(h.Op)
	}
	m, err := newMsg()
	if err != nil {
		return
	}
	if err := DecodeBody(body, m); err != nil {
		return
	}
	again, err := AppendPacket(nil, h, m)
	if err != nil {
		return // a body of unknown fields may re-encode larger than the limit
	}
	_, body2, err := ParseHeader(again)
	if err != nil {
		t.Fatal(err)
	}
	m2, _ := newMsg()
	if err := DecodeBody(body2, m2); err != nil {
		t.Fatalf("re-encoded %s body does not decode: %v", h.Op, err)
	}
	if m != nil && !proto.Equal(m, m2) {
		t.Fatalf("%s: %v re-decodes as %v", h.Op, m, m2)
	}
}

func FuzzDecodeRequest(f *testing.F) {
	seedPackets(f, false)
	f.Fuzz(func(t *testing.T, pkt []byte) { checkDecode(t, pkt, false) })
}

func FuzzDecodeReply(f *testing.F) {
	seedPackets(f, true)
	f.Fuzz(func(t *testing.T, pkt []byte) { checkDecode(t, pkt, true) })
}
