package wire

import (
	"bytes"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

func TestHeaderRoundTrip(t *testing.T) {
	h := Header{Op: OpReload, Status: StatusPending, Seq: 0xdeadbeef, Fence: 1<<63 + 5}
	b := AppendHeader(nil, h)
	if len(b) != HeaderSize {
		t.Fatalf("header is %d bytes", len(b))
	}
	want := []byte{4, 7, 0, 0, 0xef, 0xbe, 0xad, 0xde, 5, 0, 0, 0, 0, 0, 0, 0x80}
	if !bytes.Equal(b, want) {
		t.Fatalf("encoding %x, want %x (docs/protocol.md)", b, want)
	}
	got, body, err := ParseHeader(append(b, 1, 2))
	if err != nil || got != h || !bytes.Equal(body, []byte{1, 2}) {
		t.Fatalf("parse: %+v %x %v", got, body, err)
	}
}

func TestParseHeaderRejects(t *testing.T) {
	good := AppendHeader(nil, Header{Op: OpHello})
	for _, tc := range []struct {
		name string
		pkt  []byte
	}{
		{"empty", nil},
		{"short", good[:HeaderSize-1]},
		{"reserved byte 2", append(append([]byte{}, good[:2]...), append([]byte{1, 0}, good[4:]...)...)},
		{"reserved byte 3", append(append([]byte{}, good[:3]...), append([]byte{1}, good[4:]...)...)},
		{"oversized", append(append([]byte{}, good...), make([]byte, MaxMessage)...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, _, err := ParseHeader(tc.pkt); !errors.Is(err, ErrMalformed) {
				t.Fatalf("got %v, want ErrMalformed", err)
			}
		})
	}
}

func TestBodiesRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		op  Op
		req proto.Message
	}{
		{OpHello, &Hello{Version: 1, Client: "t"}},
		{OpOpen, &Open{Token: "x", GpuUuid: "GPU-3", InstanceId: []byte("12345678"), Regions: []*Region{{BytesPerPage: 4096, PageCount: 9}}}},
		{OpOffload, &Offload{Rid: "r", Label: "l", GpuPages: []int32{1, 2, 3}, StoredLen: 4, Position: 5, Released: 6}},
		{OpReload, &Reload{Rid: "r", Label: "l", GpuPages: []int32{7}}},
		{OpDiscard, &Stream{Rid: "r", Label: "l"}},
		{OpLabels, &Request{Rid: "r"}},
	} {
		pkt, err := AppendPacket(nil, Header{Op: tc.op, Seq: 1}, tc.req)
		if err != nil {
			t.Fatal(err)
		}
		h, body, err := ParseHeader(pkt)
		if err != nil {
			t.Fatal(err)
		}
		m, err := NewRequest(h.Op)
		if err != nil {
			t.Fatal(err)
		}
		if err := DecodeBody(body, m); err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(m, tc.req) {
			t.Fatalf("%s: decoded %v, want %v", tc.op, m, tc.req)
		}
	}
}

// TestDecodeReuses checks that a reused hot-path message decodes no stale
// pages and, when its request ID and label repeat, does not allocate.
func TestDecodeReuses(t *testing.T) {
	var m Offload
	big, _ := proto.Marshal(&Offload{Rid: "a", GpuPages: []int32{1, 2, 3, 4, 5, 6, 7, 8}})
	small, _ := proto.Marshal(&Offload{Rid: "b", GpuPages: []int32{9}})
	if err := DecodeBody(big, &m); err != nil {
		t.Fatal(err)
	}
	if err := DecodeBody(small, &m); err != nil {
		t.Fatal(err)
	}
	if m.Rid != "b" || len(m.GpuPages) != 1 || m.GpuPages[0] != 9 {
		t.Fatalf("decoded %v", &m)
	}
	allocs := testing.AllocsPerRun(100, func() { DecodeBody(big, &m) })
	if allocs != 0 {
		t.Fatalf("decoding an offload into a reused message allocates %v times", allocs)
	}
}

func TestDecodeRejects(t *testing.T) {
	for _, tc := range []struct {
		name string
		op   Op
		body []byte
	}{
		{"truncated varint", OpOffload, []byte{0x18, 0x80}},
		{"length past end", OpOffload, []byte{0x0a, 0x10, 'a'}},
		{"bad utf-8 rid", OpOffload, []byte{0x0a, 0x01, 0xff}},
		{"field number zero", OpReload, []byte{0x00, 0x01}},
		{"body on usage", OpUsage, []byte{0x08, 0x01}},
		{"group tag", OpHello, []byte{0x0b}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := NewRequest(tc.op)
			if err != nil {
				t.Fatal(err)
			}
			if err := DecodeBody(tc.body, m); !errors.Is(err, ErrMalformed) {
				t.Fatalf("got %v, want ErrMalformed", err)
			}
		})
	}
	if _, err := NewRequest(Op(200)); !errors.Is(err, ErrMalformed) {
		t.Fatalf("unknown op: %v", err)
	}
}

func TestConnPassesFDsAndLimits(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s")
	l, err := net.ListenUnix(Network, &net.UnixAddr{Name: path, Net: Network})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := Dial(path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	uc, err := l.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	s := NewConn(uc)
	defer s.Close()

	f, err := os.CreateTemp(t.TempDir(), "fd")
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("chunk")
	if err := c.Send([]byte("hello-packet-16b"), []int{int(f.Fd())}); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, MaxMessage+1)
	pkt, files, err := s.Recv(buf)
	if err != nil || string(pkt) != "hello-packet-16b" || len(files) != 1 {
		t.Fatalf("recv %q %d files %v", pkt, len(files), err)
	}
	got := make([]byte, 5)
	if _, err := files[0].ReadAt(got, 0); err != nil || string(got) != "chunk" {
		t.Fatalf("passed fd reads %q %v", got, err)
	}
	files[0].Close()

	if err := c.Send(make([]byte, MaxMessage+1), nil); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("send oversized: %v", err)
	}
	recvOversized(t, c, s)
}

// recvOversized writes a packet of MaxMessage+1 bytes from c, past Send's
// check, and fails unless s's Recv says ErrTooLarge.
func recvOversized(t *testing.T, c, s *Conn) {
	t.Helper()
	var werr error
	if err := c.rc.Write(func(fd uintptr) bool {
		_, werr = unix.Write(int(fd), make([]byte, MaxMessage+1))
		return werr != unix.EAGAIN
	}); err != nil || werr != nil {
		t.Fatal(err, werr)
	}
	if _, _, err := s.Recv(make([]byte, MaxMessage+1)); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("recv oversized: %v", err)
	}
}

// Every status has a name and a distinct snake_case kind; codes outside the
// table get a generic one.
func TestStatusTable(t *testing.T) {
	sts := Statuses()
	if len(sts) != 24 || sts[0] != StatusOK || sts[len(sts)-1] != StatusUnavailable {
		t.Fatalf("Statuses() = %v", sts)
	}
	kinds := make(map[string]Status)
	for _, s := range sts {
		k := s.Kind()
		for _, c := range k {
			if !(c >= 'a' && c <= 'z' || c == '_') {
				t.Errorf("status %d: kind %q is not snake_case", s, k)
			}
		}
		if prev, dup := kinds[k]; dup {
			t.Errorf("statuses %d and %d share kind %q", prev, s, k)
		}
		kinds[k] = s
		if s.String() == "" || strings.HasPrefix(s.String(), "status(") {
			t.Errorf("status %d has no name", s)
		}
	}
	if StatusNoCapacity.String() != "no capacity" || StatusNoCapacity.Kind() != "no_capacity" ||
		StatusUnavailable.Kind() != "unavailable" {
		t.Error("names or kinds changed")
	}
	if Status(22).String() != "status(22)" || Status(22).Kind() != "status_22" {
		t.Errorf("unknown status: %q %q", Status(22).String(), Status(22).Kind())
	}
}
