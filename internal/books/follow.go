package books

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"runtime"
	"sync/atomic"

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
// Books that compact go on in a fresh memfd, whose header says which log
// its snapshot stands for and up to where (origin): a Follower of that log
// goes on there from where it stands (Next), without reading the snapshot;
// other memfds are followed anew. A books memfd only grows once a keeper holds it
// (a compaction sizes its fresh memfd before the hand-over), so the
// Follower's mapping never reaches past the file's end. It holds a read-only mapping of the memfd and the
// replayed state (about as much heap as the agent's books take at a
// restart); between calls the state holds nothing of the mapping. Its
// methods are not safe for concurrent use.
type Follower struct {
	f        *os.File
	dev, ino uint64
	mem      []byte
	// stale: mappings replaced while a read cut by its halt left a
	// snapshot's parts in them, unmapped once they are decoded.
	stale [][]byte
	gen   uint64
	rp    replayer
	reads int
}

// ErrNotFollowed reports books that are not the memfd a Follower reads.
var ErrNotFollowed = errors.New("books: not the memfd the follower reads")

// Follow reads the committed records of the books memfd f and returns the
// Follower that goes on reading them. It takes f (closed by Close). Once
// halt (nil: none) is true, Follow's read and every Advance stop at the
// next record, or the next batch of a snapshot's requests (a spare's turn
// came): Load then goes on from there.
func Follow(f *os.File, halt *atomic.Bool) (*Follower, error) {
	var s unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &s); err != nil {
		f.Close()
		return nil, fmt.Errorf("books: fstat: %w", err)
	}
	fl := &Follower{f: f, dev: s.Dev, ino: s.Ino}
	// One CPU: the follower reads beside the agent that serves.
	fl.rp = replayer{r: router{procs: 1, batch: followBatch}, halt: halt, batch: followBatch}
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

// Chunks is how many chunks the books read so far name.
func (fl *Follower) Chunks() int {
	if fl.rp.st == nil {
		return 0
	}
	return fl.rp.st.NumChunks()
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
		// again, the state holding nothing of the old mapping (a
		// snapshot's parts left by a halted read are kept mapped).
		if fl.mem != nil && len(fl.rp.parts) > 0 {
			fl.stale = append(fl.stale, fl.mem)
		} else if fl.mem != nil {
			_ = unix.Munmap(fl.mem)
		}
		fl.mem = nil
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
	for {
		if err := fl.rp.read(fl.mem, end, true); err != nil {
			return err
		}
		if fl.rp.st != nil {
			if err := fl.rp.settle(); err != nil {
				return err
			}
		}
		if !fl.rp.cut || fl.rp.halted {
			break
		}
	}
	if len(fl.rp.parts) == 0 {
		fl.unmapStale()
	}
	if fl.rp.st == nil && !fl.rp.halted {
		// A snapshot not yet whole (its parts are slices of the
		// mapping): read again from the start next time.
		fl.rp = replayer{r: router{procs: fl.rp.r.procs, batch: fl.rp.r.batch}, halt: fl.rp.halt, batch: fl.rp.batch}
	}
	return nil
}

// followBatch is how many records a Follower reads before it applies
// those it routed (a few ms of them): a halt waits at most for that.
const followBatch = 4096

// Halted reports whether the last read stopped at its halt, short of the
// committed records.
func (fl *Follower) Halted() bool { return fl.rp.halted }

func (fl *Follower) unmapStale() {
	for _, m := range fl.stale {
		_ = unix.Munmap(m)
	}
	fl.stale = nil
}

// ErrNotNext reports a memfd that is not the books the followed ones
// compacted into, or not one a Follower can tell is (Next).
var ErrNotNext = errors.New("books: not the compaction of the followed books")

// Next goes on to f, the books the followed ones compacted into: the
// followed memfd is read to its end (the writer went on in f, so nothing
// more comes there), and the Follower then stands in f where its records
// say it stood in the old log: after f's snapshot, at the records the
// compaction copied from the old log, past those it had read. Advance reads
// on from there. Nil: the Follower took f and dropped the old memfd.
// ErrNotNext: f is not the next memfd of the followed books (another
// generation, another log's compaction, a snapshot not yet read, books
// of an agent that does not write the origin), or its records are not the
// old log's; the Follower still reads its memfd and f is the caller's,
// to follow anew. Another error is Advance's, of the old memfd: the
// Follower is to be closed.
func (fl *Follower) Next(f *os.File) error {
	if fl.rp.st == nil || fl.mem == nil {
		return fmt.Errorf("%w: no state read yet", ErrNotNext)
	}
	var s unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &s); err != nil {
		return fmt.Errorf("%w: fstat: %v", ErrNotNext, err)
	}
	if s.Size < headerSize {
		return fmt.Errorf("%w: %d bytes, shorter than the header", ErrNotNext, s.Size)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(s.Size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("%w: map: %v", ErrNotNext, err)
	}
	taken := false
	defer func() {
		if !taken {
			_ = unix.Munmap(mem)
		}
	}()
	gen, end, err := checkHeader(mem)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrNotNext, err)
	}
	o, snapEnd, skipped, ok := readOrigin(mem)
	if !ok {
		return fmt.Errorf("%w: its header holds no origin, or a damaged one", ErrNotNext)
	}
	if gen != fl.gen+1 || o.ino != fl.ino {
		return fmt.Errorf("%w: generation %d of inode %d's log, following generation %d of inode %d", ErrNotNext, gen, o.ino, fl.gen, fl.ino)
	}
	if err := fl.Advance(); err != nil {
		return err
	}
	at := fl.rp.off
	switch {
	case o.off < headerSize || o.off > at:
		return fmt.Errorf("%w: its snapshot stands for the log up to %d, read to %d", ErrNotNext, o.off, at)
	case snapEnd <= headerSize || snapEnd > end || at-o.off > end-snapEnd:
		return fmt.Errorf("%w: a snapshot ending at %d and %d bytes of copied records in %d", ErrNotNext, snapEnd, at-o.off, end)
	case skipped > uint64(fl.rp.st.Skipped):
		return fmt.Errorf("%w: its snapshot skipped %d records, the follower %d", ErrNotNext, skipped, fl.rp.st.Skipped)
	}
	if !snapshotEndsAt(mem, snapEnd) {
		return fmt.Errorf("%w: no snapshot ends at %d", ErrNotNext, snapEnd)
	}
	next := snapEnd + at - o.off
	if !bytes.Equal(mem[snapEnd:next], fl.mem[o.off:at]) {
		return fmt.Errorf("%w: its records after the snapshot are not the followed log's", ErrNotNext)
	}
	taken = true
	_ = unix.Munmap(fl.mem)
	fl.f.Close()
	fl.f, fl.dev, fl.ino, fl.mem, fl.gen = f, s.Dev, s.Ino, mem, gen
	fl.rp.off = next
	fl.rp.st.snapEnd = snapEnd
	fl.rp.st.Skipped -= int(skipped)
	return nil
}

// snapshotEndsAt reports whether the books in mem begin with a snapshot in
// parts whose last part ends at end: their framing only (a few records of
// about 4 MiB each), each committed, not their checksums or contents,
// which a Follower going on past them does not read.
func snapshotEndsAt(mem []byte, end uint64) bool {
	off := uint64(headerSize)
	for off+8 <= end {
		n := uint64(binary.LittleEndian.Uint32(mem[off:]))
		rec := 8 + (n+3)&^3 + 4
		if n < 2 || n > uint64(maxRecord) || rec > end-off ||
			binary.LittleEndian.Uint32(mem[off+rec-4:]) != commitWord || mem[off+8] != recSnapshotPart {
			return false
		}
		if off += rec; mem[off-rec+9]&partLast != 0 {
			return off == end
		}
	}
	return false
}

// nextTo is Next of a descriptor of f's own (the caller keeps f).
func (fl *Follower) nextTo(f *os.File) error {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrNotNext, err)
	}
	g := os.NewFile(uintptr(fd), f.Name())
	if err := fl.Next(g); err != nil {
		g.Close()
		return err
	}
	return nil
}

// origin is where a compaction's snapshot comes from: the log of the memfd
// of inode ino, replayed up to off.
type origin struct{ ino, off uint64 }

// The origin's place in the header: inode, offset, where the snapshot
// ends and the records the replay skipped (u64 each), then their CRC-32C.
const (
	originAt   = 40
	originSize = 4*8 + 4
)

// write writes o in the header of mem, books whose snapshot ends at snapEnd
// and whose replay skipped skipped records; an unknown origin (ino 0)
// writes nothing.
func (o origin) write(mem []byte, snapEnd uint64, skipped int) {
	if o.ino == 0 {
		return
	}
	h := mem[originAt : originAt+originSize]
	binary.LittleEndian.PutUint64(h, o.ino)
	binary.LittleEndian.PutUint64(h[8:], o.off)
	binary.LittleEndian.PutUint64(h[16:], snapEnd)
	binary.LittleEndian.PutUint64(h[24:], uint64(skipped))
	binary.LittleEndian.PutUint32(h[32:], crc32.Checksum(h[:32], castagnoli))
}

// readOrigin reads what origin.write wrote in the header of mem; ok is
// false where it wrote nothing or the fields do not match their checksum.
func readOrigin(mem []byte) (o origin, snapEnd, skipped uint64, ok bool) {
	h := mem[originAt : originAt+originSize]
	o = origin{binary.LittleEndian.Uint64(h), binary.LittleEndian.Uint64(h[8:])}
	ok = o.ino != 0 && crc32.Checksum(h[:32], castagnoli) == binary.LittleEndian.Uint32(h[32:])
	return o, binary.LittleEndian.Uint64(h[16:]), binary.LittleEndian.Uint64(h[24:]), ok
}

// inode is f's inode number, 0 for none or where fstat fails.
func inode(f *os.File) uint64 {
	var s unix.Stat_t
	if f == nil || unix.Fstat(int(f.Fd()), &s) != nil {
		return 0
	}
	return s.Ino
}

// Load finishes the follow: f must be the memfd the Follower reads (a
// keeper handed it over once the writer was gone), or the compaction of it
// (Next: the writer compacted since the last read), whose records
// committed since the last read it replays. It returns what Load(f) would
// return, and closes the Follower either way. ErrNotFollowed: f is
// neither, and nothing more was read.
func (fl *Follower) Load(f *os.File) (*State, Info, error) {
	defer fl.Close()
	var info Info
	fl.rp.r.procs = runtime.GOMAXPROCS(0) // the agent waits for it now
	fl.rp.halt, fl.rp.batch, fl.rp.r.batch = nil, 0, 0
	if !fl.Follows(f) {
		if err := fl.nextTo(f); err != nil {
			return nil, info, fmt.Errorf("%w: %w", ErrNotFollowed, err)
		}
	}
	from := fl.rp.off
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
	fl.unmapStale()
	if fl.f != nil {
		fl.f.Close()
		fl.f = nil
	}
}
