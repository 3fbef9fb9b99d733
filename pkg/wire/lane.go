package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A lane carries a Conn's packets on a pair of pipes instead of its socket
// (UseLane): a pipe's write and read cost the kernel less than a Unix
// socket's packet. On one CPU, in C (hack/floors.c), a round trip over
// pipes takes about 0.7 of one over the socket with blocking reads, and
// 0.82-0.86 waited for in ppoll as a lane waits; the Go client's call
// 0.90-0.93 of its time over the socket (docs/benchmarks.md). The socket
// stays the connection: who the peer is (SO_PEERCRED), the files an open
// passes, and its end, which ends a wait on the lane too.
//
// On a lane each packet is a frame: its length (4 bytes, little endian,
// 1 to MaxMessage) and the packet. A pipe keeps no boundaries, so the
// reader takes a frame's length first; one writer a direction (Conn's
// wmu) keeps frames whole. Files cannot travel a lane: a Conn passes them
// before it takes one.
//
// A lane's descriptors are non-blocking for their whole life. A Recv that
// may wait in the kernel (Conn) waits in ppoll on the pipe and the socket,
// which a signal ends (a pipe's blocking read, which the runtime's signals
// restart, would hold a stop of the world until the next packet), without
// a timeout (preemptSignals says why); otherwise, as a socket's, on Go's
// poller.

// laneHeader is the length of a lane frame's header.
const laneHeader = 4

// A lane's wait in ppoll has no timeout: a timer costs it more than a
// socket's wait costs in all. A timeout sooner than the scheduler's next
// tick makes the kernel program the CPU's timer at every wait, and again
// at the early wake-up, which on a VM traps to the hypervisor each time
// (with 200 µs, a one-CPU round trip took 22 µs instead of 10 on the
// fourth kind of machine); a later one still costs a timer set and
// cancelled, about 1 µs of a C round trip of 7 (docs/benchmarks.md). A
// socket's SO_RCVTIMEO counts in ticks and costs neither.
//
// What ends the wait instead is a signal: the runtime's preemption
// request, which a stop of the world sends every running thread, and
// which its monitor sends a goroutine running for 10 ms; after it the
// Recv gives its P up (Gosched), as after a socket's window. Where
// preemption by signal is off (GODEBUG asyncpreemptoff=1, or
// gccheckmark=1, which turns it off), nothing would, and the wait has a
// timeout of laneWindow.
var preemptSignals = signalsPreempt(os.Getenv("GODEBUG"))

// signalsPreempt reports whether the runtime preempts by signal under
// GODEBUG godebug (its last setting of a name wins, as the runtime reads
// it).
func signalsPreempt(godebug string) bool {
	on := true
	for _, kv := range strings.Split(godebug, ",") {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "asyncpreemptoff":
			on = v == "0"
		case "gccheckmark":
			if v != "0" {
				on = false
			}
		}
	}
	return on
}

// laneWindow is the timeout of a lane's wait in ppoll where the runtime
// does not preempt by signal (preemptSignals): later than the scheduler's
// next tick at any HZ from 100, so that the timer costs no reprogramming,
// and about what the kernel makes of a socket's SO_RCVTIMEO of 200 µs.
const laneWindow = 10 * time.Millisecond

// laneBuffer is how much a lane reads ahead of the frame it wants: a
// small packet and its header in one read.
const laneBuffer = 4096

// ErrLaneFrame reports a lane frame whose length is 0 or over MaxMessage:
// the peer does not speak the lane, and the connection should be closed.
var ErrLaneFrame = errors.New("malformed lane frame")

// lane is a Conn's pair of pipes (UseLane).
type lane struct {
	r, w *directFD

	// The read side, under Conn.rmu: buf[head:tail] is read ahead; the
	// frame being read is want bytes long (-1: its header is not read
	// yet), got of them in dst (Recv's buffer); err is a framing error.
	buf        [laneBuffer]byte
	head, tail int
	want, got  int
	dst        []byte
	err        error
	pfd        [2]unix.PollFd
	ts         unix.Timespec // ppoll's timeout (laneWindow), which it overwrites with the time left

	// The write side, under Conn.wmu: the frame's header and packet, and
	// the bytes of both written so far.
	hdr   [laneHeader]byte
	pkt   []byte
	wiov  [2]unix.Iovec
	wsent int
}

// LanePipes makes the two pipes of a lane: ours, the ends this side gives
// its own UseLane (read, write), and theirs, the ends to pass to the peer
// for its UseLane (read, write). Every descriptor is close-on-exec; the
// caller closes theirs once they are passed.
func LanePipes() (ours, theirs [2]int, err error) {
	var up, down [2]int // up: theirs to ours; down: ours to theirs
	if err := unix.Pipe2(up[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return ours, theirs, fmt.Errorf("wire: lane: %w", os.NewSyscallError("pipe2", err))
	}
	if err := unix.Pipe2(down[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		unix.Close(up[0])
		unix.Close(up[1])
		return ours, theirs, fmt.Errorf("wire: lane: %w", os.NewSyscallError("pipe2", err))
	}
	return [2]int{up[0], down[1]}, [2]int{down[0], up[1]}, nil
}

// checkLaneEnd checks that fd is a pipe's end open for mode (O_RDONLY or
// O_WRONLY) and makes it non-blocking and close-on-exec.
func checkLaneEnd(fd, mode int, what string) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("%s: %w", what, os.NewSyscallError("fstat", err))
	}
	if st.Mode&unix.S_IFMT != unix.S_IFIFO {
		return fmt.Errorf("%s: descriptor %d is not a pipe (mode %#o)", what, fd, st.Mode&unix.S_IFMT)
	}
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil {
		return fmt.Errorf("%s: %w", what, os.NewSyscallError("fcntl", err))
	}
	if fl&unix.O_ACCMODE != mode {
		return fmt.Errorf("%s: descriptor %d is a pipe open for the other direction", what, fd)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		return fmt.Errorf("%s: %w", what, os.NewSyscallError("fcntl", err))
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETFD, unix.FD_CLOEXEC); err != nil {
		return fmt.Errorf("%s: %w", what, os.NewSyscallError("fcntl", err))
	}
	return nil
}

// UseLane moves the Conn's packets to a lane: from here on Recv reads them
// from r and Send writes them to w, the read end of one pipe and the write
// end of another, whose other ends the peer holds (LanePipes). The Conn
// owns r and w from the call on, and closes them on an error too. It
// fails, changing nothing else, on descriptors that are not such pipe
// ends, a closed Conn, or one with a lane already. It waits for a Send or
// Recv under way; both sides switch between a packet and the next, the
// side that passed the pipes after its last packet on the socket.
func (c *Conn) UseLane(r, w int) error {
	err := checkLaneEnd(r, unix.O_RDONLY, "read end")
	if err == nil {
		err = checkLaneEnd(w, unix.O_WRONLY, "write end")
	}
	if err == nil && r == w {
		err = errors.New("one descriptor for both ends")
	}
	if err == nil {
		c.rmu.Lock()
		defer c.rmu.Unlock()
		c.wmu.Lock()
		defer c.wmu.Unlock()
		c.mmu.Lock()
		defer c.mmu.Unlock()
		switch {
		case c.closed.Load() || c.rc == nil:
			err = net.ErrClosed
		case c.ln != nil:
			err = errors.New("the connection has a lane already")
		}
	}
	if err != nil {
		unix.Close(r)
		if w != r {
			unix.Close(w)
		}
		return fmt.Errorf("wire: use lane: %w", err)
	}
	l := &lane{r: newDirectFD(r), w: newDirectFD(w), want: -1}
	l.r.pipe, l.w.pipe = true, true
	// A Conn that is not direct waits on the poller alone: its read end
	// stays registered (BenchmarkConnRoundTrip, poller-alone: a
	// registration a wait cost a round trip 14 µs against 9).
	l.r.stayPolled = c.d == nil
	l.r.nonBlock.Store(false)
	l.pfd[0] = unix.PollFd{Fd: int32(r), Events: unix.POLLIN}
	if c.d != nil {
		// Deadlines carry over; a polled Conn's are its socket's own, which
		// the lane cannot read: set them again after UseLane.
		l.r.rdl.Store(c.d.rdl.Load())
		l.w.wdl.Store(c.d.wdl.Load())
	}
	c.ln = l
	return nil
}

// HasLane reports whether the Conn's packets travel a lane (UseLane).
func (c *Conn) HasLane() bool {
	c.mmu.Lock()
	defer c.mmu.Unlock()
	return c.ln != nil
}

// laneSend is Send on a lane. A frame longer than PIPE_BUF may go in
// parts; one whose send fails after a part went (a deadline, the peer
// gone) leaves the lane out of step, and the Conn must be closed, as after
// any failed Send (the client and the agent both close it).
func (c *Conn) laneSend(pkt []byte, fds []int) error {
	if len(fds) > 0 {
		return fmt.Errorf("wire: send %d fds: files travel the socket only, and this connection's packets travel a lane", len(fds))
	}
	if len(pkt) == 0 {
		return fmt.Errorf("wire: send: %w: an empty packet", ErrLaneFrame)
	}
	l := c.ln
	binary.LittleEndian.PutUint32(l.hdr[:], uint32(len(pkt)))
	l.pkt, l.wsent = pkt, 0
	c.werrno = 0
	err := l.w.Write(c.laneWriteF)
	l.pkt = nil
	l.wiov[1].Base = nil
	if err == nil && c.werrno != 0 {
		err = os.NewSyscallError("writev", c.werrno)
	}
	if err != nil {
		return fmt.Errorf("wire: send: %w", err)
	}
	return nil
}

// laneWriteStep is the write step of laneSend: it writes what the pipe
// takes of the frame's rest, and is done when all of it is written or on an
// error. (A frame of up to PIPE_BUF bytes goes in one write or none.)
func (c *Conn) laneWriteStep(fd uintptr) bool {
	l := c.ln
	total := laneHeader + len(l.pkt)
	for l.wsent < total {
		iov, n := &l.wiov[0], 2
		if l.wsent < laneHeader {
			l.wiov[0].Base = &l.hdr[l.wsent]
			l.wiov[0].SetLen(laneHeader - l.wsent)
			l.wiov[1].Base = &l.pkt[0]
			l.wiov[1].SetLen(len(l.pkt))
		} else {
			l.wiov[1].Base = &l.pkt[l.wsent-laneHeader]
			l.wiov[1].SetLen(total - l.wsent)
			iov, n = &l.wiov[1], 1
		}
		w, _, e := syscall.RawSyscall(unix.SYS_WRITEV, fd, uintptr(unsafe.Pointer(iov)), uintptr(n))
		switch e {
		case 0:
			l.wsent += int(w)
		case unix.EINTR:
		case unix.EAGAIN:
			return false
		default:
			c.werrno = e // EPIPE: the peer is gone (Go ignores the SIGPIPE of a write in Go code)
			return true
		}
	}
	return true
}

// laneRecv is Recv on a lane.
func (c *Conn) laneRecv(buf []byte) ([]byte, []*os.File, error) {
	l := c.ln
	l.dst, l.err = buf, nil
	c.rn, c.rerrno, c.rblock, c.rspin = 0, 0, c.mayBlock(), c.spin > 0
	err := l.r.Read(c.laneReadF)
	n := c.rn
	l.dst = nil
	if err == nil {
		err = l.err
	}
	if err == nil && c.rerrno != 0 {
		err = os.NewSyscallError("read", c.rerrno)
	}
	if err == nil && n == 0 {
		err = io.EOF
		if c.closed.Load() {
			err = fmt.Errorf("wire: recv: %w", net.ErrClosed)
		}
		return nil, nil, err
	}
	if err != nil {
		if c.closed.Load() && !errors.Is(err, net.ErrClosed) {
			err = fmt.Errorf("%w: %w", net.ErrClosed, err)
		}
		return nil, nil, fmt.Errorf("wire: recv: %w", err)
	}
	return buf[:n], nil, nil
}

// laneStep is the read step of Recv on a lane, as recvStep is on the
// socket: a spin (SetSpin), a read, then, where the Conn may block, the
// wait in the kernel.
func (c *Conn) laneStep(fd uintptr) bool {
	if c.rspin {
		c.rspin = false
		if c.skip > 0 {
			c.skip--
		} else if c.spinFor(fd, 0) {
			return true
		}
	}
	if c.rblock {
		// ppoll first: it returns at once where the packet is there
		// already, so that a wait costs two system calls.
		if c.laneWaitInKernel(fd) {
			return true
		}
		c.rblock = false
		return false
	}
	return c.laneRead(fd)
}

// laneRead reads what the pipe holds towards the frame Recv wants, without
// blocking, and reports whether Recv is done: the frame is in l.dst (c.rn
// its length), the pipe ended (c.rn 0), or an error (l.err, c.rerrno).
func (c *Conn) laneRead(fd uintptr) bool {
	l := c.ln
	for {
		if l.want < 0 && l.tail-l.head >= laneHeader {
			n := int(binary.LittleEndian.Uint32(l.buf[l.head:]))
			l.head += laneHeader
			switch {
			case n == 0 || n > MaxMessage:
				l.err = fmt.Errorf("%w: length %d, want 1 to %d", ErrLaneFrame, n, MaxMessage)
				return true
			case n > len(l.dst):
				l.err = fmt.Errorf("%w: a %d-byte packet, %d bytes of room (limit %d)", ErrTooLarge, n, len(l.dst), MaxMessage)
				return true
			}
			l.want, l.got = n, 0
		}
		if l.want >= 0 {
			k := copy(l.dst[l.got:l.want], l.buf[l.head:l.tail])
			l.head += k
			l.got += k
			if l.got == l.want {
				c.rn, l.want = uintptr(l.want), -1
				if l.head == l.tail {
					l.head, l.tail = 0, 0
				}
				return true
			}
		}
		// Read on: the header's rest into buf (and what follows, up to
		// buf's end), or the packet's rest straight into dst.
		var p []byte
		if l.want < 0 {
			if l.head > 0 {
				l.tail = copy(l.buf[:], l.buf[l.head:l.tail])
				l.head = 0
			}
			p = l.buf[l.tail:]
		} else {
			p = l.dst[l.got:l.want]
		}
		n, _, e := syscall.RawSyscall(unix.SYS_READ, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
		switch {
		case e == unix.EINTR:
		case e == unix.EAGAIN:
			return false
		case e != 0:
			c.rerrno = e
			return true
		case n == 0:
			if l.want >= 0 || l.tail > l.head {
				l.err = fmt.Errorf("%w: the lane ended inside a frame", io.ErrUnexpectedEOF)
			}
			c.rn = 0
			return true
		case l.want < 0:
			l.tail += int(n)
		default:
			l.got += int(n)
		}
	}
}

// laneWaitInKernel is waitInKernel on a lane: ppoll on the pipe and the
// socket (whose shutdown, by Close, ends it) until a packet comes, the
// socket ends or a signal ends the wait (preemptSignals; laneWindow
// where the runtime sends none), the P given up (Gosched) after each wait
// that ended without a packet, for up to kernelStay in all, while the Conn
// may block. It reports whether the last read is Recv's result.
func (c *Conn) laneWaitInKernel(fd uintptr) bool {
	l := c.ln
	var start time.Time
	for c.d.acquire() {
		l.pfd[1] = unix.PollFd{Fd: int32(c.d.fd)} // POLLHUP alone: the socket's end
		l.pfd[0].Revents = 0
		tsp := uintptr(0) // no timeout
		if !preemptSignals {
			l.ts = unix.NsecToTimespec(int64(laneWindow))
			tsp = uintptr(unsafe.Pointer(&l.ts))
		}
		_, _, _ = syscall.RawSyscall6(unix.SYS_PPOLL, uintptr(unsafe.Pointer(&l.pfd[0])), 2, tsp, 0, 0, 0)
		hup := l.pfd[1].Revents != 0
		c.d.release()
		if c.laneRead(fd) {
			return true
		}
		if hup {
			break // the socket ended: the pipe's wait is the poller's
		}
		readProcs() // a wait ended without a packet: a slow path
		if start.IsZero() {
			start = time.Now()
		}
		if time.Since(start) >= kernelStay || !c.mayBlock() {
			break
		}
		runtime.Gosched()
	}
	parked.Add(1)
	return false
}
