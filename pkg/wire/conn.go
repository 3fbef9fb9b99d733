package wire

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/pkg/unixsock"
)

// Network is the socket type the protocol runs on: one packet per message,
// message boundaries kept, connection oriented.
const Network = unixsock.Network

// ErrTooLarge reports a packet longer than MaxMessage. The receiver closes
// the connection: the rest of the packet is lost, so the peer's state is
// unknown.
var ErrTooLarge = errors.New("packet exceeds the maximum message size")

// BlockWindow is the default kernel wait (SetKernelWait): how long Recv
// asks the kernel to wait for a packet, in a plain blocking recvmsg on the
// calling thread, before it parks the goroutine on Go's network poller.
// See Conn.
const BlockWindow = 200 * time.Microsecond

// KernelWaitLimit is the longest kernel wait SetKernelWait accepts.
const KernelWaitLimit = 2 * time.Millisecond

// kernelWait is the SO_RCVTIMEO of Conns made from now on, in ns; 0: none.
var kernelWait atomic.Int64

func init() { kernelWait.Store(int64(BlockWindow)) }

// SetKernelWait sets the kernel wait of the Conns made after it, for the
// whole process: d in (0, KernelWaitLimit] is the SO_RCVTIMEO of their
// blocking recvmsg, 0 turns the kernel wait off (Recv waits on the poller
// alone). The kernel counts SO_RCVTIMEO in scheduler ticks and rounds it up:
// with HZ=250 any d up to 4 ms waits 5 to 12 ms (measured,
// BenchmarkKernelWaitWindow), so d is a request, not a bound; what bounds
// the wait for the rest of the process is a signal (Go's preemption
// request), which ends it at once. The wait only matters when the reply is
// late: a reply that comes in time wakes the waiting thread directly. A
// Conn whose packets travel a lane (UseLane) waits in the kernel without a
// timeout where d is not 0 (preemptSignals).
func SetKernelWait(d time.Duration) error {
	if d < 0 || d > KernelWaitLimit {
		return fmt.Errorf("wire: kernel wait %v outside [0, %v]", d, KernelWaitLimit)
	}
	kernelWait.Store(int64(d))
	return nil
}

// KernelWait returns the kernel wait new Conns get (SetKernelWait).
func KernelWait() time.Duration { return time.Duration(kernelWait.Load()) }

// SpinLimit is the longest spin SetSpin accepts.
const SpinLimit = time.Millisecond

// SpinRule says when a Conn that may spin (SetSpin) does, process-wide.
type SpinRule int32

const (
	// SpinBudgeted, the default, spins only where the spin costs nobody
	// anything (keepSpinning):
	//
	//   - while the process has no more spinning Conns open than spare
	//     CPUs (spinBudget: GOMAXPROCS, or the CPUs it may run on if
	//     fewer, less one, at least one), so that a spinner never holds a
	//     P that another caller of the process, woken or busy with its
	//     copies, needs;
	//   - when it starts, only while every runnable task of the machine
	//     has a CPU (idleCPU: /proc/loadavg, read at most every 10 ms,
	//     100 ms while busy), which is what other processes' spinners
	//     and callers show; a Conn either of these refused does not ask
	//     again for its next 16 Recvs (gateHold);
	//   - while this thread's CPU is its own, so that it never takes CPU
	//     time the agent or another process wants: a yield that ran
	//     another thread, followed by a poll that found nothing, ends the
	//     spin (after such a yield a peer on the same CPU has usually
	//     replied, so that one poll is still made);
	//   - and a Conn whose spin saw a yield run another thread, whether
	//     the reply came then or not, or whose first poll found the reply
	//     waiting (it came while the thread was still in its send: the
	//     peer runs on this CPU), does not spin for its next 1, 2, 4 ...
	//     64 Recvs (spinBackoff): a contended CPU stays contended for a
	//     while, and on a CPU shared with the peer the kernel wait hands
	//     it the CPU as well as a yield does;
	//   - never where the peer is this very process (an agent embedded
	//     beside its client, pkg/standalone: SO_PEERCRED at SetSpin), whose
	//     reply needs a P of this process, and the spin holds one (on one
	//     CPU a call took 45-60 µs spinning, 10 without).
	//
	// docs/benchmarks.md has the sweep that chose it; ReadSpinStats
	// tells how often it ran in a process.
	SpinBudgeted SpinRule = iota
	// SpinAlways spins every Recv for its whole window, whatever else
	// wants the CPU: the rule before issue 25, for a process whose few
	// callers each own a CPU that nothing else uses. (A Conn that was
	// skipping spins under SpinBudgeted when the rule changed skips the
	// rest of them, at most 64 Recvs.)
	SpinAlways
)

func (r SpinRule) String() string {
	switch r {
	case SpinBudgeted:
		return "budgeted"
	case SpinAlways:
		return "always"
	}
	return fmt.Sprintf("SpinRule(%d)", int32(r))
}

// spinRule is the process's SpinRule.
var spinRule atomic.Int32

// SetSpinRule sets the spin rule of every Conn of the process from the
// next Recv on.
func SetSpinRule(r SpinRule) error {
	if r != SpinBudgeted && r != SpinAlways {
		return fmt.Errorf("wire: unknown spin rule %d", int32(r))
	}
	spinRule.Store(int32(r))
	return nil
}

// CurrentSpinRule returns the process's spin rule (SetSpinRule).
func CurrentSpinRule() SpinRule { return SpinRule(spinRule.Load()) }

// spinConns counts the open Conns of the process that may spin: its
// callers.
var spinConns atomic.Int32

// affinityCPUs is how many CPUs the process could run on when it started
// (0: unknown).
var affinityCPUs = func() int {
	var s unix.CPUSet
	if unix.SchedGetaffinity(0, &s) != nil {
		return 0
	}
	return s.Count()
}()

// spinBudget is the most spinning Conns with which a Conn still spins
// under SpinBudgeted: the process's spare CPUs, at least one. A variable
// for tests.
var spinBudget = func() int { return spareCPUs(int(procs.Load()), affinityCPUs) }

// procs is GOMAXPROCS as last read (readProcs). runtime.GOMAXPROCS(0)
// answers under the scheduler's global lock, which every P's scheduling
// takes too: a Recv, which needs the figure for blockLimit and the spin's
// budget, reads this copy instead of taking that lock once a call on
// every direct Conn of the process (or at every wait on the poller, which
// is every Recv of a direct Conn once the process has more Conns open). It
// is read again whenever a direct Conn takes its place, after every
// kernel-wait window that ended without a packet, and once in procsEvery
// Recvs of a Conn, so that a change (runtime.GOMAXPROCS, or the runtime
// following a new CPU limit of the container) shows within that many
// calls.
var procs atomic.Int32

func init() { readProcs() }

// procsEvery is how many Recvs of a Conn read procs before it reads
// GOMAXPROCS again.
const procsEvery = 64

// readProcs reads GOMAXPROCS into procs.
func readProcs() { procs.Store(int32(runtime.GOMAXPROCS(0))) }

// spareCPUs is the spin budget of a process with procs Ps that may run on
// cpus CPUs (0: unknown): one CPU is left to everything else the process
// does, but a lone caller spins even on a single CPU, where its yields
// give the peer the CPU at once.
func spareCPUs(procs, cpus int) int {
	n := procs
	if cpus > 0 {
		n = min(n, cpus)
	}
	return max(1, n-1)
}

// keepSpinning is the spin rule: after a poll that found nothing, at
// elapsed into a spin of window, with callers spinning Conns open in the
// process and a budget of them, whether to poll again. switched says that
// the yield before that poll ran another thread on this CPU.
func keepSpinning(rule SpinRule, elapsed, window time.Duration, callers, budget int, switched bool) bool {
	switch {
	case elapsed >= window:
		return false
	case rule == SpinAlways:
		return true
	case callers > budget:
		return false // a P we hold may be wanted by another caller
	case switched:
		return false // the CPU is not ours: someone else wants it
	}
	return true
}

// gateHold is how many Recvs a Conn skips the spin for, without asking
// again, after SpinBudgeted's gate refused it (the process over its spin
// budget, or the machine busy). What the gate reads changes slowly (the
// machine's reading is held 100 ms while busy), but reading it is not
// free where the gate refuses: on a CPU shared by many processes every
// Recv follows other processes' runs, so the gate's variables, the
// runtime's lock and the clock's pages are cold in the caches and the TLB
// (on a VM with page-table isolation and no PCID, after every system call
// too). Asked at every Recv, it cost 4 and 16 client processes that never
// spun about 1% of their pairs a second against spin off; asked once in
// gateHold+1 Recvs, and skipped by a test of the Conn's own counter, they
// read as spin off (docs/benchmarks.md, "The gate held").
const gateHold = 16

// maxSpinBackoff is the most Recvs a Conn skips the spin for after its
// spins met a contended CPU.
const maxSpinBackoff = 64

// spinBackoff returns how many Recvs to skip the spin for after one whose
// spin met contention (cut: a yield ran another thread) or not, given the
// last backoff: it doubles with every cut spin, up to maxSpinBackoff, and
// is gone at the first spin that was not cut.
func spinBackoff(last int, cut bool) int {
	if !cut {
		return 0
	}
	return min(max(1, 2*last), maxSpinBackoff)
}

// Conn sends and receives packets on a SOCK_SEQPACKET Unix connection. A
// Conn is not safe for concurrent use by several readers or several
// writers; one reader and one writer may run at once.
//
// The hot path is a request and its reply, a few µs of work apart, between
// two processes that may share one CPU. Go's network poller costs such an
// exchange a wasted EAGAIN, two epoll_wait calls and often a wake-up of a
// second thread that spins on the CPU the peer needs, and a socket in an
// epoll set costs every packet it receives a callback in the kernel; a
// blocking syscall made the usual way lets the runtime's monitor hand the
// P to another thread when the wait outlasts 20 µs. So a Conn that Dial
// makes, or that a server promotes (TryDirect), is direct while the
// process has fewer than max(1, GOMAXPROCS-1) direct Conns (blockLimit):
// its socket is kept out of the poller, in blocking mode with SO_RCVTIMEO =
// KernelWait(), and while the process has no more Conns open than that,
// Recv waits the way a plain C program does: one recvmsg that blocks in
// the kernel, made without telling the scheduler, so the peer's send
// wakes this very thread. That thread keeps its P meanwhile, hence the
// count: with more Conns open, another Conn's request could wait for the
// P. When no packet comes within the window, or a signal (a preemption
// request of the garbage collector) interrupts the wait, Recv gives the P
// up (Gosched) and waits in the kernel again, for up to kernelStay in all;
// after that, or where the process has more Conns open, it waits on Go's
// poller, which holds no P and does not delay a stop of the world, with a
// duplicate of the socket registered for the wait (directFD). The other
// Conns use the poller alone, as any net.Conn. Send never
// blocks in the kernel (MSG_DONTWAIT, then a wait for room). Deadlines
// (SetDeadline) hold for Send and Recv in both kinds.
//
// A Conn may also spin (SetSpin): poll for the next packet for a few tens
// of µs before it sleeps at all. Where the peer runs on another CPU, that
// saves the wake-up of a sleeping thread on an idle CPU, which on a VM
// costs tens of µs (docs/benchmarks.md); between polls the thread yields,
// so a peer on the same CPU runs at once. Clients spin by default; the
// agent only when configured to (pollAfterReply). The process's SpinRule
// decides when a spin runs at all: by default only where it costs nobody
// CPU (SpinBudgeted).
type Conn struct {
	// The socket: uc (polled) or d (direct), and rc, d or uc's. Send
	// and Recv read them under their own lock (wmu, rmu), the other
	// methods under mmu; TryDirect changes them under all three.
	mmu sync.Mutex
	uc  *net.UnixConn
	d   *directFD
	rc  syscall.RawConn
	oob []byte

	// Send and Recv keep their syscall arguments here, under their own
	// lock (uncontended: one reader and one writer), so that the hot path
	// allocates nothing.
	wmu    sync.Mutex
	wmsg   unix.Msghdr
	wiov   unix.Iovec
	wn     uintptr
	werrno syscall.Errno
	writeF func(fd uintptr) bool

	rmu         sync.Mutex
	rmsg        unix.Msghdr
	riov        unix.Iovec
	rn          uintptr
	rerrno      syscall.Errno
	rblock      bool
	rspin       bool          // the next recvStep polls first (c.spin)
	noFiles     bool          // the socket refuses files (RefuseFiles): recvfrom; guarded by rmu
	spin        time.Duration // SetSpin; guarded by rmu
	peerHere    bool          // the peer is this process (SetSpin); guarded by rmu
	rusage      unix.Rusage   // the spin's scratch, for its context switches
	skip        int           // Recvs left without a spin (spinBackoff, gateHold)
	lastBackoff int           // the last spinBackoff
	counts      atomic.Bool   // counted in spinConns
	recvs       uint8         // Recvs since this Conn last read GOMAXPROCS (procsEvery)
	readF       func(fd uintptr) bool

	// ln is the lane the packets travel once UseLane gave one (lane.go),
	// set under all three locks; its steps are made once, as the socket's.
	ln                    *lane
	laneReadF, laneWriteF func(fd uintptr) bool

	closed atomic.Bool
}

// open counts the process's open Conns, direct or polled.
var open atomic.Int32

// blockLimit is the most direct Conns a process has at once, and the most
// open Conns with which a direct Conn still waits in the kernel; a
// variable for tests.
var blockLimit = func() int { return max(1, int(procs.Load())-1) }

// parked counts Recvs that found nothing within the kernel wait and went
// on waiting on the poller, spun the packets taken while
// spinning, and watched the spins that went past their first poll to
// yield and watch their thread's switches, for tests; spinsRun and
// yields count the spins that passed the rule's gate and the yields
// between their polls (SpinStats).
var parked, spun, watched, spinsRun, yields atomic.Int64

// SpinStats is what the spins of the process's Conns have done since it
// started: how often a Recv polled for its reply instead of sleeping at
// once, and how much CPU that held. A caller that wants to know whether
// the spin runs under its load (SpinBudgeted) compares two readings with
// the calls made between them.
type SpinStats struct {
	Spins  int64 // Recvs whose spin ran (made its first poll)
	Yields int64 // yields of the CPU between a spin's polls, counted when the spin ends
	Taken  int64 // packets a spin's poll took, so that the Recv slept not at all
}

// ReadSpinStats returns the process's SpinStats.
func ReadSpinStats() SpinStats {
	return SpinStats{Spins: spinsRun.Load(), Yields: yields.Load(), Taken: spun.Load()}
}

// NewConn wraps a connected unixpacket socket, polled: a server makes it
// direct with TryDirect once it knows the connection is worth it.
func NewConn(uc *net.UnixConn) *Conn {
	return newPolled(uc)
}

// TryDirect makes a polled Conn direct (see Conn) if the process has a
// direct Conn's place free, and reports whether the Conn is direct now. A
// server calls it when a connection opens a session, so that short-lived
// connections (health probes) never hold a place. It waits for a Send or
// Recv under way, and drops the deadlines set so far.
func (c *Conn) TryDirect() bool {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.mmu.Lock()
	defer c.mmu.Unlock()
	if c.d != nil {
		return true
	}
	if c.closed.Load() || c.rc == nil || !takeDirectSlot() {
		return false
	}
	fd, err := adoptDirect(c.uc)
	if err != nil {
		directSlots.Add(-1)
		return false
	}
	c.d = newDirectFD(fd)
	c.rc, c.uc = c.d, nil
	return true
}

func newConn() *Conn {
	open.Add(1)
	c := &Conn{oob: make([]byte, unix.CmsgSpace(4*MaxFDs))}
	c.writeF, c.readF = c.sendStep, c.recvStep
	c.laneReadF, c.laneWriteF = c.laneStep, c.laneWriteStep
	return c
}

func newDirect(fd int) *Conn {
	c := newConn()
	c.d = newDirectFD(fd)
	c.rc = c.d
	return c
}

func newPolled(uc *net.UnixConn) *Conn {
	c := newConn()
	c.uc = uc
	if rc, err := uc.SyscallConn(); err == nil {
		c.rc = rc // else Send and Recv return the error
	}
	return c
}

// Dial connects to the socket at path.
func Dial(path string) (*Conn, error) {
	if takeDirectSlot() {
		fd, err := dialDirect(path)
		if err != nil {
			directSlots.Add(-1)
			return nil, fmt.Errorf("wire: %w", err)
		}
		return newDirect(fd), nil
	}
	uc, err := net.DialUnix(Network, nil, &net.UnixAddr{Name: path, Net: Network})
	if err != nil {
		return nil, fmt.Errorf("wire: %w", err)
	}
	return newPolled(uc), nil
}

// SyscallConn returns the socket's raw connection, for options and
// credentials; read and write packets through the Conn.
func (c *Conn) SyscallConn() (syscall.RawConn, error) {
	c.mmu.Lock()
	defer c.mmu.Unlock()
	if c.rc == nil {
		return nil, net.ErrClosed
	}
	return c.rc, nil
}

// SetDeadline sets the deadline of Send and Recv, as net.Conn's; a zero t
// clears it. A call waiting when it is set keeps the deadline it started
// with.
func (c *Conn) SetDeadline(t time.Time) error { return c.setDeadline(t, true, true) }

// SetReadDeadline sets the deadline of Recv (SetDeadline).
func (c *Conn) SetReadDeadline(t time.Time) error { return c.setDeadline(t, true, false) }

// SetWriteDeadline sets the deadline of Send (SetDeadline).
func (c *Conn) SetWriteDeadline(t time.Time) error { return c.setDeadline(t, false, true) }

func (c *Conn) setDeadline(t time.Time, read, write bool) error {
	c.mmu.Lock()
	defer c.mmu.Unlock()
	if c.ln != nil && !c.closed.Load() {
		c.ln.r.setDeadline(t, read, false)
		c.ln.w.setDeadline(t, false, write)
	}
	if c.d == nil {
		switch {
		case read && write:
			return c.uc.SetDeadline(t)
		case read:
			return c.uc.SetReadDeadline(t)
		}
		return c.uc.SetWriteDeadline(t)
	}
	if c.closed.Load() {
		return fmt.Errorf("wire: set deadline: %w", net.ErrClosed)
	}
	c.d.setDeadline(t, read, write)
	return nil
}

// Close closes the connection. A Recv waiting in another goroutine returns
// at once.
func (c *Conn) Close() error {
	c.mmu.Lock()
	defer c.mmu.Unlock()
	if !c.closed.CompareAndSwap(false, true) {
		if c.d != nil {
			return fmt.Errorf("wire: close: %w", net.ErrClosed)
		}
		return c.uc.Close() // net's error for a second close
	}
	c.uncount()
	open.Add(-1)
	if c.ln != nil {
		c.ln.r.close()
		c.ln.w.close()
	}
	if c.d == nil {
		if c.rc != nil {
			// End a spin in another goroutine's Recv: its polls hold the
			// file open, so only a shutdown makes them return.
			// Control fails only when the file is already closed.
			_ = c.rc.Control(func(fd uintptr) { _ = unix.Shutdown(int(fd), unix.SHUT_RDWR) })
		}
		return c.uc.Close()
	}
	directSlots.Add(-1)
	c.d.close()
	return nil
}

// SetSpin makes Recv poll for a packet for up to d (at most SpinLimit)
// before it waits in the kernel or on the poller; 0 turns it off (the
// default). Spinning costs the caller's CPU for up to d per Recv and saves
// the wake-up when the packet comes within d: worth it for a client, whose
// thread has nothing else to do until the reply, and for a server only
// where CPU is cheaper than latency.
func (c *Conn) SetSpin(d time.Duration) error {
	if d < 0 || d > SpinLimit {
		return fmt.Errorf("wire: spin %v outside [0, %v]", d, SpinLimit)
	}
	c.rmu.Lock()
	c.spin = d
	if d > 0 {
		c.peerHere = false
		if rc, err := c.SyscallConn(); err == nil {
			_ = rc.Control(func(fd uintptr) { c.peerHere = peerInProcess(int(fd)) })
		}
	}
	here := c.peerHere
	c.rmu.Unlock()
	if d == 0 || here {
		c.uncount()
	} else if !c.closed.Load() && c.counts.CompareAndSwap(false, true) {
		spinConns.Add(1)
		if c.closed.Load() {
			c.uncount() // Close ran meanwhile and found nothing counted
		}
	}
	return nil
}

// peerInProcess reports whether the socket's peer is this process
// (SO_PEERCRED). A variable for tests, whose pairs are all in process.
var peerInProcess = func(fd int) bool {
	cred, err := unix.GetsockoptUcred(fd, unix.SOL_SOCKET, unix.SO_PEERCRED)
	return err == nil && int(cred.Pid) == os.Getpid()
}

// soPassRights is SO_PASSRIGHTS (Linux 6.16): off, a Unix socket refuses
// file descriptors sent to it, and the sender's sendmsg fails with EPERM.
const soPassRights = 83

// CanRefuseFiles reports whether this kernel lets a socket refuse files
// (SO_PASSRIGHTS, Linux 6.16), probed once on a socket pair of its own.
var CanRefuseFiles = sync.OnceValue(func() bool {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	return unix.SetsockoptInt(fds[0], unix.SOL_SOCKET, soPassRights, 0) == nil
})

// RefuseFiles makes the socket refuse file descriptors (SO_PASSRIGHTS off:
// a peer's send of one fails with EPERM and nothing arrives) and reports
// whether it does; a kernel before 6.16 lacks the option, and then nothing
// changes. Once it does, Recv reads each packet with recvfrom, which spares
// the kernel the copies in and out of a message header that recvmsg makes
// (measured in C on one CPU, about 0.3 µs of each receive, 0.6 of an 8 µs
// round trip), and never returns files. For a side whose peer never sends
// files: the agent for requests, a client once its session is open. It
// waits for a Recv under way.
func (c *Conn) RefuseFiles() bool {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	if c.noFiles {
		return true
	}
	rc, err := c.SyscallConn()
	if err != nil {
		return false
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, soPassRights, 0) }); err != nil || serr != nil {
		return false
	}
	c.noFiles = true
	return true
}

// uncount takes the Conn out of spinConns, once.
func (c *Conn) uncount() {
	if c.counts.CompareAndSwap(true, false) {
		spinConns.Add(-1)
	}
}

// mayBlock reports whether Recv may wait in the kernel now: a direct Conn
// without a read deadline (which the poller keeps exactly; the kernel wait
// rounds up to scheduler ticks) and not kept on the poller, while the
// process has no more Conns open than blockLimit. A thread waiting there
// keeps its P for up to the kernel wait, which the kernel rounds up to
// 5-12 ms; with more Conns than that open, a request on another Conn would
// wait for that P.
func (c *Conn) mayBlock() bool {
	if c.d == nil {
		return false
	}
	d := c.d
	if c.ln != nil {
		d = c.ln.r // a lane waits in the kernel on its pipe (lane.go)
	}
	return d.rdl.Load() == 0 && !d.nonBlock.Load() && int(open.Load()) <= blockLimit()
}

// Send writes one packet, passing fds by SCM_RIGHTS when there are any. The
// caller keeps ownership of fds.
func (c *Conn) Send(pkt []byte, fds []int) error {
	if len(pkt) > MaxMessage {
		return fmt.Errorf("wire: send %d bytes: %w", len(pkt), ErrTooLarge)
	}
	if len(fds) > MaxFDs {
		return fmt.Errorf("wire: send %d fds, at most %d", len(fds), MaxFDs)
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.rc == nil {
		return fmt.Errorf("wire: send: %w", net.ErrClosed)
	}
	if c.ln != nil {
		return c.laneSend(pkt, fds)
	}
	m := &c.wmsg
	*m = unix.Msghdr{}
	if len(pkt) > 0 {
		c.wiov.Base = &pkt[0]
		c.wiov.SetLen(len(pkt))
		m.Iov = &c.wiov
		m.SetIovlen(1)
	}
	if len(oob) > 0 {
		m.Control = &oob[0]
		m.SetControllen(len(oob))
	}
	c.wn, c.werrno = 0, 0
	err := c.rc.Write(c.writeF)
	n, errno := c.wn, c.werrno
	c.wiov.Base, m.Iov, m.Control = nil, nil, nil
	if err == nil && errno != 0 {
		err = os.NewSyscallError("sendmsg", errno)
	}
	if err != nil {
		return fmt.Errorf("wire: send: %w", err)
	}
	if int(n) != len(pkt) {
		return fmt.Errorf("wire: send: short write %d of %d bytes", n, len(pkt))
	}
	return nil
}

// sendStep is the write step of Send: it never blocks in the kernel. A
// packet without files goes by sendto, which spares the kernel the copy of
// the message header and the import of an iovec that sendmsg makes (on
// one CPU, measured in C, about 0.2 µs of a 8 µs round trip a call).
func (c *Conn) sendStep(fd uintptr) bool {
	const flags = unix.MSG_DONTWAIT | unix.MSG_NOSIGNAL
	if c.wmsg.Control == nil && c.wiov.Base != nil {
		c.wn, _, c.werrno = syscall.RawSyscall6(unix.SYS_SENDTO, fd, uintptr(unsafe.Pointer(c.wiov.Base)), uintptr(c.wiov.Len), flags, 0, 0)
	} else {
		c.wn, _, c.werrno = syscall.RawSyscall(unix.SYS_SENDMSG, fd, uintptr(unsafe.Pointer(&c.wmsg)), flags)
	}
	return c.werrno != unix.EAGAIN && c.werrno != unix.EINTR
}

// recvStep is the read step of Recv: while c.rblock it waits in the
// kernel, up to the kernel wait.
func (c *Conn) recvStep(fd uintptr) bool {
	flags := uintptr(unix.MSG_CMSG_CLOEXEC)
	if c.rspin {
		c.rspin = false
		// A Conn in a backoff or in the gate's hold skips the spin
		// touching nothing but itself (gateHold says why).
		if c.skip > 0 {
			c.skip--
		} else if c.spinFor(fd, flags) {
			return true
		}
	}
	if !c.rblock {
		flags |= unix.MSG_DONTWAIT
	}
	// RawSyscall: the wait is short (SO_RCVTIMEO) and a signal ends it
	// (EINTR), so the P is not handed to another thread meanwhile.
	c.recv(fd, flags)
	if c.rerrno != unix.EAGAIN && c.rerrno != unix.EINTR {
		return true
	}
	if c.rblock && c.waitInKernel(fd, flags) {
		return true
	}
	// Nothing within the kernel wait: wait on the poller, then take the
	// packet without blocking.
	c.rblock = false
	return false
}

// recv is one receive of Recv's packet, into c.rn and c.rerrno: recvmsg,
// or recvfrom where the socket refuses files (RefuseFiles), asked with
// MSG_TRUNC for the packet's whole length, so that Recv still tells a
// packet longer than its buffer.
func (c *Conn) recv(fd, flags uintptr) {
	if c.noFiles {
		c.rn, _, c.rerrno = syscall.RawSyscall6(unix.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(c.riov.Base)), uintptr(c.riov.Len),
			flags&^unix.MSG_CMSG_CLOEXEC|unix.MSG_TRUNC, 0, 0)
		return
	}
	m := &c.rmsg
	m.SetControllen(len(c.oob))
	m.Flags = 0
	c.rn, _, c.rerrno = syscall.RawSyscall(unix.SYS_RECVMSG, fd, uintptr(unsafe.Pointer(m)), flags)
}

// kernelStay is how long a direct Conn's Recv goes on waiting in the
// kernel after its first window, a window after another, before it waits
// on the poller.
const kernelStay = 50 * time.Millisecond

// waitInKernel goes on waiting for a packet in the kernel after a window
// that ended without one (its timeout, or a signal: a preemption request),
// giving the P up between windows (Gosched) so that whatever else the
// process has to run, a stop of the world included, runs then: for up to
// kernelStay, while the process has no more Conns open than blockLimit. It
// reports whether the last recvmsg is Recv's result.
//
// Why not the poller at once: the wake-up the poller costs a process whose
// only goroutine waits is a runtime's thread woken and its monitor's own
// wake-ups after it, a few system calls and context switches of a CPU the
// peer may need; where many such processes share a CPU and replies come
// late, those wake-ups made them later still (the one-CPU sweep of
// docs/benchmarks.md went from 16,000 to 2,000 pairs a second).
func (c *Conn) waitInKernel(fd, flags uintptr) bool {
	start := time.Now()
	readProcs() // here a window has ended: a slow path
	for time.Since(start) < kernelStay && c.mayBlock() {
		runtime.Gosched()
		c.recv(fd, flags)
		if c.rerrno != unix.EAGAIN && c.rerrno != unix.EINTR {
			return true
		}
		readProcs()
	}
	parked.Add(1)
	return false
}

// spinFor polls for a packet for up to c.spin, yielding the CPU between
// polls, as long as the spin rule (keepSpinning) allows, and reports
// whether the last poll is Recv's result (a packet, the end of the
// connection or an error other than "nothing yet").
func (c *Conn) spinFor(fd, flags uintptr) bool {
	rule := CurrentSpinRule()
	budget := 0
	var switches int64
	if rule == SpinBudgeted {
		if c.peerHere {
			return false
		}
		budget = spinBudget()
		if int(spinConns.Load()) > budget || !idleCPU() {
			c.skip = gateHold
			return false
		}
	}
	spinsRun.Add(1)
	// One poll before anything else: where the peer shares this CPU, the
	// send that woke it has usually let it run and answer already, and
	// the spin's bookkeeping below (a thread lock and a getrusage, about
	// a tenth of a one-CPU round trip) would be spent for nothing. A
	// packet there already is taken as a cut spin (backoff): it came
	// while this thread was still in its send, so the peer ran on this
	// CPU (or this thread waited for one), and a spin saves no wake-up
	// there; the gate and the clock are left alone for the Recvs after.
	if done, got := c.poll(fd, flags); done {
		if got {
			c.backoff(rule, true)
		}
		return true
	}
	start := time.Now()
	if rule == SpinBudgeted {
		// The thread's involuntary context switches tell whether a
		// yield ran another thread: keep to this thread meanwhile.
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		switches = c.involuntarySwitches()
		watched.Add(1)
	}
	// The yields are counted here and added to the process's count once
	// the spin ends: spinning Conns of one process would otherwise write
	// one shared counter between every two polls.
	switched, cut, yielded := false, false, int64(0)
	for {
		if !keepSpinning(rule, time.Since(start), c.spin, int(spinConns.Load()), budget, switched) {
			yields.Add(yielded)
			c.backoff(rule, cut)
			return false
		}
		// The peer may be runnable on this very CPU: let it run.
		_, _, _ = syscall.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
		yielded++
		if rule == SpinBudgeted {
			n := c.involuntarySwitches()
			switched, switches = n < 0 || n != switches, n
			cut = cut || switched
		}
		if done, got := c.poll(fd, flags); done {
			yields.Add(yielded)
			if got {
				c.backoff(rule, cut)
			}
			return true
		}
	}
}

// poll is one non-blocking receive of the spin: done when it is Recv's
// result (got: a packet; else the end of the connection or an error other
// than "nothing yet").
func (c *Conn) poll(fd, flags uintptr) (done, got bool) {
	if c.ln != nil {
		if !c.laneRead(fd) {
			return false, false
		}
		got = c.rn > 0 && c.ln.err == nil && c.rerrno == 0
		if got {
			spun.Add(1)
		}
		return true, got
	}
	c.recv(fd, flags|unix.MSG_DONTWAIT)
	switch c.rerrno {
	case 0:
		spun.Add(1)
		return true, true
	case unix.EAGAIN, unix.EINTR:
		return false, false
	}
	return true, false
}

// backoff sets the Recvs the next spins are skipped for, after a spin
// during which a yield ran another thread (cut) or none did.
func (c *Conn) backoff(rule SpinRule, cut bool) {
	if rule == SpinBudgeted {
		c.lastBackoff = spinBackoff(c.lastBackoff, cut)
		c.skip = c.lastBackoff
	}
}

// involuntarySwitches returns the calling thread's involuntary context
// switches (a yield that ran another thread is one); -1 when the kernel
// does not say, which ends a budgeted spin at its first yield.
func (c *Conn) involuntarySwitches() int64 {
	if _, _, e := syscall.RawSyscall(unix.SYS_GETRUSAGE, uintptr(unix.RUSAGE_THREAD), uintptr(unsafe.Pointer(&c.rusage)), 0); e != 0 {
		return -1
	}
	return c.rusage.Nivcsw
}

// Recv reads one packet into buf (which should have room for MaxMessage+1
// bytes, so that an oversized packet is detected) and returns it with the
// files passed alongside. The caller owns the files. A packet longer than
// MaxMessage, or whose descriptors did not fit, returns an error wrapping
// ErrTooLarge; the connection should then be closed. io.EOF means the peer
// closed the connection.
func (c *Conn) Recv(buf []byte) ([]byte, []*os.File, error) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	if c.rc == nil {
		return nil, nil, fmt.Errorf("wire: recv: %w", net.ErrClosed)
	}
	if c.recvs++; c.recvs >= procsEvery {
		c.recvs = 0
		readProcs()
	}
	if c.ln != nil {
		return c.laneRecv(buf)
	}
	m := &c.rmsg
	*m = unix.Msghdr{}
	c.riov.Base = nil
	c.riov.SetLen(0) // recvfrom reads the iovec's fields (recv)
	if len(buf) > 0 {
		c.riov.Base = &buf[0]
		c.riov.SetLen(len(buf))
		m.Iov = &c.riov
		m.SetIovlen(1)
	}
	m.Control = &c.oob[0]
	c.rn, c.rerrno, c.rblock, c.rspin = 0, 0, c.mayBlock(), c.spin > 0
	err := c.rc.Read(c.readF)
	n, errno := c.rn, c.rerrno
	c.riov.Base, m.Iov = nil, nil
	if err == nil && errno != 0 {
		call := "recvmsg"
		if c.noFiles {
			call = "recvfrom"
		}
		err = os.NewSyscallError(call, errno)
	}
	if err != nil {
		if c.closed.Load() && !errors.Is(err, net.ErrClosed) {
			err = fmt.Errorf("%w: %w", net.ErrClosed, err)
		}
		return nil, nil, fmt.Errorf("wire: recv: %w", err)
	}
	oobn, flags := int(m.Controllen), int(m.Flags)
	if c.noFiles {
		oobn, flags = 0, 0
		if int(n) > len(buf) {
			flags = unix.MSG_TRUNC
		}
	}
	var files []*os.File
	if oobn > 0 {
		if files, err = unixsock.Files(c.oob[:oobn], "kvpool-fd"); err != nil {
			err = fmt.Errorf("wire: recv: %w", err)
		}
	}
	if err == nil && n == 0 {
		err = io.EOF
		if c.closed.Load() {
			err = fmt.Errorf("wire: recv: %w", net.ErrClosed)
		}
	}
	if err == nil && (flags&unix.MSG_TRUNC != 0 || int(n) > MaxMessage) {
		err = fmt.Errorf("wire: recv: %w (limit %d)", ErrTooLarge, MaxMessage)
	}
	if err == nil && flags&unix.MSG_CTRUNC != 0 {
		err = fmt.Errorf("wire: recv: %w: file descriptors truncated (limit %d)", ErrTooLarge, MaxFDs)
	}
	if err != nil {
		for _, f := range files {
			f.Close()
		}
		return nil, nil, err
	}
	return buf[:n], files, nil
}
