package keeper

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/kvpool/kvpool/pkg/unixsock"
	"golang.org/x/sys/unix"
)

// ErrBusy reports that another agent is connected to the keeper.
var ErrBusy = errors.New("another agent is connected to this keeper")

// ErrLost reports a keeper connection that is gone: the keeper closed it
// (it exited or was killed), or did not answer within CallTimeout (it is
// stopped or stalled), or broke the protocol. Nothing more is kept through
// it; the agent must connect again (to a new keeper) and hand it what it
// holds.
var ErrLost = errors.New("keeper lost")

// CallTimeout bounds every request to the keeper, hello and its state
// transfer included: a keeper that does not answer within it is taken for
// lost (a stopped process never closes its socket).
var CallTimeout = 3 * time.Second

// Client is the agent's connection to its keeper. Its methods are safe for
// concurrent use; requests are serialized. A goroutine reads the
// connection all along, so that the keeper's death is seen at once
// (Lost), not at the next request.
type Client struct {
	mu  sync.Mutex
	uc  *net.UnixConn
	buf []byte
	oob []byte

	replies  chan reply
	lost     chan struct{}
	lostOnce sync.Once
	lostErr  error
}

type reply struct {
	m     message
	files []*os.File
}

// Held is one chunk the keeper handed back: the item and its memfd.
type Held struct {
	Item
	File *os.File
}

// State is what a keeper held when the agent connected.
type State struct {
	Books    *os.File // nil when the keeper holds no books
	BooksGen uint64
	Chunks   []Held
	// Locks: the keeper takes lock requests (Client.Lock); a keeper
	// before them does not, and the agent then keeps the lock itself.
	Locks bool
	// Ahead: the chunks are those the agent took ahead (ConnectWith),
	// none handed over at the hello.
	Ahead bool
}

// Close closes every file of s.
func (s *State) Close() {
	if s.Books != nil {
		s.Books.Close()
	}
	for _, h := range s.Chunks {
		h.File.Close()
	}
}

// Connect dials the keeper at path, says hello and receives everything it
// holds. What passes is retried until wait passes: an ErrBusy keeper (the
// previous agent's connection is still closing), a keeper not listening
// yet, and a connection the keeper closed before the hello was through (at
// its connection bound it closes the idlest that is not the agent's, and
// an agent whose hello is not through is not known to be one yet).
func Connect(path string, wait time.Duration) (*Client, *State, error) {
	return ConnectWith(path, wait, nil)
}

// ConnectWith is Connect for an agent that took the chunks ahead (TakeHeld,
// nil: none): where the keeper still holds those very chunks (their
// generation), it hands over none and the state's chunks are ahead's;
// otherwise they come as with Connect and ahead's are closed. It takes
// ahead.
func ConnectWith(path string, wait time.Duration, ahead *Ahead) (*Client, *State, error) {
	defer ahead.Close() // what the state did not take
	deadline := time.Now().Add(wait)
	for {
		c, st, err := connect(path, ahead)
		if err == nil || time.Now().After(deadline) || !retryable(err) {
			return c, st, err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Ahead is every chunk a keeper held, taken ahead of a hello (TakeHeld),
// and their generation.
type Ahead struct {
	Gen    uint64
	Chunks []Held
}

// Close closes the chunks' files (a nil Ahead has none); a closed Ahead
// holds no generation.
func (a *Ahead) Close() {
	if a == nil {
		return
	}
	for _, h := range a.Chunks {
		h.File.Close()
	}
	a.Chunks, a.Gen = nil, 0
}

// ErrNoHeld: the keeper is older than the held request.
var ErrNoHeld = errors.New("keeper: the keeper answers no held request (it is older than this agent)")

// TakeHeld asks the keeper at path for every chunk it holds, without
// claiming the agent's connection: a spare agent takes them while it
// waits, so that its hello at the turn hands over none of them where they
// did not change since (ConnectWith). The files hold the chunks' memory
// until they are closed: a taker closes them once the keeper's generation
// (Stat.ChunkGen) is no longer theirs.
func TakeHeld(path string) (*Ahead, error) {
	uc, err := net.DialUnix(unixsock.Network, nil, &net.UnixAddr{Name: path, Net: unixsock.Network})
	if err != nil {
		return nil, fmt.Errorf("keeper: dial %s: %w", path, err)
	}
	defer uc.Close()
	c := &Client{uc: uc, buf: make([]byte, maxPacket), oob: make([]byte, unix.CmsgSpace(4*batch+4))}
	if err := uc.SetDeadline(time.Now().Add(4 * CallTimeout)); err != nil {
		return nil, err
	}
	if err := send(uc, message{Op: "held"}, nil); err != nil {
		return nil, fmt.Errorf("keeper: held: %w", err)
	}
	m, files, err := c.recv()
	if err != nil {
		return nil, err
	}
	closeAll(files)
	if m.Op != "held" || len(files) != 0 {
		if m.Op == "error" && strings.Contains(m.Error, `unknown op "held"`) {
			return nil, ErrNoHeld
		}
		return nil, fmt.Errorf("keeper: held answered %s with %d fds: %s", m.Op, len(files), m.Error)
	}
	held, err := c.receiveChunks(make([]Held, 0, min(max(m.N, 0), MaxItems)))
	if err != nil {
		return nil, err
	}
	a := &Ahead{Gen: m.ChunkGen, Chunks: held}
	if len(held) != m.N || m.ChunkGen == 0 {
		a.Close()
		return nil, fmt.Errorf("keeper: held announced %d chunks of generation %d, sent %d", m.N, m.ChunkGen, len(held))
	}
	return a, nil
}

func retryable(err error) bool {
	for _, e := range []error{ErrBusy, unix.ECONNREFUSED, unix.ENOENT, unix.ECONNRESET, unix.EPIPE, io.EOF} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

func connect(path string, ahead *Ahead) (*Client, *State, error) {
	uc, err := net.DialUnix(unixsock.Network, nil, &net.UnixAddr{Name: path, Net: unixsock.Network})
	if err != nil {
		return nil, nil, fmt.Errorf("keeper: dial %s: %w", path, err)
	}
	c := &Client{uc: uc, buf: make([]byte, maxPacket), oob: make([]byte, unix.CmsgSpace(4*batch+4)),
		replies: make(chan reply, 1), lost: make(chan struct{})}
	// The state comes in batches; the whole of it within a few times
	// CallTimeout (65536 chunks are 512 batches).
	if err := uc.SetDeadline(time.Now().Add(4 * CallTimeout)); err != nil {
		uc.Close()
		return nil, nil, fmt.Errorf("keeper: %w", err)
	}
	st, err := c.hello(ahead)
	if err == nil {
		err = uc.SetDeadline(time.Time{})
	}
	if err != nil {
		uc.Close()
		if st != nil {
			st.Close()
		}
		return nil, nil, err
	}
	go c.readLoop()
	return c, st, nil
}

// readLoop reads the keeper's answers until the connection ends, and
// marks the client lost then.
func (c *Client) readLoop() {
	for {
		m, files, err := c.recv()
		if err != nil {
			c.lose(err)
			return
		}
		select {
		case c.replies <- reply{m: m, files: files}:
		default:
			closeAll(files)
			c.lose(fmt.Errorf("keeper: an answer to no request: %s", m.Op))
			return
		}
	}
}

// lose marks the client lost for err and closes the connection.
func (c *Client) lose(err error) {
	c.lostOnce.Do(func() {
		c.lostErr = fmt.Errorf("%w: %v", ErrLost, err)
		close(c.lost)
		c.uc.Close()
	})
}

// Lost is closed when the connection to the keeper is gone (Err says why).
func (c *Client) Lost() <-chan struct{} { return c.lost }

// Err is why the client is lost (wrapping ErrLost), nil while it is not.
func (c *Client) Err() error {
	select {
	case <-c.lost:
		return c.lostErr
	default:
		return nil
	}
}

func (c *Client) hello(ahead *Ahead) (*State, error) {
	hi := message{V: Version, Op: "hello"}
	if ahead != nil {
		hi.Have = ahead.Gen
	}
	if err := send(c.uc, hi, nil); err != nil {
		return nil, fmt.Errorf("keeper: hello: %w", err)
	}
	m, files, err := c.recv()
	if err != nil {
		return nil, err
	}
	if m.Op == "error" {
		closeAll(files)
		if m.Error == ErrBusy.Error() {
			return nil, ErrBusy
		}
		return nil, fmt.Errorf("keeper: %s", m.Error)
	}
	st := &State{BooksGen: m.Gen, Locks: m.Locks, Chunks: make([]Held, 0, min(max(m.N, 0), MaxItems))}
	if m.Op != "state" || m.V != Version || len(files) != btoi(m.Books) {
		closeAll(files)
		return nil, fmt.Errorf("keeper: unexpected answer to hello: %s v%d with %d fds (this agent speaks keeper protocol %d)", m.Op, m.V, len(files), Version)
	}
	if m.Books {
		st.Books = files[0]
	}
	if m.Same {
		// The chunks taken ahead, as they are: only the end follows.
		if ahead == nil || m.ChunkGen != ahead.Gen || len(ahead.Chunks) != m.N {
			st.Close()
			return nil, fmt.Errorf("keeper: the state says the %d chunks of generation %d are the agent's already, which holds none of them", m.N, m.ChunkGen)
		}
		extra, err := c.receiveChunks(nil)
		if err == nil && len(extra) > 0 {
			(&Ahead{Chunks: extra}).Close()
			err = fmt.Errorf("keeper: the state says the chunks are the agent's already, and sends %d", len(extra))
		}
		if err != nil {
			st.Close()
			return nil, err
		}
		st.Chunks, ahead.Chunks, st.Ahead = ahead.Chunks, nil, true
		return st, nil
	}
	// The chunks taken ahead are stale: closed before the keeper's come,
	// so that the turn holds the pool's fds once, not twice (a pool of
	// 16,384 chunks and a limit of 20,000 fds: the hand-over truncated).
	ahead.Close()
	held, err := c.receiveChunks(st.Chunks)
	if err != nil {
		st.Close()
		return nil, err
	}
	st.Chunks = held
	if len(st.Chunks) != m.N {
		st.Close()
		return nil, fmt.Errorf("keeper: announced %d chunks, sent %d", m.N, len(st.Chunks))
	}
	return st, nil
}

// receiveChunks appends to held the chunk batches that follow the state,
// up to its end. The packets are read one by one while lanes on every CPU
// decode them and make their files (decodeBatch), rather than after each:
// an item takes about 1 µs to decode and its os.NewFile 2 µs (an fcntl) on
// the dev VM (BenchmarkHandOver, 4,096 chunks: 3.4-3.8 µs a chunk in the
// receiving loop, 2.9-3.2 in lanes).
func (c *Client) receiveChunks(held []Held) ([]Held, error) {
	type batch struct {
		pkt  []byte
		fds  []int
		held []Held // nil until decoded (the fds then the batch's files)
		err  error
	}
	var batches []*batch
	work := make(chan *batch, 4)
	var wg sync.WaitGroup
	for range max(1, runtime.GOMAXPROCS(0)) {
		wg.Go(func() {
			for b := range work {
				b.held, b.err = decodeBatch(b.pkt, b.fds)
			}
		})
	}
	var err error
	for {
		pkt, fds, rerr := c.recvRaw()
		if rerr != nil {
			err = rerr
			break
		}
		if len(fds) == 0 { // the end, or what the keeper says instead
			var m message
			if err = json.Unmarshal(pkt, &m); err == nil && m.Op != "end" {
				err = fmt.Errorf("keeper: bad chunk batch: %s of %d items with no fds", m.Op, len(m.Items))
			}
			break
		}
		b := &batch{pkt: pkt, fds: fds}
		batches = append(batches, b)
		work <- b
	}
	close(work)
	wg.Wait()
	for _, b := range batches {
		if err == nil {
			err = b.err
		}
	}
	for _, b := range batches {
		switch {
		case err == nil:
			held = append(held, b.held...)
		case b.held == nil:
			closeFDs(b.fds)
		default:
			for _, h := range b.held {
				h.File.Close()
			}
		}
	}
	if err != nil {
		return nil, err
	}
	return held, nil
}

// decodeBatch decodes a chunk batch and makes its fds files; on an error
// the fds are left to the caller.
func decodeBatch(pkt []byte, fds []int) ([]Held, error) {
	var m message
	if err := json.Unmarshal(pkt, &m); err != nil {
		return nil, err
	}
	if m.Op != "chunks" || len(fds) != len(m.Items) {
		return nil, fmt.Errorf("keeper: bad chunk batch: %s of %d items with %d fds", m.Op, len(m.Items), len(fds))
	}
	held := make([]Held, len(fds))
	for i, it := range m.Items {
		held[i] = Held{Item: it, File: os.NewFile(uintptr(fds[i]), "keeper-fd")}
	}
	return held, nil
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd) // an fd never used: nothing to do about a failed close
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (c *Client) recv() (message, []*os.File, error) {
	pkt, fds, err := c.recvRaw()
	if err != nil {
		return message{}, nil, err
	}
	var m message
	if err := json.Unmarshal(pkt, &m); err != nil {
		closeFDs(fds)
		return message{}, nil, err
	}
	files := make([]*os.File, len(fds))
	for i, fd := range fds {
		files[i] = os.NewFile(uintptr(fd), "keeper-fd")
	}
	return m, files, nil
}

// recvRaw reads one packet: a copy of its bytes, and its fds.
func (c *Client) recvRaw() ([]byte, []int, error) {
	n, oobn, flags, _, err := c.uc.ReadMsgUnix(c.buf, c.oob)
	if err != nil {
		return nil, nil, fmt.Errorf("keeper: receive: %w", err)
	}
	var fds []int
	if oobn > 0 {
		if fds, err = unixsock.ParseRights(c.oob[:oobn]); err != nil {
			closeFDs(fds)
			return nil, nil, fmt.Errorf("keeper: receive: %w", err)
		}
	}
	switch {
	case flags&unix.MSG_CTRUNC != 0:
		err = errTruncated()
	case n == 0:
		err = errors.New("keeper: connection closed")
	}
	if err != nil {
		closeFDs(fds)
		return nil, nil, err
	}
	return bytes.Clone(c.buf[:n]), fds, nil
}

// errTruncated explains a packet whose fds did not all arrive: the buffer
// is sized for a batch, so it is the process's limit on open files, which
// the pool's chunks take one each.
func errTruncated() error {
	var lim unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &lim) != nil {
		return errors.New("keeper: file descriptors truncated")
	}
	return fmt.Errorf("keeper: file descriptors truncated at this process's limit of %d open files (RLIMIT_NOFILE): the agent holds one a chunk of the pool; raise the limit", lim.Cur)
}

// call sends m and waits for the keeper's answer, at most CallTimeout; a
// keeper that breaks the connection or does not answer in time is lost
// (ErrLost), and every later call fails at once.
func (c *Client) call(m message, fds []int) (message, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.Err(); err != nil {
		return message{}, fmt.Errorf("keeper %s: %w", m.Op, err)
	}
	if err := c.uc.SetWriteDeadline(time.Now().Add(CallTimeout)); err != nil {
		c.lose(err)
		return message{}, fmt.Errorf("keeper %s: %w", m.Op, c.Err())
	}
	if err := send(c.uc, m, fds); err != nil {
		c.lose(err)
		return message{}, fmt.Errorf("keeper %s: %w", m.Op, c.Err())
	}
	t := time.NewTimer(CallTimeout)
	defer t.Stop()
	select {
	case r := <-c.replies:
		closeAll(r.files)
		return r.m, nil
	case <-c.lost:
		return message{}, fmt.Errorf("keeper %s: %w", m.Op, c.Err())
	case <-t.C:
		c.lose(fmt.Errorf("no answer within %v: the keeper is stopped or stalled", CallTimeout))
		return message{}, fmt.Errorf("keeper %s: %w", m.Op, c.Err())
	}
}

// do is call for a request answered "ok".
func (c *Client) do(m message, fds []int) error {
	rep, err := c.call(m, fds)
	if err != nil {
		return err
	}
	if rep.Op != "ok" {
		return fmt.Errorf("keeper %s: %s", m.Op, rep.Error)
	}
	return nil
}

// Ping asks the keeper what it holds over the agent's connection: an
// answer within CallTimeout says it lives; a stopped keeper (SIGSTOP)
// makes the client lost.
func (c *Client) Ping() (Stat, error) {
	rep, err := c.call(message{Op: "stat"}, nil)
	if err != nil {
		return Stat{}, err
	}
	if rep.Op != "stat" || rep.Stat == nil {
		return Stat{}, fmt.Errorf("keeper stat: answered %s: %s", rep.Op, rep.Error)
	}
	return *rep.Stat, nil
}

// Put hands the keeper a chunk's memfd, replacing any it holds under the
// same ID. The agent keeps its own fd.
func (c *Client) Put(it Item, f *os.File) error {
	return c.do(message{Op: "put", Items: []Item{it}}, []int{int(f.Fd())})
}

// Lock makes the keeper lock n bytes of chunk id (of generation gen) from
// off in its own mapping of it, and reports whether the keeper now holds
// every page of the chunk locked. Steps of at most MaxLockStep bytes, each
// starting within what the earlier ones locked (from 0: a step again is
// harmless). An error leaves the chunk as it was; one that is not ErrLost
// says why the keeper cannot lock it (no CAP_IPC_LOCK, a chunk it does
// not hold).
func (c *Client) Lock(id string, gen uint64, off, n int64) (locked bool, err error) {
	rep, err := c.call(message{Op: "lock", Items: []Item{{ID: id, Gen: gen}}, Off: off, Len: n}, nil)
	if err != nil {
		return false, err
	}
	if rep.Op != "ok" || len(rep.Items) != 1 {
		return false, fmt.Errorf("keeper lock: %s", rep.Error)
	}
	return rep.Items[0].Locked, nil
}

// Drop makes the keeper close its fd of chunk id (a no-op when it has none).
func (c *Client) Drop(id string) error {
	return c.do(message{Op: "drop", Items: []Item{{ID: id}}}, nil)
}

// PutBooks hands the keeper the books memfd of generation gen, replacing
// the previous books.
func (c *Client) PutBooks(gen uint64, f *os.File) error {
	return c.do(message{Op: "books", Gen: gen}, []int{int(f.Fd())})
}

// Reset makes the keeper close everything it holds.
func (c *Client) Reset() error { return c.do(message{Op: "reset"}, nil) }

// Close closes the connection; the keeper keeps what it holds. The client
// is lost from then on.
func (c *Client) Close() error {
	err := c.uc.Close()
	c.lose(errors.New("closed by the agent"))
	return err
}

// Seals returns the seals of a memfd (F_GET_SEALS).
func Seals(f *os.File) (int, error) {
	return unix.FcntlInt(f.Fd(), unix.F_GET_SEALS, 0)
}

// Query asks the keeper at path what it holds, without claiming the agent's
// connection. A connection the keeper closes before it answers (at its
// connection bound) is dialled again, within CallTimeout in all.
func Query(path string) (Stat, error) {
	deadline := time.Now().Add(CallTimeout)
	for {
		st, err := query(path, deadline)
		if err == nil || time.Now().After(deadline) || !errors.Is(err, unix.ECONNRESET) && !errors.Is(err, unix.EPIPE) && !errors.Is(err, io.EOF) {
			return st, err
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// ErrNoFollow: the keeper is older than the follow request.
var ErrNoFollow = errors.New("keeper: the keeper answers no follow (it is older than this agent)")

// Follow asks the keeper at path for the books it holds, without claiming
// the agent's connection: a read-only file of the books memfd and its
// generation, or nil where it holds none. A keeper older than the follow
// request answers an error.
func Follow(path string) (*os.File, uint64, error) {
	uc, err := net.DialUnix(unixsock.Network, nil, &net.UnixAddr{Name: path, Net: unixsock.Network})
	if err != nil {
		return nil, 0, fmt.Errorf("keeper: dial %s: %w", path, err)
	}
	defer uc.Close()
	// The answer is one small message (a spare asks every 100 ms).
	c := &Client{uc: uc, buf: make([]byte, 1024), oob: make([]byte, unix.CmsgSpace(16))}
	if err := uc.SetDeadline(time.Now().Add(CallTimeout)); err != nil {
		return nil, 0, err
	}
	if err := send(uc, message{Op: "follow"}, nil); err != nil {
		return nil, 0, fmt.Errorf("keeper: follow: %w", err)
	}
	m, files, err := c.recv()
	if err != nil {
		return nil, 0, err
	}
	if m.Op != "follow" || len(files) != btoi(m.Books) {
		closeAll(files)
		if m.Op == "error" && strings.Contains(m.Error, `unknown op "follow"`) {
			return nil, 0, ErrNoFollow
		}
		return nil, 0, fmt.Errorf("keeper: follow answered %s with %d fds: %s", m.Op, len(files), m.Error)
	}
	if !m.Books {
		return nil, 0, nil
	}
	return files[0], m.Gen, nil
}

func query(path string, deadline time.Time) (Stat, error) {
	uc, err := net.DialUnix(unixsock.Network, nil, &net.UnixAddr{Name: path, Net: unixsock.Network})
	if err != nil {
		return Stat{}, fmt.Errorf("keeper: dial %s: %w", path, err)
	}
	defer uc.Close()
	c := &Client{uc: uc, buf: make([]byte, maxPacket), oob: make([]byte, unix.CmsgSpace(16))}
	if err := uc.SetDeadline(deadline); err != nil {
		return Stat{}, err
	}
	if err := send(uc, message{Op: "stat"}, nil); err != nil {
		return Stat{}, fmt.Errorf("keeper: stat: %w", err)
	}
	m, files, err := c.recv()
	closeAll(files)
	if err != nil {
		return Stat{}, err
	}
	if m.Op != "stat" || m.Stat == nil {
		return Stat{}, fmt.Errorf("keeper: stat answered %s: %s", m.Op, m.Error)
	}
	return *m.Stat, nil
}
