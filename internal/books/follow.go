package books

import (
	"errors"
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// A Follower replays books that another process, their writer, is still
// appending to: a spare agent reads the serving agent's books ahead of its
// turn, so that at a restart it replays only the records committed since
// its last read, not the whole books (Load). Each record is read once its
// commit word is stored, which the writer stores last, so a Follower only
// ever reads committed records; a record rewritten under it (the next
// writer clearing a torn one) is read again at the next Advance.
//
// A Follower reads one memfd: books that compact go on in a fresh one, which
// its owner follows anew. A books memfd only grows once a keeper holds it
// (a compaction sizes its fresh memfd before the hand-over), so the
// Follower's mapping never reaches past the file's end. It holds a read-only mapping of the memfd and the
// replayed state (about as much heap as the agent's books take at a
// restart); between calls the state holds nothing of the mapping. Its
// methods are not safe for concurrent use.
type Follower struct {
	f        *os.File
	dev, ino uint64
	mem      []byte
	gen      uint64
	rp       replayer
	reads    int
}

// ErrNotFollowed reports books that are not the memfd a Follower reads.
var ErrNotFollowed = errors.New("books: not the memfd the follower reads")

// Follow reads the committed records of the books memfd f and returns the
// Follower that goes on reading them. It takes f (closed by Close).
func Follow(f *os.File) (*Follower, error) {
	var s unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &s); err != nil {
		f.Close()
		return nil, fmt.Errorf("books: fstat: %w", err)
	}
	fl := &Follower{f: f, dev: s.Dev, ino: s.Ino}
	// One CPU: the follower reads beside the agent that serves.
	fl.rp = replayer{r: router{procs: 1}}
	if err := fl.Advance(); err != nil {
		fl.Close()
		return nil, err
	}
	return fl, nil
}

// Gen is the generation of the books the Follower reads.
func (fl *Follower) Gen() uint64 { return fl.gen }

// Reads is how many times the Follower has read its books (Follow's
// first read and each Advance).
func (fl *Follower) Reads() int { return fl.reads }

// Sizes is what Sizes(f) tells of the books read so far: the bytes of
// their snapshot and of the records after it.
func (fl *Follower) Sizes() (snapshot, records int64) {
	if fl.rp.st == nil {
		return 0, 0
	}
	end := fl.rp.st.snapEnd
	return int64(end - headerSize), int64(fl.rp.off - min(end, fl.rp.off))
}

// Follows reports whether f is the memfd the Follower reads.
func (fl *Follower) Follows(f *os.File) bool {
	var s unix.Stat_t
	return f != nil && unix.Fstat(int(f.Fd()), &s) == nil && s.Dev == fl.dev && s.Ino == fl.ino
}

// Advance reads the records committed since the last read. An error
// means the books cannot be followed (they do not replay: Load says the
// same of them); the Follower is then to be closed.
func (fl *Follower) Advance() error {
	fl.reads++
	var s unix.Stat_t
	if err := unix.Fstat(int(fl.f.Fd()), &s); err != nil {
		return fmt.Errorf("books: fstat: %w", err)
	}
	if s.Size < headerSize {
		return fmt.Errorf("%w: %d bytes, shorter than the header", ErrCorrupt, s.Size)
	}
	if int(s.Size) != len(fl.mem) {
		// The log grew (or was cut short: a new writer's room): mapped
		// again, the state holding nothing of the old mapping.
		if fl.mem != nil {
			_ = unix.Munmap(fl.mem)
			fl.mem = nil
		}
		mem, err := unix.Mmap(int(fl.f.Fd()), 0, int(s.Size), unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			return fmt.Errorf("books: map: %w", err)
		}
		fl.mem = mem
	}
	gen, end, err := checkHeader(fl.mem)
	if err != nil {
		return err
	}
	if fl.rp.off == 0 {
		fl.gen = gen
		fl.rp.off = headerSize
		fl.rp.hints = offloadHints(fl.mem, fl.rp.off, end)
	} else if gen != fl.gen {
		return fmt.Errorf("%w: the followed books changed generation from %d to %d", ErrCorrupt, fl.gen, gen)
	}
	if end < fl.rp.off {
		return fmt.Errorf("%w: the followed books end at %d, before the %d bytes read", ErrCorrupt, end, fl.rp.off)
	}
	if err := fl.rp.read(fl.mem, end, true); err != nil {
		return err
	}
	if fl.rp.st == nil {
		// A snapshot not yet whole (its parts are slices of the
		// mapping): read again from the start next time.
		fl.rp = replayer{r: router{procs: fl.rp.r.procs}}
		return nil
	}
	return fl.rp.settle()
}

// Load finishes the follow: f must be the memfd the Follower reads (a
// keeper handed it over once the writer was gone), whose records
// committed since the last read it replays. It returns what Load(f) would
// return, and closes the Follower either way. ErrNotFollowed: f is
// another memfd, and nothing was read.
func (fl *Follower) Load(f *os.File) (*State, Info, error) {
	defer fl.Close()
	var info Info
	if !fl.Follows(f) {
		return nil, info, ErrNotFollowed
	}
	from := fl.rp.off
	fl.rp.r.procs = runtime.GOMAXPROCS(0) // the agent waits for it now
	if err := fl.Advance(); err != nil {
		return nil, info, err
	}
	st, err := fl.rp.finish()
	if err != nil {
		return nil, info, err
	}
	info.Gen = fl.gen
	info.LastAlive = lastAlive(fl.mem)
	info.Replayed = fl.rp.off - min(from, fl.rp.off)
	st.keepSource(f, fl.mem, fl.rp.off)
	return st, info, nil
}

// Close unmaps the books and closes the Follower's file; the Follower
// keeps nothing of the state it replayed. Closing again, or a nil
// Follower, does nothing.
func (fl *Follower) Close() {
	if fl == nil {
		return
	}
	fl.rp = replayer{}
	if fl.mem != nil {
		_ = unix.Munmap(fl.mem)
		fl.mem = nil
	}
	if fl.f != nil {
		fl.f.Close()
		fl.f = nil
	}
}
