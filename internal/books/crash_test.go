package books

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/wire"
)

// crashChild names the environment variable that makes the test binary
// the writer of TestKilledWhileCompactingAside.
const crashChild = "KVPOOL_BOOKS_CRASH_CHILD"

// TestKilledWhileCompactingAside kills a process that appends to books
// with SIGKILL at random moments, its log small enough that a compaction
// runs aside nearly all the time, and loads what a keeper (this process,
// handed every memfd over a socket, as the real one is) holds then: every
// change the writer was told was recorded is there, whatever the killed
// process was doing. Each round's writer goes on from the books the last
// one left.
func TestKilledWhileCompactingAside(t *testing.T) {
	if os.Getenv(crashChild) != "" {
		crashWriter(t)
		return
	}
	if testing.Short() {
		t.Skip("kills processes")
	}
	k := newFDKeeper(t)
	rng := rand.New(rand.NewPCG(7, 7))
	live := map[string]bool{} // requests offloaded and not removed, as told
	var compactions int
	for round := range 40 {
		sock, ack, kept, served := k.childFiles(t)
		c := exec.Command(os.Args[0], "-test.run=^TestKilledWhileCompactingAside$")
		c.Env = append(os.Environ(), crashChild+"="+strconv.Itoa(round))
		c.ExtraFiles = []*os.File{sock, ack.w, kept}
		c.Stderr = os.Stderr
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		sock.Close()
		ack.w.Close()
		if kept != nil {
			kept.Close()
		}
		// Killed once it has made 300 to 3,000 changes (a few
		// compactions), wherever it then is.
		acks := bufio.NewScanner(ack.r)
		n, last, kill := 0, "", 300+rng.IntN(2700)
		for acks.Scan() {
			if n++; n == kill {
				_ = c.Process.Signal(syscall.SIGKILL)
			}
			last = acks.Text()
			if rid, ok := strings.CutPrefix(last, "+"); ok {
				live[rid] = true
			} else {
				delete(live, strings.TrimPrefix(last, "-"))
			}
		}
		if n < kill {
			t.Fatalf("round %d: the writer stopped after %d changes", round, n)
		}
		// The change in flight when the writer was killed may be in the
		// books or not: the removal that follows a told offload, or the
		// next offload.
		inFlight := ""
		if rid, ok := strings.CutPrefix(last, "+"); ok {
			inFlight = crashRemoved(rid)
		}
		_ = c.Wait()
		ack.r.Close()
		<-served // a memfd handed over just before the kill is held or dropped by now
		f, gen := k.latest()
		st, info, err := Load(f)
		if err != nil {
			t.Fatalf("round %d: the kept books (generation %d) do not load: %v", round, gen, err)
		}
		held := map[string]bool{}
		for _, s := range st.Image().Sessions {
			for _, q := range s.Requests {
				if len(q.Streams) > 0 {
					held[q.Rid] = true
				}
			}
		}
		for rid := range live {
			if !held[rid] && rid != inFlight {
				t.Fatalf("round %d: %s was told offloaded, and the kept books (generation %d) lack it", round, rid, info.Gen)
			}
		}
		extra := 0
		for rid := range held {
			if !live[rid] {
				extra++
			}
		}
		if extra > 1 {
			t.Fatalf("round %d: the kept books (generation %d) hold %d requests told removed or never told offloaded", round, info.Gen, extra)
		}
		// The books are the truth about the change in flight.
		clear(live)
		for rid := range held {
			live[rid] = true
		}
		compactions = int(gen) - (round + 1) // each writer's Start made one generation
		t.Logf("round %d: killed after %d changes; the keeper holds generation %d, %d requests", round, n, gen, len(held))
	}
	if compactions < 40 {
		t.Fatalf("%d compactions in 40 rounds: the books hardly compacted", compactions)
	}
}

// crashWriter is the child of TestKilledWhileCompactingAside: it starts
// books on the ones it was handed (fresh ones in round 0), then offloads
// new requests one after the other, telling the parent each one's ID once
// its record is in, until it is killed.
func crashWriter(t *testing.T) {
	round, _ := strconv.Atoi(os.Getenv(crashChild))
	minLog = 16 << 10
	if round%2 == 1 {
		lockedCopy = 1 << 10 // the records appended meanwhile copied in rounds, outside the lock
	}
	store := &fdStore{sock: os.NewFile(3, "keeper")}
	ack := bufio.NewWriter(os.NewFile(4, "acks"))
	p := pool.New()
	var ps *pool.Session
	var b *Books
	var err error
	if round == 0 {
		b, err = Start(NewState(), 0, store, func(err error) { panic(err) })
		must(t, err)
		p.SetJournal(b)
		must(t, p.AddChunk(pool.Chunk{ID: "c0", Size: 1 << 30}))
		must(t, b.ChunkGen("c0", 1, 0))
		must(t, p.Grant("a", []string{"c0"}))
		ps, err = p.Open("a", pool.Spec{PageSize: 4096, DevicePages: 64})
		must(t, err)
		info := &server.OpenInfo{Allocation: "a", Instance: "writer", Regions: 1,
			Image: pool.SessionImage{ID: ps.ID(), Allocation: "a", Spec: ps.Spec(), Chunks: []string{"c0"}, PPC: ps.PagesPerChunk(), Capacity: ps.Capacity()}}
		must(t, b.Session(server.SessionOp{Session: ps.ID(), Op: wire.OpOpen, Open: info}))
	} else {
		st, info, err := Load(os.NewFile(5, "kept"))
		must(t, err)
		ss, err := p.Restore(st.Image())
		must(t, err)
		ps = ss[0]
		b, err = Start(st, info.Gen, store, func(err error) { panic(err) })
		must(t, err)
		p.SetJournal(b)
	}
	seq := uint32(0)
	tell := func(line string) {
		fmt.Fprintln(ack, line)
		must(t, ack.Flush())
	}
	// The last writer's requests go first, so the state stays small.
	for _, q := range p.Export().Sessions[0].Requests {
		if len(q.Streams) == 0 {
			continue
		}
		_, err := ps.RemoveRequest(q.Rid)
		must(t, err)
		seq++
		must(t, b.Session(server.SessionOp{Session: ps.ID(), Op: wire.OpRemoveRequest, Seq: seq, Rid: q.Rid, Reply: []byte(q.Rid)}))
		tell("-" + q.Rid)
	}
	for i := 0; ; i++ {
		rid := crashRid(round, i)
		m := pool.Meta{StoredLen: int64(i)}
		pages, err := ps.Offload(rid, "kv", []int32{int32(i % 64)}, m, nil)
		must(t, err)
		seq++
		must(t, b.Session(server.SessionOp{Session: ps.ID(), Op: wire.OpOffload, Seq: seq, Rid: rid, Label: "kv", Meta: m, Pages: pages, Reply: []byte(rid)}))
		tell("+" + rid)
		if old := crashRemoved(rid); old != "" {
			_, err := ps.RemoveRequest(old)
			must(t, err)
			seq++
			must(t, b.Session(server.SessionOp{Session: ps.ID(), Op: wire.OpRemoveRequest, Seq: seq, Rid: old, Reply: []byte(old)}))
			tell("-" + old)
		}
	}
}

// A writer keeps crashWindow of its requests: after offloading its i-th,
// it removes its (i-crashWindow)-th, so that the state stays small and the
// log compacts every few hundred changes.
const crashWindow = 100

func crashRid(round, i int) string { return fmt.Sprintf("r%02d-%06d", round, i) }

// crashRemoved is the request the writer removes after offloading rid
// ("" for none).
func crashRemoved(rid string) string {
	var round, i int
	if _, err := fmt.Sscanf(rid, "r%02d-%06d", &round, &i); err != nil || i < crashWindow {
		return ""
	}
	return crashRid(round, i-crashWindow)
}

// fdStore hands each books memfd to the parent over a socket and waits
// for its word that it holds it, as keeper.Client does.
type fdStore struct{ sock *os.File }

func (s *fdStore) PutBooks(gen uint64, f *os.File) error {
	var msg [8]byte
	binary.LittleEndian.PutUint64(msg[:], gen)
	if err := unix.Sendmsg(int(s.sock.Fd()), msg[:], unix.UnixRights(int(f.Fd())), nil, 0); err != nil {
		return err
	}
	var ok [1]byte
	if n, err := s.sock.Read(ok[:]); n != 1 || err != nil {
		return fmt.Errorf("the keeper did not take generation %d: %v", gen, err)
	}
	return nil
}

// fdKeeper holds the latest books memfd its writers hand it.
type fdKeeper struct {
	mu  sync.Mutex
	f   *os.File
	gen uint64
}

func newFDKeeper(t *testing.T) *fdKeeper {
	k := &fdKeeper{}
	t.Cleanup(func() {
		if k.f != nil {
			k.f.Close()
		}
	})
	return k
}

type pipe struct{ r, w *os.File }

// childFiles makes one writer's socket to the keeper (served until the
// writer is gone: served is closed then), its pipe of acknowledgements,
// and a copy of the kept memfd (nil before the first).
func (k *fdKeeper) childFiles(t *testing.T) (*os.File, pipe, *os.File, chan struct{}) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	must(t, err)
	mine, theirs := os.NewFile(uintptr(fds[0]), "keeper"), os.NewFile(uintptr(fds[1]), "writer")
	served := make(chan struct{})
	go func() {
		defer close(served)
		k.serve(mine)
	}()
	r, w, err := os.Pipe()
	must(t, err)
	k.mu.Lock()
	defer k.mu.Unlock()
	var kept *os.File
	if k.f != nil {
		kept, err = dupFile(k.f)
		must(t, err)
	}
	return theirs, pipe{r, w}, kept, served
}

func (k *fdKeeper) serve(sock *os.File) {
	defer sock.Close()
	msg, oob := make([]byte, 8), make([]byte, unix.CmsgSpace(4))
	for {
		n, oobn, _, _, err := unix.Recvmsg(int(sock.Fd()), msg, oob, 0)
		if err != nil || n != 8 {
			return
		}
		cms, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil || len(cms) != 1 {
			return
		}
		fds, err := unix.ParseUnixRights(&cms[0])
		if err != nil || len(fds) != 1 {
			return
		}
		k.mu.Lock()
		if k.f != nil {
			k.f.Close()
		}
		k.f, k.gen = os.NewFile(uintptr(fds[0]), "books"), binary.LittleEndian.Uint64(msg)
		k.mu.Unlock()
		if _, err := sock.Write([]byte{1}); err != nil {
			return
		}
	}
}

func (k *fdKeeper) latest() (*os.File, uint64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.f, k.gen
}
