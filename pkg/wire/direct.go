package wire

import (
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// directFD is the socket of a Conn kept out of Go's network poller: a
// syscall.RawConn over a descriptor no epoll set holds while it is not
// being waited on.
//
// Why: a socket registered in an epoll set costs every packet it receives a
// wake-up callback in the kernel, whether or not anybody waits on it, and
// wakes a thread of the runtime sleeping in epoll_wait, if one is; Go
// registers every net.Conn for its whole life. A direct Conn mostly waits
// for its packets in a blocking recvmsg instead (Conn), so it registers a
// duplicate of its socket only for a wait that outlasts that
// (waitOnPoller): the poller is the one wait that gives the P back at
// once, which a blocking system call does not (the runtime's monitor takes
// it back after 20 µs to 10 ms, and on one P nothing else runs meanwhile).
type directFD struct {
	fd int
	// pipe: fd is a lane's pipe end (Conn.UseLane), non-blocking for its
	// whole life: it waits in ppoll, never in its read or write, and no
	// shutdown ends a wait on it, so close closes the duplicates being
	// waited on instead.
	pipe bool
	// stayPolled: the Conn never waits in the kernel (a lane of a Conn
	// that is not direct), so the duplicate registered for its first
	// wait on the poller is kept for its life, as a net.Conn's own
	// registration is; set before the directFD is used.
	stayPolled bool
	// refs counts the calls using fd; closing sets closingBit, and
	// whoever brings it to closingBit alone closes fd (once: closed).
	refs   atomic.Int64
	closed atomic.Bool
	// Deadlines in Unix ns; 0: none.
	rdl, wdl atomic.Int64
	// mu guards polling, the waits on the poller under way, and kept:
	// while there are any, or once kept is set, the socket is
	// non-blocking (nonBlock), as the poller needs it.
	mu       sync.Mutex
	polling  int
	kept     *os.File        // a registered duplicate kept between waits (waitOnPoller)
	waiting  []*os.File      // a pipe's fresh duplicates being waited on (pollFile)
	keptRC   syscall.RawConn // kept's
	hasKept  atomic.Bool
	nonBlock atomic.Bool
	// A wait on the poller, by direction (0 read, 1 write): its step f,
	// whether the last call of f was done, and the function the poller
	// calls, made once so that a wait allocates nothing; lock serializes
	// the waits of a direction.
	dir [2]struct {
		lock sync.Mutex
		f    func(fd uintptr) bool
		done bool
		call func(fd uintptr) bool
	}
}

// newDirectFD wraps a connected socket set up by setupDirect.
func newDirectFD(fd int) *directFD {
	d := &directFD{fd: fd}
	for i := range d.dir {
		w := &d.dir[i]
		// Close shuts the socket down, which wakes the wait.
		w.call = func(uintptr) bool {
			w.done = w.f(uintptr(d.fd))
			return w.done || d.refs.Load()&closingBit != 0
		}
	}
	return d
}

const closingBit = 1 << 62

var _ syscall.RawConn = (*directFD)(nil)

// acquire takes a reference on fd for one call; false once closing.
func (d *directFD) acquire() bool {
	if d.refs.Add(1)&closingBit != 0 {
		d.release()
		return false
	}
	return true
}

// release drops a reference, closing fd if it was the last one of a
// closing socket.
func (d *directFD) release() {
	if d.refs.Add(-1) == closingBit {
		d.closeFD()
	}
}

func (d *directFD) closeFD() {
	if d.closed.CompareAndSwap(false, true) {
		_ = unix.Close(d.fd) // nothing to do about a failed close of a socket
	}
}

// close shuts the socket down, which ends a wait in another goroutine (a
// recvmsg or a wait on the poller returns at once), and closes it when no
// call uses it any more. It is called once (Conn.Close).
func (d *directFD) close() {
	if !d.pipe && d.acquire() {
		_ = unix.Shutdown(d.fd, unix.SHUT_RDWR) // fails only on a socket never connected
		d.release()
	}
	d.mu.Lock()
	if d.kept != nil {
		d.kept.Close() // a wait on it still under way returns: the socket is shut down
	}
	for _, f := range d.waiting {
		f.Close() // ends the wait on it: a pipe has no shutdown
	}
	d.mu.Unlock()
	if d.refs.Add(closingBit) == closingBit {
		d.closeFD()
	}
}

func (d *directFD) Control(f func(fd uintptr)) error {
	if !d.acquire() {
		return net.ErrClosed
	}
	defer d.release()
	f(uintptr(d.fd))
	return nil
}

func (d *directFD) Read(f func(fd uintptr) bool) error {
	return d.wait(f, false, &d.rdl)
}

func (d *directFD) Write(f func(fd uintptr) bool) error {
	return d.wait(f, true, &d.wdl)
}

// wait calls f until it reports done, until the deadline dl (Unix ns, 0:
// none) passes or the socket is closed, waiting on the poller between
// calls. As with the poller, a deadline already past fails before f runs.
func (d *directFD) wait(f func(fd uintptr) bool, write bool, dl *atomic.Int64) error {
	if !d.acquire() {
		return net.ErrClosed
	}
	defer d.release()
	t := dl.Load()
	if t != 0 && time.Now().UnixNano() >= t {
		return os.ErrDeadlineExceeded
	}
	if d.hasKept.Load() && !d.stayPolled && int(open.Load()) <= blockLimit() {
		d.dropKept()
	}
	// With a kept duplicate, the poller calls f first itself.
	if !d.hasKept.Load() && f(uintptr(d.fd)) {
		return nil
	}
	return d.waitOnPoller(f, write, t)
}

// waitOnPoller calls f until it reports done, parking the goroutine on Go's
// poller between calls. A duplicate of the socket is registered for this
// wait alone (the socket non-blocking meanwhile) and closed after it, which
// takes it out of the epoll set: that costs a few system calls (about as
// many as a packet's own), which the kernel wait before it makes rare.
// Where it is not rare, in a process with more Conns open than blockLimit
// (which never wait in the kernel), the duplicate is kept registered
// instead, until a wait finds the process back within blockLimit.
func (d *directFD) waitOnPoller(f func(fd uintptr) bool, write bool, deadline int64) error {
	if d.refs.Load()&closingBit != 0 {
		return net.ErrClosed
	}
	pf, rc, err := d.pollFile()
	if err != nil {
		return err
	}
	defer d.donePolling(pf)
	if deadline != 0 {
		set := pf.SetReadDeadline
		if write {
			set = pf.SetWriteDeadline
		}
		if err := set(time.Unix(0, deadline)); err != nil {
			return err // not on the poller after all (os.ErrNoDeadline)
		}
		defer func() { _ = set(time.Time{}) }() // a kept file waits without one next
	}
	i, wait := 0, rc.Read
	if write {
		i, wait = 1, rc.Write
	}
	w := &d.dir[i]
	w.lock.Lock()
	defer w.lock.Unlock()
	w.f, w.done = f, false
	err = wait(w.call)
	w.f = nil
	if err == nil && !w.done {
		err = net.ErrClosed
	}
	return err
}

// pollFile returns a duplicate of the socket registered with the poller,
// the kept one or a fresh one (kept when the process has more Conns open
// than blockLimit), and counts a wait on it in.
func (d *directFD) pollFile() (*os.File, syscall.RawConn, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.kept != nil {
		d.polling++
		return d.kept, d.keptRC, nil
	}
	dup, err := unix.FcntlInt(uintptr(d.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, nil, os.NewSyscallError("fcntl", err)
	}
	if d.polling == 0 {
		if err := d.setNonblock(true); err != nil {
			unix.Close(dup)
			return nil, nil, os.NewSyscallError("fcntl", err)
		}
		d.nonBlock.Store(true)
	}
	// Non-blocking, so os registers it with the poller.
	pf := os.NewFile(uintptr(dup), "kvpool-socket")
	rc, err := pf.SyscallConn() // fails only on a nil *os.File
	if err != nil {
		pf.Close()
		if d.polling == 0 && d.setNonblock(false) == nil {
			d.nonBlock.Store(false)
		}
		return nil, nil, err
	}
	d.polling++
	if d.stayPolled || int(open.Load()) > blockLimit() {
		d.kept, d.keptRC = pf, rc
		d.hasKept.Store(true)
	} else if d.pipe {
		d.waiting = append(d.waiting, pf)
	}
	return pf, rc, nil
}

// setNonblock puts the socket in non-blocking mode, or back in blocking
// mode; a pipe stays non-blocking (directFD.pipe), and only nonBlock, which
// tells that a wait on the poller is under way, follows.
func (d *directFD) setNonblock(on bool) error {
	if d.pipe {
		return nil
	}
	return unix.SetNonblock(d.fd, on)
}

// dropKept closes the kept duplicate, the process having no more Conns
// open than blockLimit again (the Conns over it may have been short-lived:
// a health probe), unless a wait on it is under way; the socket goes back
// to blocking mode, and its next Recv to the kernel wait.
func (d *directFD) dropKept() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.kept == nil || d.polling > 0 {
		return
	}
	d.kept.Close()
	d.kept, d.keptRC = nil, nil
	d.hasKept.Store(false)
	if d.setNonblock(false) == nil {
		d.nonBlock.Store(false) // else it stays non-blocking, and waits on the poller
	}
}

// donePolling counts a wait on pf out: pf is closed unless kept, and the
// socket goes back to blocking mode (a direct Conn's kernel wait) after
// the last wait, unless a duplicate is kept.
func (d *directFD) donePolling(pf *os.File) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.polling--
	if pf != d.kept {
		pf.Close()
		if i := slices.Index(d.waiting, pf); i >= 0 {
			d.waiting = slices.Delete(d.waiting, i, i+1)
		}
	}
	if d.polling == 0 && d.kept == nil && d.setNonblock(false) == nil {
		d.nonBlock.Store(false) // else it stays non-blocking, and waits on the poller
	}
}

// setDeadline stores t as the deadline of reads, writes or both.
func (d *directFD) setDeadline(t time.Time, read, write bool) {
	var ns int64
	if !t.IsZero() {
		ns = max(t.UnixNano(), 1) // a time before 1970 has passed too
	}
	if read {
		d.rdl.Store(ns)
	}
	if write {
		d.wdl.Store(ns)
	}
}

// directSlots counts the direct Conns of the process (at most blockLimit).
var directSlots atomic.Int32

// takeDirectSlot reserves a direct Conn's place: there are at most
// blockLimit() of them, so that their threads, waiting in the kernel with a
// P for up to the kernel wait, always leave the process a P. (A direct Conn
// kept on the poller keeps its place: a process that had more Conns open
// than that has few to gain from the kernel wait.)
func takeDirectSlot() bool {
	if KernelWait() <= 0 {
		return false
	}
	readProcs()
	if int(directSlots.Add(1)) <= blockLimit() {
		return true
	}
	directSlots.Add(-1)
	return false
}

// setupDirect puts a socket the Conn will own in the mode a direct Conn
// waits in: blocking, with SO_RCVTIMEO = KernelWait().
func setupDirect(fd int) error {
	tv := unix.NsecToTimeval(KernelWait().Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return os.NewSyscallError("setsockopt", err)
	}
	if err := unix.SetNonblock(fd, false); err != nil {
		return os.NewSyscallError("fcntl", err)
	}
	return nil
}

// dialDirect connects a socket of its own to path, outside the poller. Its
// error is a *net.OpError, as net.DialUnix's.
func dialDirect(path string) (int, error) {
	fd, err := connectDirect(path)
	if err != nil {
		return -1, &net.OpError{Op: "dial", Net: Network, Addr: &net.UnixAddr{Name: path, Net: Network}, Err: err}
	}
	return fd, nil
}

func connectDirect(path string) (int, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, os.NewSyscallError("socket", err)
	}
	for {
		err = unix.Connect(fd, &unix.SockaddrUnix{Name: path})
		if err != unix.EINTR {
			break
		}
	}
	if err == nil {
		err = setupDirect(fd)
	} else {
		err = os.NewSyscallError("connect", err)
	}
	if err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// adoptDirect takes uc's socket out of the poller: a duplicate of its
// descriptor is kept and uc closed, which removes the original from the
// epoll set.
func adoptDirect(uc *net.UnixConn) (int, error) {
	rc, err := uc.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	var derr error
	if err := rc.Control(func(s uintptr) {
		fd, derr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0)
	}); err != nil {
		return -1, err
	}
	if derr != nil {
		return -1, os.NewSyscallError("fcntl", derr)
	}
	if err := setupDirect(fd); err != nil {
		unix.Close(fd)
		return -1, err
	}
	uc.Close() // its descriptor leaves the epoll set as it closes
	return fd, nil
}
