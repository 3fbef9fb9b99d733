package wire

import (
	"os"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/pkg/cpulist"
)

// A spin pays only where a CPU is idle for the peer it waits on. Within
// one process the budget (spinBudget) sees that; across processes (an
// engine of many worker processes on the agent's CPUs) only the kernel
// does: /proc/loadavg's fourth field counts the tasks running or
// runnable on the whole machine now. A budgeted spin starts only while
// every one of them has a CPU: that count, the spinner and the peer
// serving it included, at most the machine's online CPUs.
// The count is read at most once per idleCPUEvery per process, by raw
// system calls (readSmall).

// idleCPUEvery is how long a reading that found a CPU for every runnable
// task is used for; idleCPUBusyHold how long one that did not is. A busy
// machine is seldom busy for only a moment, while a moment without a
// waiting task comes and goes: with 64 processes calling on 2 CPUs and
// every reading held 10 ms, the readings that now and then found none
// waiting let through spins that cut the throughput to a third of spin
// off's; holding busy readings 100 ms brought it to 0.6. Most of that
// cost was the reading's own system calls, made the scheduler's way then
// (readSmall says why); with raw ones, 64 processes are at 0.75-1.10x
// spin off with busy readings held 100 ms and 0.89-1.21x with 10 ms, the
// same within the noise: the longer hold is kept as the cheaper.
const (
	idleCPUEvery    = 10 * time.Millisecond
	idleCPUBusyHold = 100 * time.Millisecond
)

var (
	idleEpoch   = time.Now()
	idleUntil   atomic.Int64 // idleEpoch-relative ns until which the last reading stands; 0: none yet
	idleLast    atomic.Bool  // the last reading: no runnable task waited for a CPU
	onlineCPUs  = readOnlineCPUs()
	idleCPURead = readIdleCPU // a variable for tests
)

// idleCPU says whether every runnable task of the machine had a CPU at
// the last reading (taken again once it is idleCPUEvery old, or
// idleCPUBusyHold when it found tasks waiting). Where the kernel does not
// say, it says yes: the process's own budget still bounds the spin. Two
// callers may both take a reading at once, and one may see the other's
// time with its own result for a moment: either reading is recent.
func idleCPU() bool {
	now := int64(time.Since(idleEpoch)) + 1
	if until := idleUntil.Load(); until != 0 && now < until {
		return idleLast.Load()
	}
	ok := idleCPURead()
	hold := idleCPUBusyHold
	if ok {
		hold = idleCPUEvery
	}
	idleLast.Store(ok)
	idleUntil.Store(now + int64(hold))
	return ok
}

func readIdleCPU() bool {
	if onlineCPUs <= 0 {
		return true
	}
	var buf [128]byte
	n, err := readSmall(loadavgPath, buf[:])
	if err != nil {
		return true
	}
	running, ok := parseLoadavgRunning(buf[:n])
	if !ok {
		return true
	}
	return running <= onlineCPUs
}

// loadavgPath is the file the gate reads, NUL-terminated for the raw
// open.
var loadavgPath = []byte("/proc/loadavg\x00")

// readSmall reads the start of a small procfs file (path NUL-terminated)
// into buf without allocating, by raw system calls: opening and reading
// such a file never blocks, and the caller is on a Recv's hot path, where
// a system call that the scheduler is told of (entersyscall) costs far
// more than its few microseconds on a crowded machine (measured, not
// traced: likely a thread preempted inside the call loses its P, and the
// runtime starts another thread to run the process's goroutines). Even a
// getpid made that way ten times a second in each process cost 0.63-0.76x.
// Reading /proc/loadavg that way ten
// times a second in each of 64 client processes on 2 CPUs cost 0.6x the
// throughput of spin off; by raw calls, 0.75-0.96x, within the case's
// noise (docs/benchmarks.md).
func readSmall(path []byte, buf []byte) (int, error) {
	fd, _, e := syscall.RawSyscall6(unix.SYS_OPENAT, atFDCWD, uintptr(unsafe.Pointer(&path[0])),
		unix.O_RDONLY|unix.O_CLOEXEC, 0, 0, 0)
	if e != 0 {
		return 0, e
	}
	n, _, e := syscall.RawSyscall(unix.SYS_READ, fd, uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)))
	_, _, _ = syscall.RawSyscall(unix.SYS_CLOSE, fd, 0, 0) // a read-only procfs file: nothing to lose
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

// atFDCWD is AT_FDCWD as a system call argument.
var atFDCWD = func() uintptr { d := unix.AT_FDCWD; return uintptr(d) }()

// parseLoadavgRunning reads the running count of /proc/loadavg's
// "0.61 1.14 1.77 3/412 12345": the number before the slash of the
// fourth field.
func parseLoadavgRunning(b []byte) (int, bool) {
	field := 0
	for i := 0; i < len(b); i++ {
		if b[i] != ' ' {
			continue
		}
		if field++; field < 3 {
			continue
		}
		n, j := parseUint(b[i+1:])
		if j == 0 || j >= len(b)-i-1 || b[i+1+j] != '/' {
			return 0, false
		}
		return n, true
	}
	return 0, false
}

// parseUint reads the decimal digits at the start of b: their value and
// how many there were (0: none, or too many for an int count).
func parseUint(b []byte) (int, int) {
	n, i := 0, 0
	for ; i < len(b) && b[i] >= '0' && b[i] <= '9'; i++ {
		if i == 9 {
			return 0, 0
		}
		n = n*10 + int(b[i]-'0')
	}
	return n, i
}

// readOnlineCPUs counts the machine's online CPUs
// (/sys/devices/system/cpu/online); 0 when unknown.
func readOnlineCPUs() int {
	b, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		return 0
	}
	cpus, err := cpulist.Parse(string(b))
	if err != nil {
		return 0
	}
	return len(cpus)
}
