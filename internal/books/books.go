// Package books keeps the pool's state in a memfd journal that outlives the
// agent process: the keeper (internal/keeper) holds the memfd, the agent maps it
// shared and appends a record for every change before it answers the
// request that made it. Memory writes survive the death of the process that
// made them, so a SIGKILL at any instruction leaves every record whose
// commit word was stored; the next agent replays those and stops at the
// first record without one.
//
// The file:
//
//	0     8  magic "KVPBOOKS"
//	8     4  format version (little-endian)
//	12    4  reserved, zero
//	16    8  generation: each compaction writes a new memfd of the next
//	24    8  capacity of the log in bytes
//	32    8  last sign of life of the writer (Unix nanoseconds)
//	40   36  a compaction's origin, or zeros (written by agents since
//	         2026-12, ignored by older ones): the inode of the memfd
//	         whose log the snapshot stands for, the offset in that log up
//	         to which it does, where the snapshot ends in this file, and
//	         the records the replay up to there skipped (u64 each), then
//	         their CRC-32C; the records after the snapshot are that log's
//	         from the offset on, so a Follower of it goes on here without
//	         reading the snapshot (Follower.Next)
//	4096 ... records, each 4-byte aligned:
//	         u32 payload length, u32 CRC-32C of the payload, payload,
//	         zero padding to 4 bytes, u32 commit word (written last)
//
// The first records are a snapshot of the whole state, in parts of about
// 4 MiB (format version 2; version 1 wrote it as one record); the others
// are changes (pool table events, chunk generations, session ops). When
// the log is full the books compact: they replay the memfd and write the
// state as the snapshot of a fresh memfd, the keeper is handed that memfd
// (replacing the old one), and appending goes on there. The compaction
// runs beside the appends (compactAside): the full log grows while it
// replays and writes, and only the copy of the records appended meanwhile
// and the hand-over hold them up. The heap holds no copy of the state
// between compactions. A new agent goes on in the memfd it replayed
// (Start), after clearing what lies past the last committed record, so it
// never appends before a torn record's bytes; where that log has outgrown
// its room, it starts a fresh memfd instead: a copy of the records it
// replayed, or a compaction.
package books

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/wire"
)

// FormatVersion is the books layout this package writes. Version 2
// writes snapshots in parts (recSnapshotPart); version 1 books (one
// snapshot record, which could outgrow what replay accepts) are read too.
const FormatVersion = 2

// minFormatVersion is the oldest layout this package reads.
const minFormatVersion = 1

const (
	magic      = "KVPBOOKS"
	headerSize = 4096
	commitWord = 0xC0311EED
	// defaultMinLog is the smallest log capacity of a books memfd. The memfd is
	// sparse: only written pages take memory.
	defaultMinLog = 16 << 20
)

// maxRecord bounds one record's payload (a variable for tests). The
// snapshot is written in parts far below it, so no state outgrows it.
var maxRecord = 1 << 30

// ErrIncompatible reports books of another format version.
var ErrIncompatible = errors.New("books written by an incompatible agent version")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Store keeps the books memfd across agent restarts (a keeper.Client).
type Store interface {
	PutBooks(gen uint64, f *os.File) error
}

// Info describes loaded books.
type Info struct {
	Gen       uint64
	LastAlive time.Time // the last sign of life of the agent that wrote them
	// Replayed is the bytes of books this call replayed: all of them
	// (Load), or those committed since a Follower's last read.
	Replayed uint64
}

// Load replays the books in f and returns the state, the generation and
// the last sign of life of their writer.
// Records after the first one without its commit word are ignored (their
// writer died before committing them). A file of another format version
// is refused with ErrIncompatible.
func Load(f *os.File) (*State, Info, error) {
	var info Info
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, info, fmt.Errorf("books: fstat: %w", err)
	}
	if st.Size < headerSize {
		return nil, info, fmt.Errorf("%w: %d bytes, shorter than the header", ErrCorrupt, st.Size)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(st.Size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, info, fmt.Errorf("books: map: %w", err)
	}
	defer unix.Munmap(mem)
	// The replay reads every written page once: mapped in one call rather
	// than by a fault every few pages (each fault an exit to the host on a
	// paravirtualised VM). Before Linux 5.14 the call is refused and the
	// replay faults them in as it reads.
	if written := min(st.Blocks*512, st.Size); written > 0 {
		_ = unix.Madvise(mem[:written], unix.MADV_POPULATE_READ)
	}
	state, gen, end, err := replay(mem)
	if err != nil {
		return nil, info, err
	}
	state.keepSource(f, mem, end)
	info.Gen, info.Replayed = gen, end-headerSize
	info.LastAlive = lastAlive(mem)
	return state, info, nil
}

// keepSource makes Start copy the records of f (mapped at mem) up to end,
// which st was replayed from, instead of writing the state again
// (State.src): books of this format only.
func (st *State) keepSource(f *os.File, mem []byte, end uint64) {
	if binary.LittleEndian.Uint32(mem[8:]) != FormatVersion {
		return
	}
	if fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0); err == nil {
		st.src, st.srcEnd = os.NewFile(uintptr(fd), "kvpool-books-kept"), end
	}
}

// lastAlive is the last sign of life of the books' writer (zero: none).
func lastAlive(mem []byte) time.Time {
	if ns := atomic.LoadInt64((*int64)(unsafe.Pointer(&mem[32]))); ns > 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// offloadHints counts each session's offload records among the books'
// records from off (their framing alone, unchecked: the counts are hints),
// so that the replay sizes each session's request table once: grown a
// record at a time it was rehashed again and again, about a fifth of the
// restore of one session of 131,072 streams.
func offloadHints(mem []byte, off, end uint64) map[uint64]int {
	hints := map[uint64]int{}
	// A session's records mostly follow each other: they are counted
	// here and added to the map when another session's come.
	var last uint64
	run := 0
	for off+8 <= end {
		n := uint64(binary.LittleEndian.Uint32(mem[off:]))
		pad := (n + 3) &^ 3
		if n == 0 || n > uint64(maxRecord) || off+8+pad+4 > end {
			break
		}
		p := mem[off+8 : off+8+n]
		if len(p) > 2 && p[0] == recSession {
			if id, k := binary.Uvarint(p[1:]); k > 0 && 1+k < len(p) && wire.Op(p[1+k]) == wire.OpOffload {
				if id != last && run > 0 {
					hints[last] += run
					run = 0
				}
				last = id
				run++
			}
		}
		off += 8 + pad + 4
	}
	if run > 0 {
		hints[last] += run
	}
	return hints
}

// replay reads books from mem. It returns the state, the generation and
// the end of the last committed record.
func replay(mem []byte) (*State, uint64, uint64, error) {
	return replayOn(mem, runtime.GOMAXPROCS(0))
}

// replayOn is replay on up to procs goroutines at a time (sessions side
// by side, and their records decoded ahead).
func replayOn(mem []byte, procs int) (*State, uint64, uint64, error) {
	gen, end, err := checkHeader(mem)
	if err != nil {
		return nil, 0, 0, err
	}
	rp := replayer{r: router{procs: procs}, off: headerSize}
	rp.hints = offloadHints(mem, rp.off, end)
	if err := rp.read(mem, end, false); err != nil {
		return nil, 0, 0, err
	}
	st, err := rp.finish()
	if err != nil {
		return nil, 0, 0, err
	}
	return st, gen, rp.off, nil
}

// checkHeader checks the books header of mem and returns their generation
// and where their log ends (its capacity, or mem's end before it).
func checkHeader(mem []byte) (gen, end uint64, err error) {
	if len(mem) < headerSize || string(mem[:8]) != magic {
		return 0, 0, fmt.Errorf("%w: no books header", ErrCorrupt)
	}
	if v := binary.LittleEndian.Uint32(mem[8:]); v < minFormatVersion || v > FormatVersion {
		return 0, 0, fmt.Errorf("%w: the books are format version %d, this agent reads versions %d to %d", ErrIncompatible, v, minFormatVersion, FormatVersion)
	}
	gen = binary.LittleEndian.Uint64(mem[16:])
	capacity := atomic.LoadUint64((*uint64)(unsafe.Pointer(&mem[24])))
	end = uint64(len(mem))
	if capacity < end-headerSize {
		end = headerSize + capacity
	}
	return gen, end, nil
}

// replayer is one replay of books: the state so far and where its next
// record begins. A replay reads all the books at once (replayOn); a
// Follower reads them a piece at a time, as their writer appends.
type replayer struct {
	st        *State
	parts     [][]byte // of a snapshot in parts, until its last
	sessionAt []int    // the parts that begin a session (partSession)
	r         router
	off       uint64
	hints     map[uint64]int
	// halt, when set and true, stops a read at the next record (or batch
	// of a snapshot's requests), which halted then says. batch, when set,
	// stops a read after that many records, which cut then says (the
	// records a read routes are applied when it settles, which no halt
	// stops).
	halt   *atomic.Bool
	halted bool
	batch  int
	cut    bool
}

// haltEvery is how many records a read replays between looks at its halt
// (a few hundred µs of records).
const haltEvery = 256

// haltHook, when set (tests), is called at every look at a halt.
var haltHook func(halt *atomic.Bool)

// haltNow reports whether halt (nil: none) says to stop.
func haltNow(halt *atomic.Bool) bool {
	if halt == nil {
		return false
	}
	if haltHook != nil {
		haltHook(halt)
	}
	return halt.Load()
}

// read replays the committed records of mem from rp.off up to end, and
// stops at the first record without its commit word (rp.off is then
// where it begins). live: another process may be appending to mem
// meanwhile; each record's length is read again once its commit word is
// seen, so that a record that was rewritten in between (a new writer
// clearing a torn one) is read next time rather than from two writers'
// bytes.
func (rp *replayer) read(mem []byte, end uint64, live bool) error {
	// fail is read's error at the record at at: the first failure in
	// the books, a queued record's (router.apply) when one comes first.
	fail := func(at uint64, err error) error {
		if rp.st != nil {
			if qoff, qerr := rp.r.apply(rp.st); qerr != nil && qoff < at {
				return fmt.Errorf("record at %d: %w", qoff, qerr)
			}
		}
		return err
	}
	off := rp.off
	defer func() { rp.off = off }()
	rp.halted, rp.cut = false, false
	for i := 0; off+8 <= end; i++ {
		if i%haltEvery == 0 && haltNow(rp.halt) {
			rp.halted = true
			return nil
		}
		if rp.batch > 0 && i == rp.batch {
			rp.cut = true
			return nil
		}
		n := uint64(binary.LittleEndian.Uint32(mem[off:]))
		if n == 0 {
			break
		}
		pad := (n + 3) &^ 3
		if n > uint64(maxRecord) || off+8+pad+4 > end {
			break // a torn length: the record was never committed
		}
		if atomic.LoadUint32((*uint32)(unsafe.Pointer(&mem[off+8+pad]))) != commitWord {
			break
		}
		if live && uint64(atomic.LoadUint32((*uint32)(unsafe.Pointer(&mem[off])))) != n {
			break
		}
		payload := mem[off+8 : off+8+n]
		if crc32.Checksum(payload, castagnoli) != binary.LittleEndian.Uint32(mem[off+4:]) {
			return fail(off, fmt.Errorf("%w: checksum of the committed record at %d", ErrCorrupt, off))
		}
		var err error
		switch st := rp.st; {
		case st == nil && len(payload) >= 2 && payload[0] == recSnapshotPart && payload[1]&partLast == 0:
			if payload[1]&partSession != 0 {
				rp.sessionAt = append(rp.sessionAt, len(rp.parts))
			}
			rp.parts = append(rp.parts, payload[2:])
		case st == nil && len(rp.parts) > 0:
			if len(payload) < 2 || payload[0] != recSnapshotPart {
				return fmt.Errorf("%w: record at %d interrupts the snapshot's %d parts", ErrCorrupt, off, len(rp.parts))
			}
			sessions := len(rp.sessionAt)
			if payload[1]&partSession != 0 {
				rp.sessionAt = append(rp.sessionAt, len(rp.parts))
			}
			if rp.st, err = decodeSnapshot(append(rp.parts, payload[2:]), rp.sessionAt, rp.hints, rp.r.procs, rp.halt); err != nil {
				if errors.Is(err, errHalted) {
					// Read again from its last part next time.
					rp.sessionAt, rp.halted = rp.sessionAt[:sessions], true
					return nil
				}
				return fmt.Errorf("snapshot ending at %d: %w", off, err)
			}
			rp.parts, rp.sessionAt = nil, nil
			rp.st.snapEnd = off + 8 + pad + 4
		case st != nil && sideBySide && rp.r.route(st, mem, off, payload):
			st.aliasReplies = true // ownReplies, before mem goes
		default:
			if st != nil {
				st.aliasReplies = true
			}
			rp.r.inOrder()
			if rp.st, err = decodeRecord(st, payload); err != nil {
				return fail(off, fmt.Errorf("record at %d: %w", off, err))
			}
		}
		if rp.st != nil && rp.st.snapEnd == 0 {
			rp.st.snapEnd = off + 8 + pad + 4 // a snapshot in one record
		}
		if rp.st != nil && rp.hints != nil {
			rp.st.sizeFor(rp.hints)
			rp.hints = nil
		}
		off += 8 + pad + 4
	}
	return nil
}

// settle applies the records read so far that wait in the router's
// queues and copies what the state kept of the books' bytes: after it,
// the state holds nothing of mem.
func (rp *replayer) settle() error {
	if rp.st == nil {
		return nil
	}
	if qoff, err := rp.r.apply(rp.st); err != nil {
		return fmt.Errorf("record at %d: %w", qoff, err)
	}
	rp.st.ownReplies()
	return nil
}

// finish settles the replay and returns its state, which must be there.
func (rp *replayer) finish() (*State, error) {
	if rp.st == nil {
		return nil, fmt.Errorf("%w: no committed snapshot", ErrCorrupt)
	}
	if err := rp.settle(); err != nil {
		return nil, err
	}
	st := rp.st
	st.ridHints = nil
	// No list keeps a hole past the replay: what reads the state after
	// (the image, the fresh books' snapshot) may do so side by side.
	for _, s := range st.sessions {
		s.closeUpAll()
	}
	return st, nil
}

// Books appends to the books memfd. It implements pool.Journal and
// server.Journal. Its methods are safe for concurrent use.
//
// The books keep no copy of the state in memory: the memfd is the state
// (a snapshot and the changes after it). A compaction replays it and
// writes what it read as the snapshot of a fresh memfd; between
// compactions the agent's heap holds only the pool.
type Books struct {
	store Store
	fatal func(error)

	mu       sync.Mutex
	f        *os.File
	mem      []byte
	gen      uint64
	off      uint64
	end      uint64
	buf      enc
	broken   error
	lastSnap uint64 // bytes of the last snapshot written, its parts' records included
	skipped  int    // records the last replay skipped
	// unkept is why no keeper holds the current memfd (its PutBooks
	// failed: the keeper is lost), nil when one does; onUnkept is told.
	unkept   error
	onUnkept func(error)

	// aside is the compaction running beside the appends, nil when none
	// does; asideErr is why the last one failed, and makes the next one
	// run in line (as every compaction did before), whose failure is
	// fatal.
	aside    *compaction
	asideErr error

	// ready is where the log's pages stop being present (populateLocked);
	// noPopulate is set where the kernel cannot make them so.
	ready      uint64
	noPopulate bool
	// longestHold is the longest a compaction held the appends up.
	longestHold time.Duration
	// lastAppend is when the last record was appended, or the books
	// started, for CompactIfQuiet.
	lastAppend time.Time

	compactions atomic.Int64
	records     atomic.Int64
}

// compaction is a compaction running beside the appends: it replays the
// log up to from and writes the snapshot of a fresh memfd, then copies the
// records appended since (the last of them under the lock) and installs
// the memfd.
type compaction struct {
	gen  uint64 // the books' generation when it began: a later one (Rehand) makes it stale
	from uint64
	done chan struct{}
}

// asideHook, when set (tests), is called by a compaction aside after it
// wrote its snapshot, before it takes the lock to install it; an error
// fails the compaction. inLine makes every compaction run in line, as
// before compactions ran aside (tests and benchmarks compare the two).
var (
	asideHook func() error
	inLine    bool
)

// Start makes the books of st, which Load read from books of generation
// gen (or which is new), and returns them, recording every later change:
// they go on in the memfd Load read, which store must be what holds (the
// generation stays gen), or, when that cannot be, in a fresh memfd of
// generation gen+1 handed to store (startLocked). fatal is called (once)
// when a change can no longer be recorded: the process must stop, since
// what it answers would not survive it. The books do not keep st.
func Start(st *State, gen uint64, store Store, fatal func(error)) (*Books, error) {
	if fatal == nil {
		fatal = func(error) {}
	}
	b := &Books{store: store, fatal: fatal, gen: gen, lastAppend: time.Now()}
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.startLocked(st); err != nil {
		return nil, err
	}
	b.compactions.Store(0)
	if b.unkept != nil {
		return nil, fmt.Errorf("books: hand the books to the keeper: %w", b.unkept)
	}
	return b, nil
}

// OnUnkept makes f be told (under the books' lock: it must not call back)
// when a compaction could not hand its memfd to the store: the books go on
// in a memfd that only this process holds, which an agent restart would
// lose, until Rehand hands it to a store again.
func (b *Books) OnUnkept(f func(error)) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.onUnkept = f
}

// Unkept is why no store holds the current books (nil when one does).
func (b *Books) Unkept() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.unkept
}

// Rehand compacts the books into a fresh memfd and hands it to store,
// which keeps them from then on (a new keeper, after the old one was lost:
// the agent has handed it every chunk first).
func (b *Books) Rehand(store Store) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.broken != nil {
		return b.broken
	}
	b.store = store
	st, err := b.stateLocked()
	if err != nil {
		return err
	}
	if err := b.compactLocked(st, 0); err != nil {
		return err
	}
	return b.unkept
}

// state replays the books as they stand.
func (b *Books) stateLocked() (*State, error) {
	if b.mem == nil {
		return nil, errors.New("books: closed")
	}
	st, _, _, err := replay(b.mem[:b.end])
	return st, err
}

// startLocked makes the books' first memfd. When st came from Load in
// this format and changed since only by Forget (each then recorded as a
// chunk's removal, which replays as a Forget), the records Load read are
// kept: within the room a compaction of their snapshot leaves, the books
// go on in the very memfd the keeper holds (resumeLocked); past it they
// are copied into a fresh one. Otherwise st is compacted. Either way of
// keeping costs far less than a compaction, which decodes and encodes
// every stream: an agent serves sooner after a restart, and the log
// compacts when it fills, as always.
func (b *Books) startLocked(st *State) error {
	src := st.src
	st.src = nil
	if src == nil || st.dirty {
		if src != nil {
			src.Close()
		}
		return b.compactLocked(st, 0)
	}
	kept := st.srcEnd - headerSize
	var forgets enc
	for _, id := range st.forgot {
		forgets = appendEvent(forgets[:0], pool.Event{Kind: pool.EventRemoveChunk, Chunk: pool.Chunk{ID: id}})
		kept += recordSize(len(forgets))
	}
	snap := st.snapEnd - headerSize
	room := snap + max(uint64(minLog), snap)
	if kept+64 <= room && !noResume {
		if err := b.resumeLocked(src, st, room); err == nil {
			return nil
		}
		// A memfd that cannot be written again is copied.
	}
	defer src.Close()
	size := int(st.srcEnd)
	mem, err := unix.Mmap(int(src.Fd()), 0, size, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return b.compactLocked(st, 0)
	}
	defer unix.Munmap(mem)
	// A kept log past the room a compaction of its snapshot leaves (the
	// live log grew while a compaction ran beside the appends, and the
	// agent died first) is copied, with no room left: the agent's first
	// records start that compaction again, beside the appends, once it
	// serves. Compacted here, beside the pool's rebuild, it took a CPU
	// from the rebuild while the agent did not serve yet. Only a log past
	// twice the room is compacted here, so that neither the memfd nor the
	// next replay grows from restart to restart.
	if kept+64 > 2*room {
		// The snapshot then stands for the kept log up to its end,
		// unless Forget changed st since.
		var from origin
		if len(st.forgot) == 0 {
			from = origin{inode(src), st.srcEnd}
		}
		return b.compactFrom(st, 0, from)
	}
	lf, err := newLogFile(b.gen+1, roundPage(max(room, kept+64)))
	if err != nil {
		return err
	}
	// Written, not copied into the mapping: the kernel fills the fresh
	// memfd's pages as it makes them, where a copy took a page fault a
	// page (131,072 streams, 7 MiB of records: 30 ms, then 8.5).
	if _, err := lf.f.WriteAt(mem[headerSize:size], headerSize); err != nil {
		lf.close()
		return fmt.Errorf("books: write the kept records: %w", err)
	}
	lf.off = st.srcEnd
	// The copy's snapshot is the kept log's, its records the kept log's
	// after it: a Follower of the kept log goes on in the copy.
	origin{inode(src), st.snapEnd}.write(lf.mem, st.snapEnd, 0)
	for _, id := range st.forgot {
		b.buf = appendEvent(b.buf[:0], pool.Event{Kind: pool.EventRemoveChunk, Chunk: pool.Chunk{ID: id}})
		if err = lf.append(b.buf); err != nil {
			lf.close()
			return err
		}
	}
	b.install(lf, snap, st.Skipped)
	return nil
}

// noResume, set by tests, makes Start copy a kept log that it would
// otherwise go on in.
var noResume bool

// resumeLocked makes f, the books memfd Load read, the books again, the
// next record going after the last committed one (st.srcEnd), and records
// the chunks st forgot: no byte of the kept log is written anew, and the
// keeper, which holds f, is handed nothing. The log gets at least room
// bytes (room holds them all: the caller checked). What lies past the
// last committed record is cleared first: a record the killed agent tore
// may have left its payload there without its length, and a payload
// holds what tenants named, so bytes in it could read as a committed
// record once a record is written before them. On an error the memfd is
// as Load found it, but for bytes past its last committed record, and f
// is not closed.
func (b *Books) resumeLocked(f *os.File, st *State, room uint64) error {
	fd := int(f.Fd())
	var fs unix.Stat_t
	if err := unix.Fstat(fd, &fs); err != nil {
		return err
	}
	end := st.srcEnd
	size := uint64(max(fs.Size, 0))
	if size < end {
		return fmt.Errorf("books: the kept memfd is %d bytes, its records end at %d", size, end)
	}
	capacity := max(size-headerSize, roundPage(room))
	if headerSize+capacity > size {
		if err := f.Truncate(int64(headerSize + capacity)); err != nil {
			return err
		}
	}
	// The rest of end's page by hand, the pages after it punched out
	// (they read as zeros, and only those written take memory).
	if page := roundPage(end); page > end {
		if _, err := f.WriteAt(make([]byte, page-end), int64(end)); err != nil {
			return err
		}
	}
	if tail := headerSize + capacity - roundPage(end); roundPage(end) < headerSize+capacity {
		if err := unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(roundPage(end)), int64(tail)); err != nil {
			return fmt.Errorf("books: clear the kept memfd past its records: %w", err)
		}
	}
	mem, err := unix.Mmap(fd, 0, int(headerSize+capacity), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return err
	}
	binary.LittleEndian.PutUint64(mem[24:], capacity)
	b.f, b.mem, b.off, b.end = f, mem, end, headerSize+capacity
	b.lastSnap, b.skipped = st.snapEnd-headerSize, st.Skipped
	b.ready = 0
	b.populateLocked()
	b.touchLocked()
	for _, id := range st.forgot {
		b.buf = appendEvent(b.buf[:0], pool.Event{Kind: pool.EventRemoveChunk, Chunk: pool.Chunk{ID: id}})
		b.off = writeRecord(b.mem, b.off, b.buf)
	}
	return nil
}

// compactLocked writes st into a fresh memfd with room for extra more
// bytes of records, hands it to the store and switches to it. The
// snapshot goes in parts (snapWriter), each a record of at most about
// snapPart bytes, so whatever the state's size replay reads it back; the
// memfd grows as the parts need. A store that does not take the memfd
// (the keeper is lost) does not stop the books: they go on in it, unkept
// (OnUnkept), so that nothing recorded is lost while this process lives.
func (b *Books) compactLocked(st *State, extra int) error {
	return b.compactFrom(st, extra, origin{inode(b.f), b.off})
}

// compactFrom is compactLocked of st, replayed from the log from says.
func (b *Books) compactFrom(st *State, extra int, from origin) error {
	lf, snap, err := writeCompaction(st, b.gen+1, b.lastSnap, extra, &b.buf, from)
	if err != nil {
		return err
	}
	b.install(lf, snap, st.Skipped)
	b.asideErr = nil
	return nil
}

// writeCompaction writes st as the snapshot of a fresh memfd of generation
// gen, sized for the room rule with extra more bytes of records (lastSnap:
// the last snapshot's bytes, a guess at this one's), and returns it and
// the snapshot's bytes. buf lends the encoder its buffer (kept when small).
// from is the log st was replayed from, written in the header for a
// Follower of it (Follower.Next).
func writeCompaction(st *State, gen, lastSnap uint64, extra int, buf *enc, from origin) (*logFile, uint64, error) {
	lf, err := newLogFile(gen, roundPage(max(uint64(minLog), 2*lastSnap+uint64(extra)+64)))
	if err != nil {
		return nil, 0, err
	}
	w := newSnapWriter(*buf, lf.append)
	err = writeSnapshot(w, st)
	if cap(w.e) <= 2*snapPart {
		*buf = w.e[:0]
	}
	snap := lf.off - headerSize
	if err == nil {
		from.write(lf.mem, lf.off, st.Skipped)
		err = lf.fit(snap, extra)
	}
	if err != nil {
		lf.close()
		return nil, 0, err
	}
	return lf, snap, nil
}

// fit sizes the log after a snapshot of snap bytes and extra bytes of
// records: it has as much room again (at least minLog) before the next
// compaction, so a compaction, which costs about a snapshot, comes after
// about a snapshot's bytes of records.
func (l *logFile) fit(snap uint64, extra int) error {
	if final := roundPage(snap + max(uint64(minLog), snap) + uint64(extra) + 32); final != l.capacity {
		return l.resize(final)
	}
	return nil
}

// compactAsideLocked starts a compaction of the log as it stands beside
// the appends. It reads the log through a mapping of its own, so that the
// live one may grow (and move) meanwhile.
func (b *Books) compactAsideLocked() error {
	fd, err := unix.FcntlInt(b.f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("books: compaction: %w", err)
	}
	c := &compaction{gen: b.gen, from: b.off, done: make(chan struct{})}
	b.aside = c
	go b.compactAside(c, os.NewFile(uintptr(fd), "kvpool-books-compacting"), b.lastSnap)
	return nil
}

// compactAside is compaction c's goroutine: f is the live log's memfd
// (a descriptor of its own), lastSnap the last snapshot's bytes. It ends
// with the new memfd installed, or with nothing changed (a failure, kept
// in asideErr; the books closed or compacted in line meanwhile).
func (b *Books) compactAside(c *compaction, f *os.File, lastSnap uint64) {
	defer close(c.done)
	defer f.Close()
	lf, snap, skipped, err := writeAside(c, f, lastSnap)
	if err == nil && asideHook != nil {
		err = asideHook()
	}
	// The records appended since the compaction began go after the
	// snapshot: most of them copied outside the lock, in rounds while
	// the appends go on, the last few under it.
	copied := c.from
	for round := 0; ; round++ {
		b.mu.Lock()
		locked := time.Now()
		if b.mem == nil || b.gen != c.gen || b.broken != nil {
			// Closed, or compacted in line since (Rehand): of no use.
			b.aside = nil
			b.mu.Unlock()
			if lf != nil {
				lf.close()
			}
			return
		}
		upTo := b.off
		if err == nil && (upTo-copied <= lockedCopy || round == copyRounds) {
			err = appendLog(lf, snap, b.mem[copied:upTo])
			if err == nil {
				b.aside = nil
				old := b.swap(lf, snap, skipped)
				b.asideErr = nil
				b.longestHold = max(b.longestHold, time.Since(locked))
				b.mu.Unlock()
				if old != nil {
					old.close()
				}
				return
			}
		}
		if err != nil {
			b.aside, b.asideErr = nil, err
			b.mu.Unlock()
			if lf != nil {
				lf.close()
			}
			return
		}
		b.mu.Unlock()
		// Committed records do not change: they are read through a
		// mapping of this compaction's own (the live one may move).
		err = copyLog(lf, snap, f, copied, upTo)
		copied = upTo
	}
}

// asideProcs is how many goroutines a compaction aside replays on at a
// time: half the CPUs, one at least, so that the sessions it runs beside
// keep the rest (on both of two CPUs it slowed their calls).
func asideProcs() int { return max(1, runtime.GOMAXPROCS(0)/2) }

// lockedCopy is the most of the records appended during a compaction
// aside that it copies under the books' lock (the appends wait for it);
// more is copied outside first, in at most copyRounds rounds. A variable
// for tests.
var lockedCopy uint64 = 256 << 10

const copyRounds = 4

// writeAside replays the log in f up to c.from and writes its snapshot
// into a fresh memfd of the next generation.
func writeAside(c *compaction, f *os.File, lastSnap uint64) (*logFile, uint64, int, error) {
	mem, err := unix.Mmap(int(f.Fd()), 0, int(c.from), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("books: compaction: map: %w", err)
	}
	defer unix.Munmap(mem)
	_ = unix.Madvise(mem, unix.MADV_POPULATE_READ) // as Load does
	st, _, _, err := replayOn(mem, asideProcs())
	if err != nil {
		return nil, 0, 0, err
	}
	var buf enc
	lf, snap, err := writeCompaction(st, c.gen+1, lastSnap, 0, &buf, origin{inode(f), c.from})
	return lf, snap, st.Skipped, err
}

// copyLog appends the records of the log in f from off to end to lf.
func copyLog(lf *logFile, snap uint64, f *os.File, off, end uint64) error {
	at := off &^ 4095 // a mapping begins on a page
	mem, err := unix.Mmap(int(f.Fd()), int64(at), int(end-at), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("books: compaction: map the records appended meanwhile: %w", err)
	}
	defer unix.Munmap(mem)
	return appendLog(lf, snap, mem[off-at:])
}

// appendLog appends recs, records of the log copied whole, to lf, after
// its snapshot of snap bytes and the records copied before, and sizes lf
// for them all. They take their room from the log's usual room (the next
// compaction comes that much sooner) up to half of it, so that a memfd
// kept at a restart stays within the room rule startLocked copies by.
func appendLog(lf *logFile, snap uint64, recs []byte) error {
	copied := lf.off - headerSize - snap + uint64(len(recs))
	room := max(uint64(minLog), snap)
	if err := lf.fit(snap, int(max(copied, room/2)-room/2)); err != nil {
		return err
	}
	// Written, not copied into the mapping, as startLocked does.
	if _, err := lf.f.WriteAt(recs, int64(lf.off)); err != nil {
		return fmt.Errorf("books: compaction: copy the records appended meanwhile: %w", err)
	}
	lf.off += uint64(len(recs))
	return nil
}

// growLocked makes room for need more bytes in the live log while a
// compaction runs aside: a quarter more, or need if that is more. The
// memfd is sparse: only what is written takes memory.
func (b *Books) growLocked(need uint64) error {
	l := logFile{f: b.f, mem: b.mem, capacity: b.end - headerSize, off: b.off}
	if err := l.resize(roundPage(l.capacity + max(l.capacity/4, need))); err != nil {
		return err
	}
	b.mem, b.end = l.mem, headerSize+l.capacity
	return nil
}

// install hands lf, of snap bytes of snapshot, to the store and makes it
// the books' memfd.
func (b *Books) install(lf *logFile, snap uint64, skipped int) {
	if old := b.swap(lf, snap, skipped); old != nil {
		old.close()
	}
}

// swap is install, returning the memfd it replaced (nil: none) for the
// caller to close: a compaction aside closes it after it lets the appends
// go on (unmapping tens of MiB of log took milliseconds).
func (b *Books) swap(lf *logFile, snap uint64, skipped int) *logFile {
	unkept := b.store.PutBooks(b.gen+1, lf.f)
	var old *logFile
	if b.mem != nil {
		old = &logFile{f: b.f, mem: b.mem}
	}
	b.f, b.mem, b.gen, b.off, b.end = lf.f, lf.mem, b.gen+1, lf.off, headerSize+lf.capacity
	b.ready = 0
	b.populateLocked()
	b.lastSnap, b.skipped = snap, skipped
	b.unkept = unkept
	if unkept != nil && b.onUnkept != nil {
		b.onUnkept(unkept)
	}
	b.touchLocked()
	b.compactions.Add(1)
	return old
}

// logFile is a books memfd being written by a compaction: its mapping,
// capacity (of the log, after the header) and the end of what is written.
type logFile struct {
	f        *os.File
	mem      []byte
	capacity uint64
	off      uint64
}

// newLogFile makes a books memfd of generation gen with a log of
// capacity bytes, its header written (a sign of life included).
func newLogFile(gen, capacity uint64) (*logFile, error) {
	fd, err := unix.MemfdCreate("kvpool-books", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("books: memfd: %w", err)
	}
	f := os.NewFile(uintptr(fd), "kvpool-books")
	if err := f.Truncate(int64(headerSize + capacity)); err != nil {
		f.Close()
		return nil, fmt.Errorf("books: size %d: %w", headerSize+capacity, err)
	}
	mem, err := unix.Mmap(fd, 0, int(headerSize+capacity), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("books: map: %w", err)
	}
	copy(mem, magic)
	binary.LittleEndian.PutUint32(mem[8:], FormatVersion)
	binary.LittleEndian.PutUint64(mem[16:], gen)
	binary.LittleEndian.PutUint64(mem[24:], capacity)
	// A sign of life from the start: the memfd goes to the keeper before
	// the books take it, and an agent killed in between must not leave
	// the next one books that never lived.
	binary.LittleEndian.PutUint64(mem[32:], uint64(time.Now().UnixNano()))
	return &logFile{f: f, mem: mem, capacity: capacity, off: headerSize}, nil
}

// resize makes the log c bytes: the file and its mapping, and the
// header's capacity (a smaller size only cuts off what was never written).
func (l *logFile) resize(c uint64) error {
	if c > l.capacity {
		if err := l.f.Truncate(int64(headerSize + c)); err != nil {
			return fmt.Errorf("books: grow to %d: %w", headerSize+c, err)
		}
	}
	m, err := unix.Mremap(l.mem, int(headerSize+c), unix.MREMAP_MAYMOVE)
	if err != nil {
		return fmt.Errorf("books: resize to %d: %w", headerSize+c, err)
	}
	if c < l.capacity {
		if err := l.f.Truncate(int64(headerSize + c)); err != nil {
			return fmt.Errorf("books: shrink to %d: %w", headerSize+c, err)
		}
	}
	l.mem, l.capacity = m, c
	binary.LittleEndian.PutUint64(l.mem[24:], l.capacity)
	return nil
}

// append writes one record, growing the log (doubling) when it must.
func (l *logFile) append(payload []byte) error {
	need := recordSize(len(payload)) + 8 // and a zero length after it
	if l.off+need > headerSize+l.capacity {
		if err := l.resize(roundPage(max(2*l.capacity, l.off+need-headerSize))); err != nil {
			return err
		}
	}
	l.off = writeRecord(l.mem, l.off, payload)
	return nil
}

func (l *logFile) close() {
	unix.Munmap(l.mem)
	l.f.Close()
}

func roundPage(n uint64) uint64 { return (n + 4095) &^ 4095 }

// recordSize is the bytes a record of n payload bytes takes in the log.
func recordSize(n int) uint64 { return 8 + (uint64(n)+3)&^3 + 4 }

// writeRecord writes payload at off in mem, the commit word last, and
// returns the offset after it. The caller checked that it fits.
func writeRecord(mem []byte, off uint64, payload []byte) uint64 {
	n := uint64(len(payload))
	pad := (n + 3) &^ 3
	copy(mem[off+8:], payload)
	clear(mem[off+8+n : off+8+pad])
	binary.LittleEndian.PutUint32(mem[off:], uint32(n))
	binary.LittleEndian.PutUint32(mem[off+4:], crc32.Checksum(payload, castagnoli))
	atomic.StoreUint32((*uint32)(unsafe.Pointer(&mem[off+8+pad])), commitWord)
	return off + 8 + pad + 4
}

// appendLocked writes the record in b.buf, compacting first when it does
// not fit.
func (b *Books) appendLocked() error {
	if b.broken != nil {
		return b.broken
	}
	rec := b.buf
	if len(rec) > maxRecord {
		return fmt.Errorf("books: a record of %d bytes", len(rec))
	}
	need := recordSize(len(rec)) + 8 // and a zero length after it
	if b.off+need > b.end {
		if err := b.makeRoomLocked(need); err != nil {
			b.broken = err
			b.fatal(err)
			return err
		}
		rec = b.buf // an in-line compaction may have lent it out and left it
	}
	b.off = writeRecord(b.mem, b.off, rec)
	if b.off+ahead > b.ready {
		b.populateLocked()
	}
	b.records.Add(1)
	b.lastAppend = time.Now()
	b.touchAt(b.lastAppend)
	return nil
}

// CompactIfQuiet starts a compaction beside the appends when nothing was
// appended for quiet (nor since the books started) and the records after
// the snapshot take at least from bytes and a quarter of the snapshot. A
// restart replays a snapshot in about 60% of the time the same streams
// take as records (docs/benchmarks.md, "Where a restart's gap goes, and
// the books compacted while quiet"), so the books are compacted when the
// agent has nothing else to do rather than only when the log is full. It
// does nothing while a compaction runs, after one failed (the next runs
// in line, when the log fills), or while no store holds the books
// (Unkept). The channel it returns is closed when the compaction has
// ended (nil: none began).
func (b *Books) CompactIfQuiet(quiet time.Duration, from uint64) <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.mem == nil || b.broken != nil || b.aside != nil || b.asideErr != nil || b.unkept != nil || inLine {
		return nil
	}
	recs := b.off - headerSize - b.lastSnap
	if recs == 0 || recs < max(from, b.lastSnap/4) || time.Since(b.lastAppend) < quiet {
		return nil
	}
	if err := b.compactAsideLocked(); err != nil {
		b.asideErr = err
		return nil
	}
	return b.aside.done
}

// makeRoomLocked makes room for need bytes in a full log: it starts a
// compaction aside (or finds one running) and grows the live log until
// that compaction installs a fresh one. After a compaction aside failed,
// it compacts in line, as the books did before: the record in b.buf waits
// for it, and a failure there is fatal.
func (b *Books) makeRoomLocked(need uint64) error {
	if b.asideErr == nil && !inLine {
		if b.aside == nil {
			if err := b.compactAsideLocked(); err != nil {
				b.asideErr = err
				return b.makeRoomLocked(need)
			}
		}
		return b.growLocked(need)
	}
	t0 := time.Now()
	saved := append([]byte(nil), b.buf...)
	st, err := b.stateLocked()
	if err == nil {
		err = b.compactLocked(st, len(saved))
	}
	b.buf = append(b.buf[:0], saved...)
	b.longestHold = max(b.longestHold, time.Since(t0))
	return err
}

// ahead is how far past the end of the log its pages are made present
// before a record is written there: a record whose page was not took a
// page fault, the slowest append in sixty (about 12 µs on a
// paravirtualised VM, where populating four pages takes 10-13 µs in all:
// BenchmarkAppendWhileCompacting's p99 went from 12-13 µs to 5.3-5.9).
const ahead = 16 << 10

// populateLocked makes the log's pages present and writable from the end
// of what is written to ahead past it (MADV_POPULATE_WRITE: a sparse
// memfd's pages are allocated there rather than at the first write).
// Where the kernel cannot (before Linux 5.14), records fault their pages
// in as they did.
func (b *Books) populateLocked() {
	from := max(b.ready, b.off&^4095)
	to := min(roundPage(b.off+2*ahead), b.end&^4095)
	if b.noPopulate || from >= to {
		b.ready = max(b.ready, to)
		return
	}
	// A kernel without the call (EINVAL) turns it off; another failure
	// (ENOMEM under memory pressure) leaves those pages to fault in as
	// records come, and the next window is tried.
	if err := unix.Madvise(b.mem[from:to], unix.MADV_POPULATE_WRITE); err == unix.EINVAL {
		b.noPopulate = true
	}
	b.ready = to
}

func (b *Books) touchLocked() { b.touchAt(time.Now()) }

// touchAt stamps t as the writer's last sign of life.
func (b *Books) touchAt(t time.Time) {
	if b.mem != nil {
		atomic.StoreInt64((*int64)(unsafe.Pointer(&b.mem[32])), t.UnixNano())
	}
}

// Touch records a sign of life, so that the next agent can tell how long
// the pool went unserved. Call it periodically.
func (b *Books) Touch() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.touchLocked()
}

// Record implements pool.Journal.
func (b *Books) Record(ev pool.Event) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = appendEvent(b.buf[:0], ev)
	_ = b.appendLocked() // a failure is fatal (appendLocked)
}

// Session implements server.Journal.
func (b *Books) Session(op server.SessionOp) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = appendSessionOp(b.buf[:0], &op)
	return b.appendLocked()
}

// ChunkGen records that chunk id is now held by the memfd of generation
// gen with the given seals (a fresh memfd replaced it).
func (b *Books) ChunkGen(id string, gen uint64, seals int) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = appendChunkGen(b.buf[:0], id, gen, seals)
	return b.appendLocked()
}

// Stats describe the books.
type Stats struct {
	Gen         uint64
	LogBytes    uint64 // used, header included
	Capacity    uint64 // of the current memfd, header included
	Records     int64  // appended by this process
	Compactions int64  // since Start (which writes a snapshot only where it must, and counts none)
	Skipped     int    // records the last replay (the last compaction's) skipped
	Snapshot    uint64 // bytes of the last snapshot, its records' framing included
	// LongestHold is the longest a compaction held the appends (every
	// session's changes) up: all of it in line, its last copy and the
	// hand-over aside.
	LongestHold time.Duration
}

// Stats returns the books' figures.
func (b *Books) Stats() Stats {
	b.mu.Lock()
	defer b.mu.Unlock()
	return Stats{Gen: b.gen, LogBytes: b.off, Capacity: b.end, Records: b.records.Load(),
		Compactions: b.compactions.Load(), Skipped: b.skipped, Snapshot: b.lastSnap,
		LongestHold: b.longestHold}
}

// Check replays the books and compares them with the pool's export
// (tests, chaos harness).
func (b *Books) Check(img pool.Image) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	st, err := b.stateLocked()
	if err != nil {
		return err
	}
	return st.Check(img)
}

// Close unmaps the books; the store keeps the memfd. A compaction running
// aside is waited for and dropped.
func (b *Books) Close() {
	b.mu.Lock()
	if b.mem != nil {
		unix.Munmap(b.mem)
		b.f.Close()
		b.mem, b.f = nil, nil
	}
	if b.broken == nil {
		b.broken = errors.New("books: closed")
	}
	c := b.aside
	b.mu.Unlock()
	if c != nil {
		<-c.done
	}
}

// minLog is the smallest log capacity (a variable for tests).
var minLog = defaultMinLog

// Sizes tells how many of the bytes written in the books memfd f are its
// snapshot and how many the records after it, from the framing of the
// snapshot's parts alone (a few reads: a part is about 4 MiB). It is a
// hint, for sizing what a Load of them will allocate (the two kinds
// decode into different amounts of heap per byte), and checks nothing:
// books it cannot read are all records.
func Sizes(f *os.File) (snapshot, records int64) {
	var st unix.Stat_t
	if f == nil || unix.Fstat(int(f.Fd()), &st) != nil {
		return 0, 0
	}
	written := min(st.Blocks*512, st.Size)
	var hdr [10]byte // length, checksum, record type, a part's flags
	off := int64(headerSize)
	// Parts are about snapPart each, and a session begins one of its own:
	// books that claim many more are not books this agent wrote.
	for parts := 0; parts < maxSizesParts && off+int64(len(hdr)) <= st.Size; parts++ {
		if _, err := f.ReadAt(hdr[:], off); err != nil {
			break
		}
		n := int64(binary.LittleEndian.Uint32(hdr[:]))
		if n < 2 || n > int64(maxRecord) || (hdr[8] != recSnapshotPart && hdr[8] != recSnapshot) {
			break
		}
		off += int64(recordSize(int(n)))
		if hdr[8] == recSnapshot || hdr[9]&partLast != 0 {
			snapshot = off - headerSize
			break
		}
	}
	return snapshot, max(written-headerSize-snapshot, 0)
}

// maxSizesParts bounds the snapshot parts Sizes reads the framing of.
const maxSizesParts = 1 << 16
