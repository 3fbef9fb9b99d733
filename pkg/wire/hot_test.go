package wire

import (
	"bytes"
	"testing"

	"google.golang.org/protobuf/proto"
)

// hotPair decodes body both by hand and with protobuf-go into a message of
// kind k, and checks that they agree: both fail, or both succeed with equal
// messages (protobuf-go keeps unknown fields, the hand decoder drops them).
// It then checks that the hand encoder writes protobuf-go's bytes.
func hotPair(t *testing.T, k uint8, body []byte) {
	var hand, ref proto.Message
	switch k % 10 {
	case 0:
		hand, ref = &Offload{Rid: "stale", GpuPages: []int32{9, 9, 9}}, new(Offload)
	case 1:
		hand, ref = &Reload{Label: "stale", GpuPages: []int32{9}}, new(Reload)
	case 2:
		hand, ref = &OffloadReply{Ok: true, HostPages: []int32{9}}, new(OffloadReply)
	case 3:
		hand, ref = &ReloadReply{Ticket: 9, HostPages: []int32{9}, Total: 9}, new(ReloadReply)
	case 4:
		hand, ref = &Pages{GpuPages: []int32{9, 9}}, new(Pages)
	case 5:
		hand, ref = &Stream{Rid: "stale", Label: "stale"}, new(Stream)
	case 6:
		hand, ref = &Request{Rid: "stale"}, new(Request)
	case 7:
		hand, ref = &IsOffloadedReply{Offloaded: true}, new(IsOffloadedReply)
	case 8:
		hand, ref = &RemoveRequestReply{Removed: 9}, new(RemoveRequestReply)
	default:
		hand, ref = &NumPagesReply{Pages: 9}, new(NumPagesReply)
	}
	herr := DecodeBody(body, hand)
	rerr := proto.Unmarshal(body, ref)
	if (herr == nil) != (rerr == nil) {
		t.Fatalf("%T %x: hand decoder says %v, protobuf-go says %v", hand, body, herr, rerr)
	}
	if herr != nil {
		return
	}
	ref.ProtoReflect().SetUnknown(nil)
	if !proto.Equal(hand, ref) {
		t.Fatalf("%T %x: hand %v, protobuf-go %v", hand, body, hand, ref)
	}
	want, err := proto.MarshalOptions{Deterministic: true}.Marshal(ref)
	if err != nil {
		t.Fatal(err)
	}
	got, err := AppendPacket(nil, Header{}, hand)
	if err != nil {
		return // over the packet limit
	}
	if !bytes.Equal(got[HeaderSize:], want) {
		t.Fatalf("%T: hand encoding %x, protobuf-go %x", hand, got[HeaderSize:], want)
	}
}

func FuzzHotCodec(f *testing.F) {
	for k, m := range []proto.Message{
		&Offload{Rid: "r", Label: "l", GpuPages: []int32{0, 1, -1, 1 << 30}, StoredLen: -5, Position: 1 << 40, Released: 3},
		&Reload{Rid: "r", GpuPages: []int32{7, 8}},
		&OffloadReply{Ok: true, HostPages: []int32{1, 2, 3}},
		&ReloadReply{HostPages: []int32{4}, StoredLen: 1, Position: 2, Released: 3, Ticket: 1 << 63, Total: 70000},
		&Pages{GpuPages: []int32{1 << 14, 1 << 21, -1}},
		&Stream{Rid: "r", Label: "l"},
		&Request{Rid: "req-1"},
		&IsOffloadedReply{Offloaded: true},
		&RemoveRequestReply{Removed: 70000},
		&NumPagesReply{Pages: 1<<32 - 1},
	} {
		b, _ := proto.Marshal(m)
		f.Add(uint8(k), b)
	}
	f.Add(uint8(0), []byte{0x18, 0x05, 0x18, 0x06})             // unpacked repeated
	f.Add(uint8(0), []byte{0x0d, 1, 2, 3, 4})                   // known field, wrong wire type
	f.Add(uint8(1), []byte{0x0a, 0x02, 0xc3, 0x28})             // bad UTF-8
	f.Add(uint8(3), []byte{0x0a, 0x03, 0x80, 0x80, 0x01, 0x28}) // packed, then a varint
	f.Add(uint8(2), []byte{0x08, 0x80, 0x01})                   // bool of a big varint
	f.Add(uint8(7), []byte{0x08, 0x80, 0x01, 0x08, 0x00})       // a bool twice: the last wins
	f.Add(uint8(8), []byte{0x08, 0x80, 0x80, 0x80, 0x80, 0x10}) // uint32 of a 33-bit varint
	f.Add(uint8(5), []byte{0x12, 0x01, 0x61, 0x0a, 0x00})       // label first, then an empty rid
	f.Add(uint8(6), []byte{0x12, 0x01, 0xff})                   // bad UTF-8 in an unknown field
	f.Fuzz(func(t *testing.T, k uint8, body []byte) { hotPair(t, k, body) })
}

func TestHotCodecMatchesProtobuf(t *testing.T) {
	for k, m := range []proto.Message{
		&Offload{}, &Offload{Rid: "é", Label: "x", GpuPages: []int32{-2147483648, 2147483647}, StoredLen: -1},
		&Reload{Rid: "r", Label: "l"}, &OffloadReply{}, &ReloadReply{Ticket: 1},
		&OffloadReply{Ok: true, HostPages: []int32{1}, Total: 1 << 20}, &ReloadReply{Total: 1<<31 - 2}, &Pages{}, &Pages{GpuPages: []int32{0}},
		&Stream{}, &Stream{Label: "only"}, &Request{}, &Request{Rid: "é"}, &IsOffloadedReply{}, &IsOffloadedReply{Offloaded: true},
		&RemoveRequestReply{}, &RemoveRequestReply{Removed: 1}, &NumPagesReply{}, &NumPagesReply{Pages: 1 << 31},
	} {
		b, _ := proto.Marshal(m)
		hotPair(t, uint8([]int{0, 0, 1, 2, 3, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9}[k]), b)
	}
}
