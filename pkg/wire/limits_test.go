package wire

import (
	"fmt"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// TestPacketLimits checks the packet budget at its edges: a packet of
// MaxPagesPerPacket page indices of the widest encoding, with the longest
// names and metadata, fits in MaxMessage, for every message that carries
// pages; page values sit on each varint width boundary (2^7, 2^14, 2^21,
// 2^28; the widest valid index, 2^31-2, takes 5 bytes; negative indices are
// refused before any reply is built).
func TestPacketLimits(t *testing.T) {
	name := strings.Repeat("n", 1024)
	widths := []struct {
		v     int32
		bytes int
	}{
		{0, 1}, {1<<7 - 1, 1}, {1 << 7, 2}, {1<<14 - 1, 2}, {1 << 14, 3}, {1<<21 - 1, 3}, {1 << 21, 4},
		{1<<28 - 1, 4}, {1 << 28, 5}, {1<<31 - 2, 5},
	}
	for _, w := range widths {
		if got := protowire.SizeVarint(uint64(int64(w.v))); got != w.bytes {
			t.Fatalf("varint of %d is %d bytes, want %d", w.v, got, w.bytes)
		}
	}
	for _, n := range []int{1, MaxPagesPerPacket - 1, MaxPagesPerPacket} {
		for _, w := range widths {
			pages := make([]int32, n)
			for i := range pages {
				pages[i] = w.v
			}
			const big = 1<<63 - 1
			msgs := []struct {
				op Op
				m  proto.Message
			}{
				{OpOffload, &Offload{Rid: name, Label: name, GpuPages: pages, StoredLen: big, Position: big, Released: big}},
				{OpReload, &Reload{Rid: name, Label: name, GpuPages: pages}},
				{OpPages, &Pages{GpuPages: pages}},
				{OpOffload, &OffloadReply{Ok: true, HostPages: pages, Total: 1<<32 - 1}},
				{OpReload, &ReloadReply{HostPages: pages, StoredLen: big, Position: big, Released: big, Ticket: 1<<64 - 1, Total: 1<<32 - 1}},
				{OpMore, &MoreReply{HostPages: pages}},
			}
			for _, x := range msgs {
				t.Run(fmt.Sprintf("%s/%T/n=%d/v=%d", x.op, x.m, n, w.v), func(t *testing.T) {
					pkt, err := AppendPacket(nil, Header{Op: x.op, Seq: 1<<32 - 1, Fence: 1<<64 - 1}, x.m)
					if err != nil {
						t.Fatalf("%d pages of %d bytes: %v", n, w.bytes, err)
					}
					if len(pkt) > MaxMessage {
						t.Fatalf("packet of %d bytes", len(pkt))
					}
				})
			}
		}
	}
	// The count leaves under 5% of the packet spare: 1,300 more of the
	// widest pages with the longest names no longer fit.
	pages := make([]int32, MaxPagesPerPacket+1300)
	for i := range pages {
		pages[i] = 1<<31 - 2
	}
	if _, err := AppendPacket(nil, Header{Op: OpOffload}, &Offload{Rid: name, Label: name, GpuPages: pages}); err == nil {
		t.Fatal("an offload far past MaxPagesPerPacket encoded; the budget is not tight")
	}
}

// TestLabelBudget: labels up to MaxLabelBytes of encoding fit in a packet
// with the total field set.
func TestLabelBudget(t *testing.T) {
	label := strings.Repeat("l", 1024)
	per := 1 + protowire.SizeVarint(1024) + 1024
	n := MaxLabelBytes / per
	labels := make([]string, n)
	for i := range labels {
		labels[i] = label
	}
	for _, m := range []proto.Message{&LabelsReply{Labels: labels, Total: 1<<32 - 1}, &MoreReply{Labels: labels}} {
		if _, err := AppendPacket(nil, Header{Op: OpLabels}, m); err != nil {
			t.Fatalf("%T of %d labels of 1 KiB: %v", m, n, err)
		}
	}
}
