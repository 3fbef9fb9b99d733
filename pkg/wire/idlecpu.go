package wire

import (
	"os"
	"sync/atomic"
	"time"

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
// The count is read at most once per idleCPUEvery per process: a read
// costs a few microseconds of kernel time, which 64 processes reading it
// every millisecond would spend many times a second.

// idleCPUEvery is how long a reading that found a CPU for every runnable
// task is used for; idleCPUBusyHold how long one that did not is. A busy
// machine is seldom busy for only a moment, while a moment without a
// waiting task comes and goes: with 64 processes calling on 2 CPUs and
// every reading held 10 ms, the readings that now and then found none
// waiting let through spins that cut the throughput to a third of spin
// off's; holding busy readings 100 ms brought it to 0.6 (still a cost:
// docs/benchmarks.md).
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
	n, err := readSmall("/proc/loadavg", buf[:])
	if err != nil {
		return true
	}
	running, ok := parseLoadavgRunning(buf[:n])
	if !ok {
		return true
	}
	return running <= onlineCPUs
}

// readSmall reads the start of a small file into buf without allocating.
func readSmall(path string, buf []byte) (int, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	return unix.Read(fd, buf)
}

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
