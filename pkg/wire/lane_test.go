package wire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// isOpen reports whether fd is an open descriptor.
func isOpen(fd int) bool {
	_, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
	return err == nil
}

// echoOnce sends a packet from c to s and checks that it arrives.
func echoOnce(t *testing.T, c, s *Conn, msg string) {
	t.Helper()
	if err := c.Send([]byte(msg), nil); err != nil {
		t.Fatalf("send %q: %v", msg, err)
	}
	if pkt, _, err := s.Recv(make([]byte, MaxMessage+1)); err != nil || string(pkt) != msg {
		t.Fatalf("recv %q, %v; want %q", pkt, err, msg)
	}
}

// UseLane takes pipe ends only, each in its own direction, on an open Conn
// without a lane; whatever it refuses it closes, and the Conn goes on as
// it was.
func TestUseLaneRefuses(t *testing.T) {
	file := func(t *testing.T) int {
		f, err := os.Create(filepath.Join(t.TempDir(), "f"))
		if err != nil {
			t.Fatal(err)
		}
		fd, err := unix.Dup(int(f.Fd()))
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		return fd
	}
	sock := func(t *testing.T) int {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET, 0)
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(fds[1])
		return fds[0]
	}
	// theirsOnly returns the peer's ends of a fresh lane, ours closed.
	theirsOnly := func(t *testing.T) [2]int {
		ours, theirs, err := LanePipes()
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(ours[0])
		unix.Close(ours[1])
		return theirs
	}
	for _, tc := range []struct {
		name string
		ends func(t *testing.T, c *Conn) (r, w int) // UseLane's arguments
		want string
	}{
		{"a regular file", func(t *testing.T, c *Conn) (int, int) {
			theirs := theirsOnly(t)
			unix.Close(theirs[0])
			return file(t), theirs[1]
		}, "not a pipe"},
		{"a socket", func(t *testing.T, c *Conn) (int, int) {
			theirs := theirsOnly(t)
			unix.Close(theirs[1])
			return theirs[0], sock(t)
		}, "not a pipe"},
		{"ends swapped", func(t *testing.T, c *Conn) (int, int) {
			theirs := theirsOnly(t)
			return theirs[1], theirs[0]
		}, "other direction"},
		{"one descriptor twice", func(t *testing.T, c *Conn) (int, int) {
			theirs := theirsOnly(t)
			unix.Close(theirs[1])
			return theirs[0], theirs[0]
		}, "other direction"},
		{"a closed descriptor", func(t *testing.T, c *Conn) (int, int) {
			theirs := theirsOnly(t)
			unix.Close(theirs[0])
			return theirs[0], theirs[1]
		}, "bad file descriptor"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, s := pair(t)
			r, w := tc.ends(t, c)
			err := c.UseLane(r, w)
			if err == nil || !bytes.Contains([]byte(err.Error()), []byte(tc.want)) {
				t.Fatalf("UseLane: %v, want an error saying %q", err, tc.want)
			}
			if isOpen(r) || isOpen(w) {
				t.Fatalf("a refused UseLane left descriptor %d or %d open", r, w)
			}
			if c.HasLane() {
				t.Fatal("a refused UseLane gave the Conn a lane")
			}
			echoOnce(t, c, s, "still the socket")
			echoOnce(t, s, c, "both ways")
		})
	}

	t.Run("a second lane", func(t *testing.T) {
		c, s := pair(t)
		withLane(t, c, s)
		ours, theirs, err := LanePipes()
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(ours[0])
		defer unix.Close(ours[1])
		if err := c.UseLane(theirs[0], theirs[1]); err == nil || isOpen(theirs[0]) || isOpen(theirs[1]) {
			t.Fatalf("a second UseLane: %v, ends open %v %v", err, isOpen(theirs[0]), isOpen(theirs[1]))
		}
		echoOnce(t, c, s, "the first lane")
	})
	t.Run("a closed conn", func(t *testing.T) {
		c, _ := pair(t)
		c.Close()
		_, theirs, err := LanePipes()
		if err != nil {
			t.Fatal(err)
		}
		if err := c.UseLane(theirs[0], theirs[1]); !errors.Is(err, net.ErrClosed) || isOpen(theirs[0]) || isOpen(theirs[1]) {
			t.Fatalf("UseLane on a closed conn: %v, ends open %v %v", err, isOpen(theirs[0]), isOpen(theirs[1]))
		}
	})
}

// rawLane gives s a lane whose other ends the test holds: it writes frames
// of its own making to w and reads s's from r; end closes one of them
// (once: the cleanup closes what is left).
func rawLane(t *testing.T, direct bool) (s *Conn, r, w int, end func(fd int)) {
	t.Helper()
	_, s = pairIn(t, direct)
	ours, theirs, err := LanePipes()
	if err != nil {
		t.Fatal(err)
	}
	if err := s.UseLane(ours[0], ours[1]); err != nil {
		t.Fatal(err)
	}
	open := map[int]bool{theirs[0]: true, theirs[1]: true}
	end = func(fd int) {
		if open[fd] {
			unix.Close(fd)
			delete(open, fd)
		}
	}
	t.Cleanup(func() { end(theirs[0]); end(theirs[1]) })
	return s, theirs[0], theirs[1], end
}

func frame(pkt []byte) []byte {
	return append(binary.LittleEndian.AppendUint32(nil, uint32(len(pkt))), pkt...)
}

// writeAll writes b to the non-blocking fd, waiting for room.
func writeAll(fd int, b []byte) error {
	for len(b) > 0 {
		n, err := unix.Write(fd, b)
		if err == unix.EAGAIN {
			time.Sleep(100 * time.Microsecond)
			continue
		}
		if err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

// A lane reads frames however the writes cut them: several in one write,
// one over many writes with pauses between, and says what is wrong with a
// frame that breaks the rules.
func TestLaneFrames(t *testing.T) {
	for _, direct := range []bool{true, false} {
		t.Run(modeName(direct), func(t *testing.T) {
			s, r, w, _ := rawLane(t, direct)
			buf := make([]byte, MaxMessage+1)

			// Three frames in one write, the last a maximal packet in
			// pieces (a pipe holds less than one).
			big := bytes.Repeat([]byte("0123456789abcdef"), MaxMessage/16)
			all := append(append(frame([]byte("one")), frame([]byte("two"))...), frame(big)...)
			wrote := make(chan error, 1)
			go func() { wrote <- writeAll(w, all) }()
			for _, want := range [][]byte{[]byte("one"), []byte("two"), big} {
				pkt, files, err := s.Recv(buf)
				if err != nil || !bytes.Equal(pkt, want) || files != nil {
					t.Fatalf("recv %d bytes, %d files, %v; want %d bytes", len(pkt), len(files), err, len(want))
				}
			}
			if err := <-wrote; err != nil {
				t.Fatal(err)
			}
			// One frame a byte at a time.
			go func() {
				for _, b := range frame([]byte("slowly")) {
					if err := writeAll(w, []byte{b}); err != nil {
						wrote <- err
						return
					}
					time.Sleep(100 * time.Microsecond)
				}
				wrote <- nil
			}()
			if pkt, _, err := s.Recv(buf); err != nil || string(pkt) != "slowly" {
				t.Fatalf("recv %q, %v", pkt, err)
			}
			if err := <-wrote; err != nil {
				t.Fatal(err)
			}
			// What s sends is a frame.
			if err := s.Send([]byte("reply"), nil); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, 64)
			if n, err := unix.Read(r, got); err != nil || !bytes.Equal(got[:n], frame([]byte("reply"))) {
				t.Fatalf("read % x, %v; want the frame of \"reply\"", got[:n], err)
			}
			// Files and empty packets are refused, and nothing is sent.
			if err := s.Send([]byte("x"), []int{r}); err == nil {
				t.Fatal("a send of files on a lane succeeded")
			}
			if err := s.Send(nil, nil); !errors.Is(err, ErrLaneFrame) {
				t.Fatalf("a send of an empty packet: %v, want ErrLaneFrame", err)
			}
			if err := s.Send(make([]byte, MaxMessage+1), nil); !errors.Is(err, ErrTooLarge) {
				t.Fatalf("a send over MaxMessage: %v, want ErrTooLarge", err)
			}
			if n, err := unix.Read(r, got); err != unix.EAGAIN {
				t.Fatalf("refused sends wrote %d bytes (%v)", n, err)
			}
			// A packet longer than the buffer is ErrTooLarge.
			if err := writeAll(w, frame(make([]byte, 100))); err != nil {
				t.Fatal(err)
			}
			if _, _, err := s.Recv(make([]byte, 99)); !errors.Is(err, ErrTooLarge) {
				t.Fatalf("100 bytes into 99: %v, want ErrTooLarge", err)
			}
		})
	}
}

// A frame that breaks the rules is an error that names it, and the end of
// the pipe is io.EOF between frames, io.ErrUnexpectedEOF inside one.
func TestLaneBadFrames(t *testing.T) {
	for _, tc := range []struct {
		name  string
		bytes []byte
		want  error
	}{
		{"zero length", []byte{0, 0, 0, 0}, ErrLaneFrame},
		{"over MaxMessage", binary.LittleEndian.AppendUint32(nil, MaxMessage+1), ErrLaneFrame},
		{"all ones", []byte{0xff, 0xff, 0xff, 0xff, 1, 2}, ErrLaneFrame},
		{"a cut header", []byte{5, 0}, io.ErrUnexpectedEOF},
		{"a cut packet", append(binary.LittleEndian.AppendUint32(nil, 5), "abc"...), io.ErrUnexpectedEOF},
		{"nothing", nil, io.EOF},
	} {
		for _, direct := range []bool{true, false} {
			t.Run(tc.name+"/"+modeName(direct), func(t *testing.T) {
				s, _, w, end := rawLane(t, direct)
				if err := writeAll(w, tc.bytes); err != nil {
					t.Fatal(err)
				}
				end(w)
				if _, _, err := s.Recv(make([]byte, MaxMessage+1)); !errors.Is(err, tc.want) {
					t.Fatalf("recv: %v, want %v", err, tc.want)
				}
			})
		}
	}
}

// A send to a lane whose reader is gone fails (EPIPE), and the process
// lives on: Go ignores the SIGPIPE of a write made by Go code.
func TestLaneSendToAGonePeer(t *testing.T) {
	s, r, _, end := rawLane(t, true)
	end(r)
	if err := s.Send([]byte("anyone?"), nil); !errors.Is(err, unix.EPIPE) {
		t.Fatalf("send to a closed pipe: %v, want EPIPE", err)
	}
}

// FuzzLaneFrames writes any bytes into a lane and reads packets from it
// until it ends: the packets read, framed again, are the input's start,
// all of it when the lane ended cleanly (io.EOF), and nothing panics.
func FuzzLaneFrames(f *testing.F) {
	f.Add(frame([]byte("one")))
	f.Add(append(frame([]byte("a")), frame(bytes.Repeat([]byte{7}, 5000))...))
	f.Add([]byte{0, 0, 0, 0})
	f.Add([]byte{1, 0, 0})
	f.Add(binary.LittleEndian.AppendUint32(nil, MaxMessage+1))
	f.Fuzz(func(t *testing.T, in []byte) {
		done := make(chan struct{})
		s, _, w, end := rawLane(t, false)
		wrote := make(chan struct{})
		go func() {
			defer close(wrote)
			// Until the reader stops: after a bad frame it reads no more
			// (a full pipe), and its end closes with the test (EPIPE).
			for b := in; len(b) > 0; {
				n, err := unix.Write(w, b)
				if err == unix.EAGAIN {
					select {
					case <-done:
						return
					case <-time.After(100 * time.Microsecond):
					}
					continue
				}
				if err != nil {
					return
				}
				b = b[n:]
			}
			end(w)
		}()
		defer func() { close(done); <-wrote }()
		buf := make([]byte, MaxMessage+1)
		var got []byte
		for {
			pkt, _, err := s.Recv(buf)
			if err != nil {
				if !bytes.HasPrefix(in, got) {
					t.Fatalf("packets read, framed again, are not the input's start")
				}
				if errors.Is(err, io.EOF) != (len(got) == len(in)) {
					t.Fatalf("%v after %d of %d bytes", err, len(got), len(in))
				}
				return
			}
			got = append(got, frame(pkt)...)
		}
	})
}

func TestSignalsPreempt(t *testing.T) {
	for _, tc := range []struct {
		godebug string
		want    bool
	}{
		{"", true},
		{"gctrace=1", true},
		{"asyncpreemptoff=1", false},
		{"asyncpreemptoff=0", true},
		{"asyncpreemptoff=1,asyncpreemptoff=0", true},
		{"asyncpreemptoff=0,gctrace=1,asyncpreemptoff=1", false},
		{"gccheckmark=1", false},
		{"gccheckmark=0,asyncpreemptoff=0", true},
		{"asyncpreemptoff", false},
	} {
		if got := signalsPreempt(tc.godebug); got != tc.want {
			t.Errorf("signalsPreempt(%q) = %v, want %v", tc.godebug, got, tc.want)
		}
	}
}

// A Recv waiting in the kernel on a lane (ppoll, holding its P) lets a
// stop of the world through: the runtime's preemption signal ends the
// wait, or where the runtime preempts without signals, the wait's timeout
// does. (A wait that held the P would hold runtime.GC until the packet,
// and the whole test binary with it, to go test's timeout: checked with
// GODEBUG=asyncpreemptoff=1 and the signals case forced.)
func TestLaneWaitLetsTheWorldStop(t *testing.T) {
	for _, signals := range []bool{true, false} {
		t.Run(fmt.Sprintf("signals=%v", signals), func(t *testing.T) {
			old := preemptSignals
			preemptSignals = signals
			t.Cleanup(func() { preemptSignals = old })
			c, s := pairIn(t, true)
			withLane(t, c, s)
			got := make(chan error, 1)
			go func() {
				_, _, err := s.Recv(make([]byte, MaxMessage+1))
				got <- err
			}()
			time.Sleep(5 * time.Millisecond) // into its wait
			gc := make(chan struct{})
			go func() {
				runtime.GC()
				close(gc)
			}()
			select {
			case <-gc:
			case <-time.After(20 * time.Second):
				c.Send([]byte("late"), nil) // let the test end
				t.Fatal("a stop of the world waited for the lane's packet")
			}
			select {
			case err := <-got:
				t.Fatalf("the Recv returned before any packet: %v", err)
			default:
			}
			if err := c.Send([]byte("now"), nil); err != nil {
				t.Fatal(err)
			}
			if err := <-got; err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A lane of a Conn that is not direct waits on the poller alone: the
// duplicate of its pipe registered for its first wait stays registered,
// and a Close still ends a wait on it.
func TestLaneOfAPolledConnStaysRegistered(t *testing.T) {
	c, s := pairIn(t, false)
	blockLimit = func() int { return 1 << 20 } // within the limit, but polled: no direct place
	withLane(t, c, s)
	buf := make([]byte, MaxMessage+1)
	for i := range 3 {
		go func() {
			time.Sleep(2 * time.Millisecond)
			c.Send([]byte("late"), nil)
		}()
		if pkt, _, err := s.Recv(buf); err != nil || string(pkt) != "late" {
			t.Fatalf("recv %d: %q %v", i, pkt, err)
		}
		if !s.ln.r.hasKept.Load() {
			t.Fatalf("recv %d: the lane's registration was dropped after a wait", i)
		}
	}
	closeEndsRecv(t, s, buf, "on its lane's registration")
}
