package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// adoptChild is the hidden subcommand adoptFloor runs kvbench as.
const adoptChild = "adopt-floor-child"

// adoptPage is the unit adoptFloor stamps and checks: the kernel's page.
const adoptPage = 4096

// adoptFloor is what a restart that adopted its state, instead of
// rebuilding it from the books, would pay at least: a fresh process
// mapping n bytes that another process wrote into a memfd (as a keeper
// would hold them, resident) and reading a word of every page, timed
// inside that process from before the mapping to the last read. Each page
// carries its index, which the child checks, so a mapping that reads
// anything else fails. It returns the milliseconds of each of runs
// children.
func adoptFloor(n int64, runs int) ([]float64, error) {
	n = (n + adoptPage - 1) &^ (adoptPage - 1)
	if n <= 0 {
		return nil, errors.New("adopt floor: nothing to map")
	}
	fd, err := unix.MemfdCreate("kvbench-adopt", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("adopt floor: memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "kvbench-adopt")
	defer f.Close()
	if err := f.Truncate(n); err != nil {
		return nil, fmt.Errorf("adopt floor: %w", err)
	}
	mem, err := unix.Mmap(fd, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("adopt floor: mmap: %w", err)
	}
	for off := 0; off < len(mem); off += adoptPage {
		binary.LittleEndian.PutUint64(mem[off:], uint64(off/adoptPage))
	}
	if err := unix.Munmap(mem); err != nil {
		return nil, fmt.Errorf("adopt floor: munmap: %w", err)
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	var out []float64
	for range runs {
		c := exec.Command(self, adoptChild, strconv.FormatInt(n, 10))
		c.ExtraFiles = []*os.File{f} // fd 3
		b, err := c.Output()
		if err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				err = fmt.Errorf("%w: %s", err, ee.Stderr)
			}
			return nil, fmt.Errorf("adopt floor: %w", err)
		}
		ns, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("adopt floor: the child said %q", b)
		}
		out = append(out, float64(ns)/1e6)
	}
	return out, nil
}

// runAdoptChild is the child of adoptFloor: it maps the memfd at fd 3
// (size given), populated, reads every page's stamp and prints the
// nanoseconds that took.
func runAdoptChild(args []string) error {
	if len(args) != 1 {
		return errors.New("usage: kvbench " + adoptChild + " BYTES (fd 3: the memfd)")
	}
	n, err := strconv.Atoi(args[0])
	if err != nil || n <= 0 || n%adoptPage != 0 {
		return fmt.Errorf("%q is not a positive multiple of %d", args[0], adoptPage)
	}
	t0 := time.Now()
	mem, err := unix.Mmap(3, 0, n, unix.PROT_READ, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return fmt.Errorf("mmap: %w", err)
	}
	for off := 0; off < n; off += adoptPage {
		if got := binary.LittleEndian.Uint64(mem[off:]); got != uint64(off/adoptPage) {
			return fmt.Errorf("page %d reads %d", off/adoptPage, got)
		}
	}
	took := time.Since(t0)
	fmt.Println(took.Nanoseconds())
	return unix.Munmap(mem)
}

// median of ms (0 for none).
func median(ms []float64) float64 {
	if len(ms) == 0 {
		return 0
	}
	s := slices.Clone(ms)
	slices.Sort(s)
	return s[len(s)/2]
}
