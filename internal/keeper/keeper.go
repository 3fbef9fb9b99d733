// Package keeper is the agent's fd store: a small process that holds the
// pool's chunk memfds and the books memfd while the agent restarts, so that
// a crash, an OOM kill or an upgrade of the agent loses no memory and pins
// nothing twice.
//
// The keeper talks to the agent alone, over a Unix SOCK_SEQPACKET socket
// that only its own user may open (mode 0600, and the peer's uid is checked).
// It parses nothing from tenants. The protocol is small and versioned: one
// JSON message per packet, file descriptors by SCM_RIGHTS.
//
//	agent -> keeper                     keeper -> agent
//	hello {v, have}                     state {v, chunks, books, locks, chunkGen, same} [+ books fd]
//	                                    chunks {items} + fds   (batches; item.locked,
//	                                    item.pageSize)
//	                                    end  (no batches when same: the chunks
//	                                    are those of chunkGen have, which the
//	                                    agent took ahead with held)
//	put {items:[item]} + 1 fd           ok     (replaces an item of the same ID)
//	lock {items:[{id,gen}], off, len}   ok {items:[item]}  (item.locked: every page)
//	drop {items:[{id}]}                 ok
//	books {gen} + 1 fd                  ok     (replaces the books)
//	reset                               ok     (drops everything)
//	stat                                stat {stat}   (any connection)
//	held                                held {chunks, chunkGen} + chunks... + end
//	                                    (any connection: a spare agent takes
//	                                    the chunks' fds ahead of its turn)
//	follow                              follow {books, gen} [+ books fd, read-only]
//	                                    (any connection: a spare agent reads
//	                                    the books ahead of its turn)
//	anything wrong                      error {error}
//
// The keeper also holds the pool's lock, when the agent asks (lock, one
// step of at most MaxLockStep bytes at a time, from the start of the chunk):
// it maps the chunk read-only, locks the mapping on fault and faults the
// step in, so that the pages stay locked while no agent maps them. An
// agent that hands the lock over unmaps the chunk itself, and its death
// then unmaps nothing: the kernel takes about 0.07 s a GiB of 4 KiB pages
// to unmap a killed process's locked mapping, all of it before a new agent
// can start (docs/benchmarks.md). A keeper before this change answers no
// "locks" in its state, and the agent keeps the lock itself.
//
// One agent connection is served at a time; a second is refused until the
// first closes (its process died or stopped). When the keeper exits, every
// fd it held closes and the memory is freed once no process maps it.
package keeper

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/pkg/unixsock"
	"golang.org/x/sys/unix"
)

// Version is the keeper protocol version.
const Version = 1

const (
	// maxPacket bounds one message.
	maxPacket = 256 << 10
	// batch is how many chunk fds one "chunks" message carries.
	batch = 128
	// MaxItems bounds the chunks a keeper holds.
	MaxItems = 1 << 16
	maxIDLen = 256
	// maxRequestFDs is the most fds a request's control buffer takes;
	// every request carries at most one.
	maxRequestFDs = 4
	// MaxLockStep bounds one lock request (a 1 GiB huge page is one
	// step): the agent asks 64 MiB at a time of 4 KiB pages, about 6 ms
	// of the keeper's time on the dev VM (4 GiB in 0.4 s), far within
	// CallTimeout, and other requests pass between steps.
	MaxLockStep = 1 << 30
	// MaxConns bounds the keeper's connections, each with a maxPacket
	// buffer (4 MiB in all): at the bound the idlest connection that is
	// not the agent's is closed for the new one (evictOne), so idle
	// connections can neither grow the keeper past its memory limit nor
	// keep the agent out.
	MaxConns = 16
	// IdleTimeout closes a connection that is not the agent's after this
	// long without a request.
	IdleTimeout = 10 * time.Second
)

// heldWriteWait bounds a held answer's writing: a third of CallTimeout.
var heldWriteWait = time.Second

// Item names one held memfd.
type Item struct {
	ID    string `json:"id"`
	Gen   uint64 `json:"gen"`   // the agent's generation of the chunk: a fresh memfd per grant gets the next
	Size  int64  `json:"size"`  // bytes
	Seals int    `json:"seals"` // F_GET_SEALS when it was put
	// PageSize (from the keeper only) is the memfd's page size as the
	// keeper read it at the put (hostmem.Inspect): with Size and Seals,
	// what the memfd says of itself, which a sealed memfd (hostmem.Seals)
	// can no longer change, so that an agent adopting thousands of chunks
	// need not ask each memfd again. A keeper before it sends none.
	PageSize int64 `json:"pageSize,omitempty"`
	// Locked (from the keeper only): the keeper's mapping of the chunk
	// holds every page locked (lock).
	Locked bool `json:"locked,omitempty"`
}

// Stat is what the keeper holds.
type Stat struct {
	Chunks     int    `json:"chunks"`
	Bytes      int64  `json:"bytes"`
	Books      bool   `json:"books"`
	BooksBytes int64  `json:"booksBytes"`
	BooksGen   uint64 `json:"booksGen"`
	Agent      bool   `json:"agent"`              // an agent is connected
	Locked     int64  `json:"locked"`             // bytes of chunks the keeper holds locked (lock)
	ChunkGen   uint64 `json:"chunkGen,omitempty"` // the generation of the chunks held (held)
}

type message struct {
	V     int    `json:"v,omitempty"`
	Op    string `json:"op"`
	Items []Item `json:"items,omitempty"`
	Gen   uint64 `json:"gen,omitempty"`
	N     int    `json:"n,omitempty"`
	Books bool   `json:"books,omitempty"`
	Locks bool   `json:"locks,omitempty"` // state: the keeper takes lock requests
	// ChunkGen (state, held): the keeper's generation of what it holds of
	// the chunks; Have (hello): the generation of the chunks the agent
	// took ahead (held); Same (state): they are still those, and none
	// follow.
	ChunkGen uint64 `json:"chunkGen,omitempty"`
	Have     uint64 `json:"have,omitempty"`
	Same     bool   `json:"same,omitempty"`
	Off      int64  `json:"off,omitempty"` // lock: the step's first byte
	Len      int64  `json:"len,omitempty"` // lock: the step's bytes
	Stat     *Stat  `json:"stat,omitempty"`
	Error    string `json:"error,omitempty"`
}

// parseRequest decodes and checks one request and its fd count.
func parseRequest(pkt []byte, nfds int) (message, error) {
	var m message
	if err := json.Unmarshal(pkt, &m); err != nil {
		return m, fmt.Errorf("malformed request: %v", err)
	}
	want := 0
	switch m.Op {
	case "hello":
		if m.V != Version {
			return m, fmt.Errorf("agent speaks keeper protocol %d, this keeper speaks %d", m.V, Version)
		}
	case "put":
		want = 1
		if len(m.Items) != 1 {
			return m, fmt.Errorf("put names %d items, want 1", len(m.Items))
		}
		if err := checkItem(m.Items[0]); err != nil {
			return m, err
		}
	case "drop":
		if len(m.Items) != 1 || m.Items[0].ID == "" || len(m.Items[0].ID) > maxIDLen {
			return m, errors.New("drop names one item by a non-empty ID")
		}
	case "lock":
		if len(m.Items) != 1 || m.Items[0].ID == "" || len(m.Items[0].ID) > maxIDLen {
			return m, errors.New("lock names one item by a non-empty ID")
		}
		if m.Off < 0 || m.Len <= 0 || m.Len > MaxLockStep || m.Off > math.MaxInt64-m.Len {
			return m, fmt.Errorf("lock step of %d bytes at %d: want 1 to %d bytes at a non-negative offset", m.Len, m.Off, MaxLockStep)
		}
	case "books":
		want = 1
	case "reset", "stat", "follow", "held":
	default:
		return m, fmt.Errorf("unknown op %q", m.Op)
	}
	if nfds != want {
		return m, fmt.Errorf("%s carries %d fds, want %d", m.Op, nfds, want)
	}
	return m, nil
}

func checkItem(it Item) error {
	if it.ID == "" || len(it.ID) > maxIDLen || it.Size <= 0 {
		return fmt.Errorf("item %q of %d bytes: want a non-empty ID of at most %d bytes and a positive size", it.ID, it.Size, maxIDLen)
	}
	return nil
}

type held struct {
	Item
	f *os.File
	// mem is the keeper's mapping of the chunk once the agent asked it to
	// lock it (locked on fault), lockedTo how far from the start every
	// page is faulted in, and so locked.
	mem      []byte
	lockedTo int64
}

// release unmaps the chunk (when the keeper locked it) and closes its fd.
func (h held) release() {
	if h.mem != nil {
		_ = unix.Munmap(h.mem)
	}
	h.f.Close()
}

// Keeper holds memfds for an agent. Create it with New and run Serve.
type Keeper struct {
	log *slog.Logger

	mu       sync.Mutex
	chunks   map[string]held
	books    *os.File
	booksGen uint64
	agent    *net.UnixConn // the connected agent, nil when none
	// chunkGen changes with every change of the chunks held (one added,
	// replaced or dropped, or its lock completed): a random start, so that
	// no other keeper's generation is ever this one's.
	chunkGen uint64

	idle time.Duration // IdleTimeout, from idleTimeout when made
	// noLock: the keeper takes no lock requests (SetLock).
	noLock bool

	// evicted counts connections closed at MaxConns since evictLogged
	// (guarded by Serve's connection lock).
	evicted     int
	evictLogged time.Time
}

// New returns an empty keeper.
func New(log *slog.Logger) *Keeper {
	if log == nil {
		log = slog.Default()
	}
	return &Keeper{log: log, chunks: map[string]held{}, idle: idleTimeout, chunkGen: rand.Uint64() | 1}
}

// SetLock says whether the keeper takes lock requests (the default) or
// leaves the pool's lock with the agent, as a keeper before them did. An
// agent learns it at its hello.
func (k *Keeper) SetLock(on bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.noLock = !on
}

// Listen creates the keeper's socket at path, mode 0600 in a directory
// made 0700 when missing (unixsock.Listen), replacing a stale one; another
// live keeper on it is an error.
func Listen(path string) (*net.UnixListener, error) {
	l, err := unixsock.Listen(path, 0o600)
	if err != nil {
		return nil, fmt.Errorf("keeper: %w", err)
	}
	return l, nil
}

// Serve accepts connections until ctx ends, then closes l and every
// connection. The held fds stay with the Keeper until Close. A temporary
// accept failure (out of file descriptors, say) is logged and retried
// (unixsock.Acceptor).
func (k *Keeper) Serve(ctx context.Context, l *net.UnixListener) error {
	conns := map[*net.UnixConn]*conn{}
	var cmu sync.Mutex
	err := unixsock.Acceptor{
		Admit: func(uc *net.UnixConn) func() {
			if peer, err := unixsock.PeerOf(uc); err != nil || peer.UID != uint32(os.Getuid()) {
				k.log.Warn("keeper: refusing a connection from another user", "uid", peer.UID, "err", err)
				uc.Close()
				return nil
			}
			c := &conn{uc: uc}
			c.last.Store(time.Now().UnixNano())
			cmu.Lock()
			if len(conns) >= MaxConns {
				k.evictOne(conns)
			}
			conns[uc] = c
			cmu.Unlock()
			return func() {
				k.serveConn(c)
				cmu.Lock()
				delete(conns, uc)
				cmu.Unlock()
			}
		},
		Retry: func(err error, wait time.Duration) {
			k.log.Warn("keeper: accept failed; retrying", "err", err, "retryIn", wait)
		},
		Stop: func() {
			cmu.Lock()
			for uc := range conns {
				uc.Close()
			}
			cmu.Unlock()
		},
	}.Serve(ctx, l)
	if err != nil {
		return fmt.Errorf("keeper: %w", err)
	}
	return nil
}

// conn is one connection the keeper serves.
type conn struct {
	uc *net.UnixConn
	// last is when the connection was accepted or last sent a request
	// (Unix nanoseconds); busy is set while a request it sent is served.
	last atomic.Int64
	busy atomic.Bool
}

// quiet reports whether c is neither being served nor has a request
// waiting in its socket: closing it loses nobody's request.
func (c *conn) quiet() bool {
	if c.busy.Load() {
		return false
	}
	rc, err := c.uc.SyscallConn()
	if err != nil {
		return true
	}
	queued := 0
	if rc.Control(func(fd uintptr) { queued, err = unix.IoctlGetInt(int(fd), unix.SIOCINQ) }) != nil || err != nil {
		return true
	}
	return queued == 0
}

// evictOne closes one connection that is not the agent's, to make room at
// MaxConns: the one quiet longest (a connection that only idles), else, if
// every one has a request under way, the one whose last request is
// oldest. A connection that has just sent its hello or stat is not closed
// for a flood of idle ones. Its goroutine removes it from conns.
func (k *Keeper) evictOne(conns map[*net.UnixConn]*conn) {
	k.mu.Lock()
	agent := k.agent
	k.mu.Unlock()
	var victim *conn
	victimQuiet := false
	for uc, c := range conns {
		if uc == agent {
			continue
		}
		q := c.quiet()
		if victim == nil || q && !victimQuiet || q == victimQuiet && c.last.Load() < victim.last.Load() {
			victim, victimQuiet = c, q
		}
	}
	if victim == nil {
		return
	}
	k.evicted++
	if now := time.Now(); now.Sub(k.evictLogged) >= time.Second {
		k.log.Warn("keeper: at its connection limit; closing the idlest connections that are not the agent's",
			"limit", MaxConns, "closed", k.evicted)
		k.evictLogged, k.evicted = now, 0
	}
	victim.uc.Close()
	delete(conns, victim.uc)
}

// idleTimeout is IdleTimeout (a variable for tests).
var idleTimeout = IdleTimeout

// Close drops every held fd.
func (k *Keeper) Close() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.resetLocked()
}

func (k *Keeper) resetLocked() {
	k.chunkGen++
	for id, h := range k.chunks {
		h.release()
		delete(k.chunks, id)
	}
	if k.books != nil {
		k.books.Close()
		k.books, k.booksGen = nil, 0
	}
}

// Stat reports what the keeper holds.
func (k *Keeper) Stat() Stat {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.statLocked()
}

func (k *Keeper) statLocked() Stat {
	st := Stat{Chunks: len(k.chunks), Books: k.books != nil, BooksGen: k.booksGen, Agent: k.agent != nil, ChunkGen: k.chunkGen}
	for _, h := range k.chunks {
		st.Bytes += h.Size
		st.Locked += h.lockedTo
	}
	if k.books != nil {
		if fi, err := k.books.Stat(); err == nil {
			st.BooksBytes = fi.Size()
		}
	}
	return st
}

func (k *Keeper) serveConn(c *conn) {
	uc := c.uc
	defer uc.Close()
	isAgent := false
	defer func() {
		if isAgent {
			k.mu.Lock()
			k.agent = nil
			k.mu.Unlock()
			k.log.Info("keeper: agent disconnected")
		}
	}()
	buf := make([]byte, maxPacket)
	oob := make([]byte, unix.CmsgSpace(4*maxRequestFDs))
	for {
		deadline := time.Now().Add(k.idle)
		if isAgent {
			deadline = time.Time{} // the agent's connection lives as long as the agent
		}
		if uc.SetReadDeadline(deadline) != nil {
			return
		}
		c.busy.Store(false)
		n, oobn, flags, _, err := uc.ReadMsgUnix(buf, oob)
		if err != nil || n == 0 {
			return
		}
		c.busy.Store(true)
		c.last.Store(time.Now().UnixNano())
		files, ferr := unixsock.Files(oob[:oobn], "keeper-fd")
		switch {
		case ferr != nil:
		case flags&unix.MSG_CTRUNC != 0:
			ferr = fmt.Errorf("file descriptors truncated: the keeper takes at most %d per request", maxRequestFDs)
		case flags&unix.MSG_TRUNC != 0:
			ferr = fmt.Errorf("request longer than %d bytes", maxPacket)
		}
		m, perr := parseRequest(buf[:n], len(files))
		if ferr != nil || perr != nil {
			closeAll(files)
			if err := send(uc, message{Op: "error", Error: errors.Join(ferr, perr).Error()}, nil); err != nil {
				return
			}
			continue
		}
		if m.Op == "stat" {
			st := k.Stat()
			if send(uc, message{Op: "stat", Stat: &st}, nil) != nil {
				return
			}
			continue
		}
		if m.Op == "follow" {
			if k.sendBooks(uc) != nil {
				return
			}
			continue
		}
		if m.Op == "held" {
			// The chunks go out under the keeper's lock, a packet at a time
			// as the reader takes them: one that stops reading must not
			// hold the agent's requests up to their CallTimeout.
			if uc.SetWriteDeadline(time.Now().Add(heldWriteWait)) != nil || k.sendHeld(uc) != nil || uc.SetWriteDeadline(time.Time{}) != nil {
				return
			}
			continue
		}
		if !isAgent {
			if m.Op != "hello" {
				closeAll(files)
				if send(uc, message{Op: "error", Error: m.Op + " before hello"}, nil) != nil {
					return
				}
				continue
			}
			k.mu.Lock()
			busy := k.agent != nil
			if !busy {
				k.agent, isAgent = uc, true
			}
			k.mu.Unlock()
			if busy {
				if err := send(uc, message{Op: "error", Error: "another agent is connected to this keeper"}, nil); err != nil {
					k.log.Warn("keeper: refusing a second agent", "err", err)
				}
				return
			}
			if err := k.sendState(uc, m.Have); err != nil {
				k.log.Warn("keeper: sending state", "err", err)
				return
			}
			continue
		}
		if err := send(uc, k.apply(m, files), nil); err != nil {
			return
		}
	}
}

// apply runs one agent request and returns its answer. It takes ownership
// of files.
func (k *Keeper) apply(m message, files []*os.File) message {
	k.mu.Lock()
	defer k.mu.Unlock()
	switch m.Op {
	case "hello":
		closeAll(files)
		return message{Op: "error", Error: "hello sent twice"}
	case "put":
		it, f := m.Items[0], files[0]
		pageSize, err := checkFile(f, it)
		if err != nil {
			f.Close()
			return message{Op: "error", Error: err.Error()}
		}
		it.PageSize = pageSize
		old, had := k.chunks[it.ID]
		if !had && len(k.chunks) >= MaxItems {
			f.Close()
			return message{Op: "error", Error: fmt.Sprintf("the keeper holds its limit of %d chunks", MaxItems)}
		}
		if had {
			old.release()
		}
		it.Locked = false
		k.chunks[it.ID] = held{Item: it, f: f}
		k.chunkGen++
	case "lock":
		if k.noLock {
			return message{Op: "error", Error: "lock: this keeper leaves the pool's lock with the agent (agent keeper --lock=false)"}
		}
		return k.lockLocked(m)
	case "drop":
		if h, ok := k.chunks[m.Items[0].ID]; ok {
			h.release()
			delete(k.chunks, m.Items[0].ID)
			k.chunkGen++
		}
	case "books":
		f := files[0]
		if _, err := fileSize(f); err != nil {
			f.Close()
			return message{Op: "error", Error: err.Error()}
		}
		if k.books != nil {
			k.books.Close()
		}
		k.books, k.booksGen = f, m.Gen
	case "reset":
		k.resetLocked()
	}
	return message{Op: "ok"}
}

// lockLocked runs a lock request: the chunk of the named ID and
// generation is mapped (read-only, shared) and locked on fault, if it is
// not yet, and the step's pages faulted in, so locked. A step must start
// within what earlier steps locked, so that the locked part is always a
// prefix. A refused lock is an error that names the remedy, and leaves the
// chunk as it was.
func (k *Keeper) lockLocked(m message) message {
	want := m.Items[0]
	h, ok := k.chunks[want.ID]
	switch {
	case !ok || h.Gen != want.Gen:
		return message{Op: "error", Error: fmt.Sprintf("lock: chunk %s of generation %d is not held", want.ID, want.Gen)}
	case m.Off > h.lockedTo || m.Off+m.Len > h.Size:
		return message{Op: "error", Error: fmt.Sprintf("lock: step of %d bytes at %d of chunk %s (%d bytes, locked up to %d): a step starts within the locked part and ends within the chunk",
			m.Len, m.Off, want.ID, h.Size, h.lockedTo)}
	}
	if h.mem == nil {
		mem, err := unix.Mmap(int(h.f.Fd()), 0, int(h.Size), unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			return message{Op: "error", Error: fmt.Sprintf("lock: map chunk %s: %v", want.ID, err)}
		}
		if err := lockOnFault(mem); err != nil {
			_ = unix.Munmap(mem)
			return message{Op: "error", Error: fmt.Sprintf("lock: chunk %s: mlock: %v: the keeper needs CAP_IPC_LOCK or a memlock limit (RLIMIT_MEMLOCK) above the pool size", want.ID, err)}
		}
		h.mem = mem
	}
	if err := hostmem.FaultIn(h.mem[m.Off : m.Off+m.Len]); err != nil {
		k.chunks[want.ID] = h
		return message{Op: "error", Error: fmt.Sprintf("lock: chunk %s at %d: %v", want.ID, m.Off, err)}
	}
	was := h.locked()
	h.lockedTo = max(h.lockedTo, m.Off+m.Len)
	k.chunks[want.ID] = h
	if h.locked() != was {
		k.chunkGen++ // an agent adopts a locked chunk as the keeper's
	}
	it := h.Item
	it.Locked = h.locked()
	return message{Op: "ok", Items: []Item{it}}
}

// locked says that the keeper's mapping holds every page of the chunk.
func (h held) locked() bool { return h.mem != nil && h.lockedTo == h.Size }

// lockOnFault is hostmem.LockOnFault (a variable for tests: a lock
// refused).
var lockOnFault = hostmem.LockOnFault

// sendState sends the books and every held chunk to a new agent; none
// where have, the generation of the chunks it took ahead (held), is still
// the keeper's (same).
func (k *Keeper) sendState(uc *net.UnixConn, have uint64) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	same := have != 0 && have == k.chunkGen
	st := message{V: Version, Op: "state", N: len(k.chunks), Books: k.books != nil, Gen: k.booksGen, Locks: !k.noLock,
		ChunkGen: k.chunkGen, Same: same}
	var fds []int
	if k.books != nil {
		fds = []int{int(k.books.Fd())}
	}
	if err := send(uc, st, fds); err != nil {
		return err
	}
	if same {
		return send(uc, message{Op: "end"}, nil)
	}
	return k.sendChunksLocked(uc)
}

// sendHeld answers a held request: every chunk held, and their generation.
func (k *Keeper) sendHeld(uc *net.UnixConn) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if err := send(uc, message{Op: "held", N: len(k.chunks), ChunkGen: k.chunkGen}, nil); err != nil {
		return err
	}
	return k.sendChunksLocked(uc)
}

// sendChunksLocked sends every held chunk in batches, then the end.
func (k *Keeper) sendChunksLocked(uc *net.UnixConn) error {
	ids := make([]string, 0, len(k.chunks))
	for id := range k.chunks {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	var fds []int
	for len(ids) > 0 {
		n := min(batch, len(ids))
		m := message{Op: "chunks"}
		fds = fds[:0]
		for _, id := range ids[:n] {
			h := k.chunks[id]
			it := h.Item
			it.Locked = h.locked()
			m.Items = append(m.Items, it)
			fds = append(fds, int(h.f.Fd()))
		}
		if err := send(uc, m, fds); err != nil {
			return err
		}
		ids = ids[n:]
	}
	return send(uc, message{Op: "end"}, nil)
}

// sendBooks answers a follow: the books the keeper holds, opened again
// read-only (a follower reads them; only the agent writes them), and
// their generation.
func (k *Keeper) sendBooks(uc *net.UnixConn) error {
	k.mu.Lock()
	books, gen := k.books, k.booksGen
	var ro *os.File
	var err error
	if books != nil {
		ro, err = os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", books.Fd()), os.O_RDONLY|unix.O_CLOEXEC, 0)
	}
	k.mu.Unlock()
	if err != nil {
		return send(uc, message{Op: "error", Error: fmt.Sprintf("follow: open the books read-only: %v", err)}, nil)
	}
	if ro == nil {
		return send(uc, message{Op: "follow"}, nil)
	}
	defer ro.Close()
	return send(uc, message{Op: "follow", Books: true, Gen: gen}, []int{int(ro.Fd())})
}

// checkFile verifies that f is a memory file of the item's size and seals,
// and returns its page size (hostmem.Inspect).
func checkFile(f *os.File, it Item) (pageSize int64, err error) {
	info, err := hostmem.Inspect(f)
	if err != nil {
		return 0, fmt.Errorf("chunk %s: %w", it.ID, err)
	}
	if info.Size != it.Size {
		return 0, fmt.Errorf("chunk %s: the fd is %d bytes, the item says %d", it.ID, info.Size, it.Size)
	}
	if info.Seals != it.Seals {
		return 0, fmt.Errorf("chunk %s: seals %#x, the item says %#x", it.ID, info.Seals, it.Seals)
	}
	return info.PageSize, nil
}

func fileSize(f *os.File) (int64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0, fmt.Errorf("fstat: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return 0, errors.New("the fd is not a regular (memory) file")
	}
	return st.Size, nil
}

func send(uc *net.UnixConn, m message, fds []int) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	_, _, err = uc.WriteMsgUnix(b, oob, nil)
	return err
}

func closeAll(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}
