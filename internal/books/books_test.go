package books

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/wire"
)

// memStore keeps the latest books memfd, as a keeper would. It counts the
// memfds handed to it without a sign of life in their header (unstamped):
// an agent killed right after the hand-over leaves those to the next one.
type memStore struct {
	f         *os.File
	gen       uint64
	puts      int
	unstamped int
	fail      error
}

func (m *memStore) PutBooks(gen uint64, f *os.File) error {
	if m.fail != nil {
		return m.fail
	}
	var alive [8]byte
	if _, err := f.ReadAt(alive[:], 32); err != nil || binary.LittleEndian.Uint64(alive[:]) == 0 {
		m.unstamped++
	}
	nf, err := dupFile(f)
	if err != nil {
		return err
	}
	if m.f != nil {
		m.f.Close()
	}
	m.f, m.gen = nf, gen
	m.puts++
	return nil
}

func dupFile(f *os.File) (*os.File, error) {
	fd, err := unix.Dup(int(f.Fd()))
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), "books"), nil
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// rig is a pool journaled into books, with sessions driven as the server
// drives them: every change recorded with its answer.
type rig struct {
	t     testing.TB
	p     *pool.Pool
	b     *Books
	store *memStore
	ss    []*pool.Session
	seq   uint32
	rng   *rand.Rand
}

func newRig(t testing.TB, seed uint64) *rig {
	r := &rig{t: t, p: pool.New(), store: &memStore{}, rng: rand.New(rand.NewPCG(seed, 1))}
	b, err := Start(NewState(), 0, r.store, func(err error) { t.Errorf("fatal: %v", err) })
	must(t, err)
	r.b = b
	r.p.SetJournal(b)
	for i := range 6 {
		must(t, r.p.AddChunk(pool.Chunk{ID: fmt.Sprintf("c%d", i), GPU: i % 2, Size: 1 << 16}))
		must(t, b.ChunkGen(fmt.Sprintf("c%d", i), 1, 0))
	}
	must(t, r.p.Grant("a", []string{"c0", "c1", "c2", "c3"}))
	must(t, r.p.Grant("b", []string{"c4", "c5"}))
	r.open("a", 0, 100)
	r.open("a", 1, 0)
	r.open("b", 0, 0)
	return r
}

func (r *rig) open(alloc string, gpu, maxPages int) {
	ps, err := r.p.Open(alloc, pool.Spec{GPU: gpu, PageSize: 1024, DevicePages: 64, MaxPages: maxPages})
	must(r.t, err)
	info := &server.OpenInfo{Allocation: alloc, Instance: fmt.Sprintf("inst%d", ps.ID()),
		Regions: 2,
		Image:   pool.SessionImage{ID: ps.ID(), Allocation: alloc, Spec: ps.Spec(), PPC: ps.PagesPerChunk(), Capacity: ps.Capacity()}}
	for _, c := range ps.Chunks() {
		info.Image.Chunks = append(info.Image.Chunks, c.ID)
	}
	must(r.t, r.b.Session(server.SessionOp{Session: ps.ID(), Op: wire.OpOpen, Open: info}))
	r.ss = append(r.ss, ps)
}

// step runs one random op on a random session and journals it.
func (r *rig) step(i int) {
	s := r.ss[r.rng.IntN(len(r.ss))]
	rid, label := fmt.Sprintf("r%d", r.rng.IntN(30)), fmt.Sprintf("l%d", r.rng.IntN(3))
	r.seq++
	op := server.SessionOp{Session: s.ID(), Seq: r.seq, Rid: rid, Label: label, Reply: []byte{byte(i)}}
	if r.rng.IntN(4) == 0 {
		if t := s.Usage(); t.Pending > 0 {
			op.Fence = uint64(r.rng.IntN(1 << 20))
		}
	}
	if op.Fence != 0 {
		if err := s.Fence(op.Fence); err != nil {
			op.Fence = 0
		}
	}
	switch r.rng.IntN(5) {
	case 0, 1:
		n := 1 + r.rng.IntN(8)
		dev := make([]int32, n)
		for j, d := range r.rng.Perm(64)[:n] {
			dev[j] = int32(d)
		}
		m := pool.Meta{StoredLen: int64(i), Position: int64(n), Released: 1}
		pages, err := s.Offload(rid, label, dev, m, nil)
		if err == nil {
			op.Op, op.Pages, op.Meta = wire.OpOffload, pages, m
		}
	case 2:
		if n, err := s.NumPages(rid, label); err == nil && n > 0 {
			dev := make([]int32, n)
			for j := range dev {
				dev[j] = int32(j)
			}
			rl, err := s.Reload(rid, label, dev, nil)
			must(r.t, err)
			op.Op, op.Pages, op.Ticket = wire.OpReload, rl.Pages, rl.Ticket
		}
	case 3:
		if s.Discard(rid, label) == nil {
			op.Op = wire.OpDiscard
		}
	case 4:
		if n, _ := s.RemoveRequest(rid); n > 0 {
			op.Op = wire.OpRemoveRequest
		}
	}
	if op.Op == 0 && op.Fence == 0 {
		return
	}
	if op.Op == 0 {
		op.Reply = nil
	}
	must(r.t, r.b.Session(op))
}

// closeAndReopen closes the rig's second session and opens another on
// its allocation's chunks.
func (r *rig) closeAndReopen() {
	ps := r.ss[1]
	r.p.Close(ps)
	must(r.t, r.b.Session(server.SessionOp{Session: ps.ID(), Op: wire.OpClose}))
	r.ss = slices.Delete(r.ss, 1, 2)
	r.open("a", 1, 0)
}

// revokeB revokes allocation b, which closes its session.
func (r *rig) revokeB() {
	_, err := r.p.Revoke("b")
	must(r.t, err)
	must(r.t, r.p.Scrubbed("c4"))
	for j, ps := range r.ss {
		if ps.Closed() {
			r.ss = slices.Delete(r.ss, j, j+1)
			break
		}
	}
}

// grantedBooks is a pool journaled into fresh books, with one chunk of
// size bytes granted to allocation "a".
func grantedBooks(t testing.TB, chunk string, size int64) (*pool.Pool, *Books, *memStore) {
	t.Helper()
	p := pool.New()
	store := &memStore{}
	b, err := Start(NewState(), 0, store, func(err error) { t.Errorf("fatal: %v", err) })
	must(t, err)
	p.SetJournal(b)
	must(t, p.AddChunk(pool.Chunk{ID: chunk, Size: size}))
	must(t, b.ChunkGen(chunk, 1, 0))
	must(t, p.Grant("a", []string{chunk}))
	return p, b, store
}

func (r *rig) load() *State {
	r.b.settle()
	st, info, err := Load(r.store.f)
	must(r.t, err)
	if info.Gen != r.store.gen || time.Since(info.LastAlive) > time.Minute {
		r.t.Fatalf("loaded generation %d (stored %d), last alive %v", info.Gen, r.store.gen, info.LastAlive)
	}
	return st
}

func TestBooksFollowThePool(t *testing.T) {
	for seed := range uint64(4) {
		r := newRig(t, seed)
		for i := range 2000 {
			r.step(i)
			if i%500 == 499 {
				// Table changes in between: a revoke closes sessions.
				if i == 999 {
					_, err := r.p.Revoke("b")
					must(t, err)
					must(t, r.p.Scrubbed("c4"))
					r.ss = r.ss[:2]
				}
				must(t, r.b.Check(r.p.Export()))
			}
		}
		st := r.load()
		must(t, st.Check(r.p.Export()))
		if st.Skipped != 0 {
			t.Fatalf("replay skipped %d records", st.Skipped)
		}
		// The books rebuild the pool, and the server's side of each session.
		q := pool.New()
		ss, err := q.Restore(st.Image())
		must(t, err)
		if got, want := q.Export(), r.p.Export(); !reflect.DeepEqual(got, want) {
			t.Fatalf("restored pool differs:\n%+v\n%+v", got, want)
		}
		rs := st.Restored(ss)
		if len(rs) != 2 || rs[0].Instance != fmt.Sprintf("inst%d", ss[0].ID()) || rs[0].Regions != 2 {
			t.Fatalf("restored sessions %+v", rs)
		}
		r.b.Close()
	}
}

func TestTornRecordIsIgnored(t *testing.T) {
	old := minLog
	minLog = 64 << 10
	defer func() { minLog = old }()
	r := newRig(t, 42)
	for i := range 200 {
		r.step(i)
	}
	r.b.settle()
	before := snapshotMem(t, r.store.f)
	wantBefore, _, _, err := replay(before)
	must(t, err)
	// One more change that touches several pages.
	ps := r.ss[0]
	dev := []int32{60, 61, 62, 63}
	pages, err := ps.Offload("torn", "x", dev, pool.Meta{StoredLen: 4}, nil)
	must(t, err)
	r.seq++
	must(t, r.b.Session(server.SessionOp{Session: ps.ID(), Op: wire.OpOffload, Seq: r.seq, Rid: "torn", Label: "x", Pages: pages, Reply: []byte("reply")}))
	r.b.settle()
	after := snapshotMem(t, r.store.f)
	wantAfter, _, _, err := replay(after)
	must(t, err)
	if wantAfter.Streams() != wantBefore.Streams()+1 {
		t.Fatalf("streams %d then %d", wantBefore.Streams(), wantAfter.Streams())
	}
	lo, hi := -1, 0
	for i := headerSize; i < len(before); i++ {
		if before[i] != after[i] {
			if lo < 0 {
				lo = i
			}
			hi = i + 1
		}
	}
	// A death at any point of the write: every prefix of the new bytes,
	// and every subset that lacks the commit word.
	for cut := lo; cut < hi; cut++ {
		mem := append(append([]byte{}, after[:cut]...), before[cut:]...)
		st, _, _, err := replay(mem)
		must(t, err)
		if st.Streams() != wantBefore.Streams() {
			t.Fatalf("cut at %d: %d streams, want %d", cut, st.Streams(), wantBefore.Streams())
		}
	}
	// Committed but corrupted: refused, not silently replayed.
	bad := append([]byte{}, after...)
	bad[lo+10] ^= 0xff
	if _, _, _, err := replay(bad); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("corrupt record: %v", err)
	}
}

func snapshotMem(t testing.TB, f *os.File) []byte {
	fi, err := f.Stat()
	must(t, err)
	mem := make([]byte, fi.Size())
	_, err = f.ReadAt(mem, 0)
	must(t, err)
	return mem
}

func TestCompaction(t *testing.T) {
	old := minLog
	minLog = 4 << 10
	defer func() { minLog = old }()
	r := newRig(t, 3)
	for i := range 5000 {
		r.step(i)
	}
	r.b.settle()
	for i := 5000; r.b.Stats().Compactions < 3; i++ { // compactions run aside
		r.step(i)
		r.b.settle()
	}
	s := r.b.Stats()
	if s.Compactions < 3 || r.store.puts != int(s.Compactions)+1 || s.Gen != r.store.gen {
		t.Fatalf("stats %+v, %d puts", s, r.store.puts)
	}
	must(t, r.load().Check(r.p.Export()))
	// A store that fails (the keeper is lost) does not stop the books:
	// they go on in a memfd of their own, unkept, and say so; handed to a
	// store again they are whole.
	r.store.fail = errors.New("keeper gone")
	var told error
	r.b.OnUnkept(func(err error) { told = err })
	r.b.fatal = func(err error) { t.Errorf("fatal: %v", err) }
	for i := 0; r.b.Unkept() == nil && i < 100000; i++ {
		r.step(i)
	}
	r.b.settle()
	if told == nil || !errors.Is(r.b.Unkept(), r.store.fail) {
		t.Fatalf("a compaction the store refused: told %v, unkept %v", told, r.b.Unkept())
	}
	for i := range 200 {
		r.step(i)
	}
	fresh := &memStore{}
	must(t, r.b.Rehand(fresh))
	if r.b.Unkept() != nil || fresh.f == nil {
		t.Fatalf("after Rehand: unkept %v", r.b.Unkept())
	}
	st, _, err := Load(fresh.f)
	must(t, err)
	must(t, st.Check(r.p.Export()))
}

// TestHandedBooksCarryASignOfLife: every memfd the books hand to the
// keeper (at start, copying a kept log, compacting, handed again after a
// keeper loss) already holds its writer's sign of life. An agent killed
// between the hand-over and its first heartbeat left books without one,
// and the next agent could not tell the restart's gap (nor log it).
func TestHandedBooksCarryASignOfLife(t *testing.T) {
	old := minLog
	minLog = 4 << 10
	defer func() { minLog = old }()
	r := newRig(t, 5)
	for i := range 3000 {
		r.step(i)
	}
	r.b.settle()
	// Compactions run aside: on a busy machine few may have ended yet.
	for i := 3000; r.store.puts < 3; i++ {
		r.step(i)
		r.b.settle()
	}
	fresh := &memStore{}
	must(t, r.b.Rehand(fresh))
	st, info, err := Load(fresh.f)
	must(t, err)
	r.b.Close()
	// The start copies the kept log into a memfd it hands over, rather
	// than go on in the one the store holds (which hands nothing).
	noResume = true
	defer func() { noResume = false }()
	b, err := Start(st, info.Gen, fresh, nil)
	must(t, err)
	defer b.Close()
	if r.store.puts < 3 || fresh.puts != 2 {
		t.Fatalf("%d and %d hand-overs: the test did not compact", r.store.puts, fresh.puts)
	}
	if n := r.store.unstamped + fresh.unstamped; n != 0 {
		t.Fatalf("%d of %d books memfds were handed over with no sign of life", n, r.store.puts+fresh.puts)
	}
}

func TestLoadRefuses(t *testing.T) {
	r := newRig(t, 1)
	good := snapshotMem(t, r.store.f)
	cases := map[string]func([]byte){
		"other version": func(m []byte) { m[8] = 9 },
		"no magic":      func(m []byte) { m[0] = 'X' },
		"no snapshot":   func(m []byte) { clear(m[headerSize:]) },
	}
	for name, breakIt := range cases {
		mem := append([]byte{}, good...)
		breakIt(mem)
		_, _, _, err := replay(mem)
		if err == nil {
			t.Fatalf("%s: accepted", name)
		}
		if name == "other version" && (!errors.Is(err, ErrIncompatible) || !strings.Contains(err.Error(), "format version 9")) {
			t.Fatalf("%s: %v", name, err)
		}
	}
	if _, _, _, err := replay(good[:100]); err == nil {
		t.Fatal("short books accepted")
	}
}

func FuzzDecodeRecord(f *testing.F) {
	r := newRig(f, 5)
	for i := range 12 { // a small snapshot: minimizing a new input stays cheap
		r.step(i)
	}
	st, err := r.b.stateLocked()
	must(f, err)
	snap := appendSnapshot(nil, st)
	f.Add([]byte(snap), false)
	f.Add([]byte(appendEvent(nil, pool.Event{Kind: pool.EventGrant, Allocation: "x", Chunks: []string{"c0"}})), true)
	f.Add([]byte(appendChunkGen(nil, "c0", 3, 1)), true)
	f.Add([]byte(appendSessionOp(nil, &server.SessionOp{Session: 1, Op: wire.OpOffload, Rid: "r", Pages: []int32{1, 2}})), true)
	f.Add([]byte(appendSessionOp(nil, &server.SessionOp{Session: 9, Op: wire.OpOpen, Open: &server.OpenInfo{Allocation: "a"}})), true)
	f.Fuzz(func(t *testing.T, payload []byte, after bool) {
		var st *State
		if after {
			st = NewState()
		}
		got, err := decodeRecord(st, payload)
		if err == nil && got == nil {
			t.Fatal("no state and no error")
		}
		if err == nil && got != nil {
			// Whatever decodes must survive a snapshot round trip.
			again, err := decodeRecord(nil, appendSnapshot(nil, got))
			if err != nil {
				t.Fatalf("re-decoding a snapshot: %v", err)
			}
			if again.Streams() != got.Streams() || again.Sessions() != got.Sessions() {
				t.Fatal("snapshot round trip lost streams or sessions")
			}
		}
	})
}

// fuzzImages are the books fuzzers' seed books, each the used part of a
// memfd (header and records): a rig's first records, and then the same
// books compacted into a snapshot of the three sessions in small parts,
// each session beginning one (decoded apart), with records after it.
func fuzzImages(f *testing.F) (plain, compacted []byte) {
	oldLog, oldPart := minLog, snapPart
	minLog = 4 << 10
	defer func() { minLog, snapPart = oldLog, oldPart }()
	r := newRig(f, 8)
	defer r.b.Close()
	for i := range 6 {
		r.step(i)
	}
	plain = snapshotMem(f, r.store.f)[:r.b.Stats().LogBytes+8]
	snapPart = 64
	must(f, r.b.Rehand(r.store))
	snapPart = oldPart
	for i := range 4 {
		r.step(6 + i)
	}
	return plain, snapshotMem(f, r.store.f)[:r.b.Stats().LogBytes+8]
}

// fuzzMem lays a fuzzer's header fields and records out as the books
// file has them (the header's bytes past hdr zero).
func fuzzMem(hdr, records []byte) []byte {
	mem := make([]byte, headerSize+len(records))
	copy(mem, hdr[:min(len(hdr), headerSize)])
	copy(mem[headerSize:], records)
	return mem
}

// FuzzReplay feeds replay whole books images: it must refuse or replay,
// never panic or read out of bounds, and replay as it does in order. An image is its header fields and its
// records, laid out as the file has them; the fuzzer sees only those
// (not the 4 KiB of zeros between), so that it mutates what replay reads
// and minimizing a new input stays cheap (with the whole image as its
// input the fuzzer spent the fuzz time minimizing after a few inputs).
func FuzzReplay(f *testing.F) {
	img, compacted := fuzzImages(f)
	f.Add(img[:40], img[headerSize:])
	f.Add(img[:40], img[headerSize:headerSize+64])
	f.Add(img[:8], []byte{})
	f.Add(compacted[:40], compacted[headerSize:])
	f.Fuzz(func(t *testing.T, hdr, records []byte) {
		mem := fuzzMem(hdr, records)
		if len(records) == 0 {
			mem = mem[:min(len(hdr), headerSize)] // shorter than a header, too
		}
		st, _, _, err := replay(mem)
		if err == nil && st == nil {
			t.Fatal("no state and no error")
		}
		// Routed by session, the replay is the in-order one.
		sameReplay(t, mem)
	})
}

// A snapshot of any size reads back: it is written in parts of about
// snapPart bytes, each a record far within what replay accepts, a part
// may end inside a value (a long page list, a name), and the decoder reads
// across parts. Here the record bound is lowered to 256 KiB and the parts
// to 4 KiB, and the state's snapshot is many times the bound, with one
// stream's page list alone many parts long (issue 23: a snapshot over the
// 1 GiB record bound was written, then not read back: the second restart
// released the whole pool).
func TestSnapshotOfAnySizeReadsBack(t *testing.T) {
	oldRec, oldPart, oldLog := maxRecord, snapPart, minLog
	maxRecord, snapPart, minLog = 256<<10, 4<<10, 4<<10
	defer func() { maxRecord, snapPart, minLog = oldRec, oldPart, oldLog }()
	p, b, store := grantedBooks(t, "c0", 1<<30)
	ps, err := p.Open("a", pool.Spec{PageSize: 4096, DevicePages: 1 << 18})
	must(t, err)
	info := &server.OpenInfo{Allocation: "a", Instance: "inst", Regions: 1,
		Image: pool.SessionImage{ID: ps.ID(), Allocation: "a", Spec: ps.Spec(), Chunks: []string{"c0"}, PPC: ps.PagesPerChunk(), Capacity: ps.Capacity()}}
	must(t, b.Session(server.SessionOp{Session: ps.ID(), Op: wire.OpOpen, Open: info}))
	offload := func(rid, label string, n int) {
		dev := make([]int32, n)
		for i := range dev {
			dev[i] = int32(i)
		}
		pages, err := ps.Offload(rid, label, dev, pool.Meta{StoredLen: int64(n)}, nil)
		must(t, err)
		must(t, b.Session(server.SessionOp{Session: ps.ID(), Op: wire.OpOffload, Rid: rid, Label: label, Pages: pages, Meta: pool.Meta{StoredLen: int64(n)}}))
	}
	offload("long", "kv", 60000) // about 180 KB of page indices
	for i := range 3000 {
		offload(fmt.Sprintf("request-%04d-%s", i, strings.Repeat("n", 100)), strings.Repeat("l", 1000), 1)
	}
	b.settle()
	b.mu.Lock()
	st, err := b.stateLocked()
	must(t, err)
	must(t, b.compactLocked(st, 0)) // the snapshot of all that
	b.mu.Unlock()
	s := b.Stats()
	if s.Snapshot < 10*uint64(maxRecord) {
		t.Fatalf("snapshot of %d bytes, want many times the record bound %d", s.Snapshot, maxRecord)
	}
	// Every record is within a part and its framing: a name is the
	// longest value written whole.
	mem := snapshotMem(t, store.f)
	for off := uint64(headerSize); ; {
		n := uint64(binary.LittleEndian.Uint32(mem[off:]))
		if n == 0 {
			break
		}
		if n > uint64(snapPart+partSlack) {
			t.Fatalf("a record of %d bytes, over a part of %d", n, snapPart)
		}
		off += recordSize(int(n))
	}
	b.Close()
	got, _, err := Load(store.f)
	must(t, err)
	must(t, got.Check(p.Export()))
	if got.Streams() != 3001 {
		t.Fatalf("%d streams read back", got.Streams())
	}
	t.Logf("snapshot of %d bytes in %d-byte parts, record bound %d", s.Snapshot, snapPart, maxRecord)
}

// Books of format version 1 (the snapshot in one record) are read: an
// agent upgraded over an older one adopts its pool.
func TestReadsFormatVersion1(t *testing.T) {
	r := newRig(t, 11)
	for i := range 300 {
		r.step(i)
	}
	st, err := r.b.stateLocked()
	must(t, err)
	snap := appendSnapshot(nil, st)
	mem := make([]byte, headerSize+recordSize(len(snap))+8)
	copy(mem, magic)
	binary.LittleEndian.PutUint32(mem[8:], 1)
	binary.LittleEndian.PutUint64(mem[16:], 7)
	binary.LittleEndian.PutUint64(mem[24:], uint64(len(mem)-headerSize))
	writeRecord(mem, headerSize, snap)
	got, gen, _, err := replay(mem)
	must(t, err)
	if gen != 7 {
		t.Fatalf("generation %d", gen)
	}
	must(t, got.Check(r.p.Export()))
}

// TestStartKeepsTheKeptLog: books started from Load keep the records they
// read (the log's bytes, not a new snapshot), without the torn record at
// its end, and record the chunks forgotten in between as removals: in the
// very memfd the store holds, handed nothing and of the same generation,
// or (noResume) as a copy in a fresh memfd handed to the store. A change
// Start cannot record that way (SetGen) makes it compact instead. Either
// way the next Load reads what Start was given.
func TestStartKeepsTheKeptLog(t *testing.T) {
	for _, tc := range []struct {
		name                   string
		forget, setGen, resume bool
	}{
		{"as kept", false, false, true}, {"a chunk forgotten", true, false, true},
		{"copied", false, false, false}, {"copied, a chunk forgotten", true, false, false},
		{"a generation set", false, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			noResume = !tc.resume
			defer func() { noResume = false }()
			r := newRig(t, 7)
			for i := range 300 {
				r.step(i)
			}
			kept := snapshotMem(t, r.store.f)
			// A torn record after the last committed one: its length and
			// payload, no commit word.
			_, _, end, err := replay(kept)
			must(t, err)
			binary.LittleEndian.PutUint32(r.b.mem[end:], 16)
			copy(r.b.mem[end+8:], "torn record body")
			r.b.Close()
			keptFile := r.store.f
			puts := r.store.puts
			st, info, err := Load(keptFile)
			must(t, err)
			if tc.forget {
				st.Forget("c4") // revokes b and closes its session
			}
			if tc.setGen {
				st.SetGen("c0", 9, 0)
			}
			want := st.Image()
			b, err := Start(st, info.Gen, r.store, func(err error) { t.Errorf("fatal: %v", err) })
			must(t, err)
			defer b.Close()
			kept1 := !tc.setGen
			if got := string(b.mem[headerSize:end]) == string(kept[headerSize:end]); got != kept1 {
				t.Fatalf("the books hold the kept log's bytes: %v, want %v", got, kept1)
			}
			resumed := tc.resume && !tc.setGen
			if got := r.store.f == keptFile && r.store.puts == puts; got != resumed {
				t.Fatalf("the store holds the kept memfd, handed nothing: %v, want %v (%d puts after %d)", got, resumed, r.store.puts, puts)
			}
			if !bytes.Equal(b.mem[b.off:], make([]byte, len(b.mem)-int(b.off))) {
				t.Fatalf("the books' log holds bytes past its last record (at %d)", b.off)
			}
			st2, info2, err := Load(r.store.f)
			must(t, err)
			if wantGen := info.Gen + uint64(btoi(!resumed)); info2.Gen != wantGen {
				t.Fatalf("generation %d after %d, want %d", info2.Gen, info.Gen, wantGen)
			}
			must(t, st2.Check(want))
			if _, ok := st2.Chunk("c4"); ok == tc.forget {
				t.Fatalf("chunk c4 in the books: %v, forgotten %v", ok, tc.forget)
			}
			if len(want.Sessions) != 3-btoi(tc.forget) {
				t.Fatalf("%d sessions, want %d", len(want.Sessions), 3-btoi(tc.forget))
			}
		})
	}
}

// TestResumedBooksClearATornTail: the agent a restart replaced may have
// died writing a record's payload, which goes in before its length, so
// the bytes past the last committed record can hold anything a tenant
// named, a well-formed committed record included. The next agent's books
// go on in that memfd: a record they write must not end right before such
// bytes, or the replay after it would take them for a record.
func TestResumedBooksClearATornTail(t *testing.T) {
	r := newRig(t, 11)
	for i := range 200 {
		r.step(i)
	}
	_, _, end, err := replay(r.b.mem)
	must(t, err)
	// The next agent forgets c4 (its first record, at end); forged after
	// it, where its second would go, a removal of c0, framed, checksummed
	// and committed, and another a few pages further on.
	first := recordSize(len(appendEvent(nil, pool.Event{Kind: pool.EventRemoveChunk, Chunk: pool.Chunk{ID: "c4"}})))
	forged := appendEvent(nil, pool.Event{Kind: pool.EventRemoveChunk, Chunk: pool.Chunk{ID: "c0"}})
	writeRecord(r.b.mem, end+first, forged)
	far := roundPage(end) + 5*4096
	writeRecord(r.b.mem, far, forged)
	r.b.Close()
	st, info, err := Load(r.store.f)
	must(t, err)
	st.Forget("c4")
	b, err := Start(st, info.Gen, r.store, func(err error) { t.Errorf("fatal: %v", err) })
	must(t, err)
	defer b.Close()
	if r.store.puts != 1 || b.off != end+first {
		t.Fatalf("%d hand-overs, the log ends at %d: want the books gone on in the kept memfd, to %d", r.store.puts, b.off, end+first)
	}
	// Killed now.
	st2, _, err := Load(r.store.f)
	must(t, err)
	if _, ok := st2.Chunk("c0"); !ok {
		t.Fatal("the replay took a torn record's bytes for a record: chunk c0 was removed")
	}
	if _, ok := st2.Chunk("c4"); ok {
		t.Fatal("chunk c4 is in the books after it was forgotten")
	}
	// And nothing is left further on for a later record to end before.
	if !bytes.Equal(b.mem[far:far+first], make([]byte, first)) {
		t.Fatal("the forged record a few pages past the log's end is still there")
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestStartCompactsALongKeptLog: a kept log longer than the room a
// compaction of its snapshot leaves (here: written with a larger minimum
// log) is compacted at start, not copied, so neither the memfd nor the
// next replay grows from restart to restart; a copied one keeps that room.
func TestStartCompactsALongKeptLog(t *testing.T) {
	r := newRig(t, 9)
	for i := range 6000 {
		r.step(i)
	}
	r.b.Close()
	old := minLog
	minLog = 16 << 10
	defer func() { minLog = old }()
	st, info, err := Load(r.store.f)
	must(t, err)
	if st.srcEnd-headerSize <= uint64(minLog) {
		t.Fatalf("the kept log is %d bytes, want more than %d", st.srcEnd-headerSize, minLog)
	}
	want := st.Image()
	b, err := Start(st, info.Gen, r.store, nil)
	must(t, err)
	defer b.Close()
	s := b.Stats()
	if s.LogBytes-headerSize != s.Snapshot || s.Capacity-headerSize < s.Snapshot+uint64(minLog) {
		t.Fatalf("started with %d bytes of log, %d of snapshot, capacity %d: want a fresh snapshot and its room", s.LogBytes, s.Snapshot, s.Capacity)
	}
	st2, _, err := Load(r.store.f)
	must(t, err)
	must(t, st2.Check(want))
	// Started again from the compacted books, it copies them.
	b.Close()
	b2, err := Start(st2, info.Gen+1, r.store, nil)
	must(t, err)
	defer b2.Close()
	if s2 := b2.Stats(); s2.LogBytes != s.LogBytes || s2.Capacity != s.Capacity {
		t.Fatalf("second start: %+v, want the copy of %+v", s2, s)
	}
}
