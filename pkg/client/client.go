// Package client is the inference process's side of kvpool: a CPUPagePool
// with the operations and meaning of the engine's host page pool
// (offload_stream, reload_stream, discard, remove_request, is_offloaded,
// labels, num_pages, num_free_pages, sync), backed by the node agent.
//
// The agent owns the memory and the bookkeeping; this package moves the
// bytes. At Open it receives the allocation's chunks as file descriptors,
// maps and registers them with CUDA (pkg/cudart), and from then on every
// offload and reload is one round trip to the agent for page numbers
// followed by batched copies on the pool's own device-to-host and
// host-to-device streams (a cudart.Mover, with the copies laid out by a
// cudart.Layout). Sync orders the caller's stream behind them.
//
// A reload's host pages are released by the agent only once the client
// reports the copy reading them complete (a fence ticket). The report rides
// in the header of the next request, so the hot path stays one round trip.
package client

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/wire"
)

// maxRegister is the most bytes registered with CUDA in one call.
const maxRegister = 64 << 30

// maxRanks bounds Options.Ranks, as the agent does.
const maxRanks = 1024

// Options configure Open.
type Options struct {
	Socket string // default $KVPOOL_SOCKET, then contract.ContainerSocket
	Token  string // default $KVPOOL_TOKEN
	// Device is the GPU whose KV cache this pool serves: the engine's own
	// (the device its KV tensors live on), never one picked to suit the
	// chunks. The agent is told its UUID (Device.UUID, as the driver names
	// it: the same inside a container and on the host) and binds the
	// chunks nearest it.
	Device cudart.Device
	// Regions is the device KV cache's layout: one cudart.Region per
	// array of pages (a layer's K and V tensors, or each layer of a
	// layer-major cache); one host page holds a device page's bytes of
	// every region, in region order, back to back.
	Regions []cudart.Region
	// MaxPages is the host pages wanted; 0 takes this session's fair share
	// of the allocation: its unbound chunks divided among the ranks that
	// have no session yet (docs/device-plugin.md).
	MaxPages int
	// Ranks is how many sessions (tensor-parallel ranks, one per GPU) share
	// the allocation, when the engine knows it (its world size on this
	// node); 0 lets the agent count the container's GPUs.
	Ranks int
	// Order is the engine stream whose earlier work each copy must follow
	// (the kernels that wrote the pages being offloaded, or last read the
	// pages being reloaded onto). Default: the device's default stream.
	Order cudart.Stream
	// InstanceID identifies this client process to the agent; default a
	// random ID made once per process. Opening again with the same ID (after
	// a dropped connection) resumes the session. The agent holds one
	// session per (allocation, GPU): a second pool on the same GPU with the
	// same ID takes the first's session over, and with another ID it is
	// refused (StatusBusy) while the first is connected.
	InstanceID []byte
	Name       string // shown in the agent's logs
	// Trace, when set, is called after every request with the time from
	// sending it to decoding its reply: the agent round trip alone,
	// without the copies. For benchmarks and metrics.
	Trace  func(op wire.Op, roundTrip time.Duration)
	Logger *slog.Logger // default slog.Default()
	// RetryFor bounds how long a call waits for the agent when the
	// connection breaks or the agent answers "unavailable, retry" (it is
	// restarting): the call reconnects, resumes the session and resends
	// the request it had not had answered, which the agent answers as it
	// did the first time. Past the bound an offload returns false (as if
	// the pool were full) and every other call ErrUnavailable. Default
	// DefaultRetryFor; negative: no retry.
	RetryFor time.Duration
	// SpinWait is how long a call polls for the agent's reply before its
	// thread goes to sleep (wire.Conn.SetSpin), yielding the CPU between
	// polls. A reply within it costs no thread wake-up, which is most of
	// a round trip's time when the agent runs on another, idle CPU; the
	// price is up to SpinWait of this thread's CPU per request, spent
	// while the call waits anyway. The process's spin rule
	// (wire.SetSpinRule; default wire.SpinBudgeted) decides when a call
	// spins at all: only with no more sessions in the process than spare
	// CPUs, while the machine has a CPU for every runnable task, and while
	// the thread's CPU is not wanted by another thread, so that the spin
	// costs other callers and the agent as little as it can. Default
	// DefaultSpinWait, at most wire.SpinLimit; negative: no spinning.
	SpinWait time.Duration
	// NoLane keeps the session's packets on the socket: without it, once
	// the session is open they move to a pair of pipes the agent passes
	// (a lane, docs/protocol.md), on which a call takes about a tenth less
	// time on one CPU (docs/benchmarks.md). For comparisons, and for a
	// sandbox that refuses pipes. $KVPOOL_LANE=off does the same.
	NoLane bool
}

// LaneEnv, when "off", keeps every session's packets on the socket, as
// Options.NoLane does ("on" or empty: the default); for the C ABI and
// Python, whose options do not carry NoLane.
const LaneEnv = "KVPOOL_LANE"

// DefaultSpinWait is the default Options.SpinWait: longer than most
// round trips to an agent on another CPU (docs/benchmarks.md).
const DefaultSpinWait = 50 * time.Microsecond

// DefaultRetryFor is the default Options.RetryFor: longer than an agent
// restart takes.
const DefaultRetryFor = 30 * time.Second

// ErrUnavailable reports a call that could not reach the agent within
// Options.RetryFor.
var ErrUnavailable = errors.New("kvpool: the agent is unavailable")

// OffloadedStream is the metadata of one (request, label) stream, as the
// seed API returns it from reload_stream.
type OffloadedStream struct {
	CPUPageIndices []int32
	StoredLen      int64
	Position       int64
	Released       int64
}

// ErrDisconnected reports a call that failed because the connection to the
// agent broke. Whether the agent applied the call is unknown; the next call
// reconnects and resumes the session.
var ErrDisconnected = errors.New("kvpool: connection to the agent lost")

// ErrProtocol reports a reply that does not follow the protocol; the
// connection is closed.
var ErrProtocol = errors.New("kvpool: protocol violation by the agent")

// Error is a request the agent refused. errors.Is matches it against the
// pool's error values (poolerr.ErrUnknownStream, ...), whose meaning its
// status has (wire.ErrorOf).
type Error struct {
	Op      wire.Op
	Status  wire.Status
	Message string
	Ticket  uint64
}

func (e *Error) Error() string { return fmt.Sprintf("kvpool %s: %s: %s", e.Op, e.Status, e.Message) }

// Kind is the status's kind (wire.Status.Kind): the same word the agent's
// metrics and error ring use for this refusal.
func (e *Error) Kind() string { return e.Status.Kind() }

// Unwrap returns the pool error of the same meaning (wire.ErrorOf), when
// there is one.
func (e *Error) Unwrap() error { return wire.ErrorOf(e.Status) }

var (
	instanceOnce sync.Once
	instanceID   []byte
)

// InstanceID returns this process's client instance ID.
func InstanceID() []byte {
	instanceOnce.Do(func() {
		instanceID = make([]byte, 16)
		if _, err := rand.Read(instanceID); err != nil {
			panic("kvpool: no randomness for the instance ID: " + err.Error())
		}
	})
	return instanceID
}

// CPUPagePool is a session on the agent's pool for one GPU. Its methods are
// safe for concurrent use; calls are serialized.
type CPUPagePool struct {
	o   Options
	dev cudart.Device
	log *slog.Logger

	mu      sync.Mutex
	wc      *wire.Conn
	seq     uint32
	in, out []byte
	closed  bool
	opening bool // an open's replies may carry fds (its own, and OpMore's for the rest), and the lane's

	session  uint64
	pageSize uint64
	ppc      int
	capacity int
	chunks   []mappedChunk
	locality Locality

	layout      cudart.Layout
	mover       *cudart.Mover
	lastOffload cudart.Ticket   // a reload's host pages were written by offloads up to this one
	lastReload  cudart.Ticket   // the latest reload batch the mover accepted
	pending     []pendingReload // reloads whose copy completion is not yet reported
	fenceDone   uint64          // highest ticket whose copy is known complete
	fenceSent   uint64          // highest ticket the agent has been told
	devIdx      []int           // scratch for the layout's device pages
	hostAddr    []uintptr       // scratch for the layout's host pages
	copies      []cudart.Copy   // scratch for a batch's copies

	offReq wire.Offload
	offRep wire.OffloadReply
	relReq wire.Reload
	relRep wire.ReloadReply
	ridReq wire.Request
	offd   wire.IsOffloadedReply
	errRep wire.Error
}

type mappedChunk struct {
	id   string
	size uint64
	mem  []byte
	base uintptr
}

// Locality is where a session's host memory lies relative to its GPU, as
// the agent told it at open.
type Locality struct {
	GPUNUMA int // NUMA node of the GPU; -1 unknown (or an agent that does not say)
	Ranks   int // ranks the allocation is shared among; 0 unknown
	// Chunks are the session's chunks in page order, with their nodes.
	Chunks []ChunkLocality
	// Local, Remote and Unknown count the chunks on the GPU's node, on
	// another node (copies cross the socket interconnect) and where a node
	// is unknown.
	Local, Remote, Unknown int
}

// ChunkLocality is one chunk of a session and its NUMA node (-1 unknown).
type ChunkLocality struct {
	ID   string
	NUMA int
}

// CrossNUMA reports whether any chunk lies on another NUMA node than the GPU.
func (l Locality) CrossNUMA() bool { return l.Remote > 0 }

func localityOf(rep *wire.OpenReply) Locality {
	l := Locality{GPUNUMA: -1, Ranks: int(rep.Ranks)}
	if rep.GpuNuma != nil && rep.GetGpuNuma() >= 0 {
		l.GPUNUMA = int(rep.GetGpuNuma())
	}
	for _, c := range rep.Chunks {
		n := -1
		if c.Numa != nil && c.GetNuma() >= 0 {
			n = int(c.GetNuma())
		}
		l.Chunks = append(l.Chunks, ChunkLocality{ID: c.Id, NUMA: n})
		switch {
		case n < 0 || l.GPUNUMA < 0:
			l.Unknown++
		case n == l.GPUNUMA:
			l.Local++
		default:
			l.Remote++
		}
	}
	return l
}

// pendingReload pairs the agent's fence ticket of a reload with the mover's
// ticket of its copies (0: nothing to wait for).
type pendingReload struct {
	ticket uint64
	copy   cudart.Ticket
}

// Open connects to the agent, opens a session for o.Device with o.Regions,
// maps and registers the chunks it grants, and creates the copy streams.
func Open(ctx context.Context, o Options) (*CPUPagePool, error) {
	if o.Device == nil {
		return nil, errors.New("kvpool: Options.Device is required")
	}
	if len(o.Regions) == 0 {
		return nil, errors.New("kvpool: Options.Regions is empty")
	}
	layout := cudart.Layout{Regions: slices.Clone(o.Regions)}
	if err := layout.Validate(); err != nil {
		return nil, fmt.Errorf("kvpool: %w", err)
	}
	for i, r := range o.Regions {
		if r.Pages > 1<<31-2 {
			return nil, fmt.Errorf("kvpool: region %d: %d pages, more than page indices can name", i, r.Pages)
		}
	}
	if o.MaxPages < 0 {
		return nil, fmt.Errorf("kvpool: MaxPages %d is negative", o.MaxPages)
	}
	switch v := os.Getenv(LaneEnv); v {
	case "", "on":
	case "off":
		o.NoLane = true
	default:
		return nil, fmt.Errorf("kvpool: %s=%q: want on or off", LaneEnv, v)
	}
	if o.Ranks < 0 || o.Ranks > maxRanks {
		return nil, fmt.Errorf("kvpool: Ranks %d, want 0 to %d", o.Ranks, maxRanks)
	}
	switch {
	case o.SpinWait == 0:
		o.SpinWait = DefaultSpinWait
	case o.SpinWait < 0:
		o.SpinWait = 0
	case o.SpinWait > wire.SpinLimit:
		return nil, fmt.Errorf("kvpool: SpinWait %v is over the limit of %v", o.SpinWait, wire.SpinLimit)
	}
	if o.Socket == "" {
		o.Socket = os.Getenv(contract.EnvSocket)
	}
	if o.Socket == "" {
		o.Socket = contract.ContainerSocket
	}
	if o.Token == "" {
		o.Token = os.Getenv(contract.EnvToken)
	}
	if o.Token == "" {
		return nil, fmt.Errorf("kvpool: no allocation token (set Options.Token or $%s)", contract.EnvToken)
	}
	if o.InstanceID == nil {
		o.InstanceID = InstanceID()
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Name == "" {
		o.Name = "kvpool-go-client"
	}
	if o.RetryFor == 0 {
		o.RetryFor = DefaultRetryFor
	}
	p := &CPUPagePool{o: o, dev: o.Device, log: o.Logger, layout: layout, in: make([]byte, wire.MaxMessage+1)}
	var err error
	if p.mover, err = cudart.NewMover(p.dev); err != nil {
		return nil, fmt.Errorf("kvpool: %w", err)
	}
	if err := p.reconnect(ctx, time.Now().Add(max(p.o.RetryFor, 0))); err != nil {
		p.mover.Close()
		return nil, err
	}
	return p, nil
}

// retryable says whether err is a passing condition of an agent restart:
// a broken or refused connection, or the agent's "unavailable, retry".
func retryable(err error) bool {
	var e *Error
	if errors.As(err, &e) {
		return e.Status == wire.StatusUnavailable
	}
	return errors.Is(err, ErrDisconnected) || errors.Is(err, errDial)
}

// errDial marks a failed dial (no socket yet, or nobody listening).
var errDial = errors.New("dial")

// dialPoll is the longest wait between dials while nobody listens on the
// socket (an agent restarting): 1 ms doubling to 5 ms. A dial refused
// costs the kernel microseconds and the agent nothing, and the session
// resumes within 5 ms of the new agent listening; the 100 ms steps of the
// other retries added up to 100 ms to an engine's restart gap (`kvbench
// restart --wait client`).
const dialPoll = 5 * time.Millisecond

// retryWait is how long to wait after the try-th failure, err, before the
// next try: 5 ms doubling to 100 ms (to limitBackoff after a refusal by a
// limit, so that refused clients do not crowd the agent), 1 ms doubling
// to dialPoll while the dial fails; never past the deadline.
func retryWait(try int, err error, deadline time.Time) time.Duration {
	step, most := 5*time.Millisecond, 100*time.Millisecond
	switch {
	case isStatus(err, wire.StatusLimit):
		most = limitBackoff
	case errors.Is(err, errDial):
		step, most = time.Millisecond, dialPoll
	}
	return min(time.Duration(1<<min(try, 8))*step, most, max(time.Until(deadline), 0))
}

// BusyRetryFor is how long opening a session retries "busy" (another
// client holds the GPU's session): long enough for the agent to see the
// connection of a previous owner that just exited close, short enough
// that a live owner's refusal comes back soon.
const BusyRetryFor = 2 * time.Second

// limitBackoff is the longest wait between tries after a refusal by one
// of the agent's bounds.
const limitBackoff = time.Second

// isStatus reports whether err is the agent's refusal with status st.
func isStatus(err error, st wire.Status) bool {
	var e *Error
	return errors.As(err, &e) && e.Status == st
}

// reconnect connects and opens (or resumes) the session, retrying what an
// agent restart causes until deadline, and what else passes: a refusal by
// the agent's connection or session bounds (status limit: its places fill
// and empty), with a backoff up to a second, until deadline; and "busy"
// for BusyRetryFor (the previous owner's connection may not be seen
// closed yet).
func (p *CPUPagePool) reconnect(ctx context.Context, deadline time.Time) error {
	busyUntil := time.Now().Add(BusyRetryFor)
	for try := 0; ; try++ {
		err := p.connect(ctx)
		if err == nil {
			return nil
		}
		limit := isStatus(err, wire.StatusLimit)
		retry := retryable(err) || limit || isStatus(err, wire.StatusBusy) && time.Now().Before(busyUntil)
		if !retry || time.Now().After(deadline) || ctx.Err() != nil {
			if retryable(err) || limit {
				return fmt.Errorf("%w: %w", ErrUnavailable, err)
			}
			return err
		}
		p.log.Debug("kvpool: retrying the session", "try", try, "err", err)
		time.Sleep(retryWait(try, err, deadline))
	}
}

// call sends one request of the session and reads its reply, riding out an
// agent restart within Options.RetryFor: on a broken connection it
// reconnects, resumes the session and resends the request with the same
// sequence number, so that a request the agent had already carried out is
// answered as it was, not done twice. Called with p.mu held.
func (p *CPUPagePool) call(op wire.Op, req, rep proto.Message) ([]*os.File, error) {
	return p.callWith(op, nil, req, rep, nil)
}

// callWith is call for a request that takes several packets: before, when
// set, sends what goes ahead of the request on the same connection (its
// OpPages packets); after, when set, fetches the rest of a long reply (with
// OpMore). A retry runs all three again on the new connection; the request
// keeps its sequence number, so the agent answers a resend as it did the
// first time and makes the rest of that answer fetchable again.
func (p *CPUPagePool) callWith(op wire.Op, before func() error, req, rep proto.Message, after func() error) ([]*os.File, error) {
	p.seq++
	seq := p.seq
	var deadline time.Time
	for try := 0; ; try++ {
		var err error
		if p.wc == nil {
			if deadline.IsZero() {
				deadline = time.Now().Add(max(p.o.RetryFor, 0))
			}
			err = p.reconnect(context.Background(), deadline)
			if err == nil {
				// The agent may have lost the fences it had not recorded.
				p.fenceSent = 0
			}
		}
		var files []*os.File
		if err == nil && before != nil {
			err = before()
		}
		if err == nil {
			files, err = p.exchange(op, seq, p.fence(), req, rep)
		}
		if err == nil && after != nil {
			if err = after(); err != nil {
				closeFiles(files)
				files = nil
			}
		}
		if err == nil || !retryable(err) || errors.Is(err, ErrUnavailable) {
			return files, err
		}
		if deadline.IsZero() {
			deadline = time.Now().Add(max(p.o.RetryFor, 0))
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
		}
		p.log.Debug("kvpool: retrying after an agent restart", "op", op, "err", err)
		time.Sleep(retryWait(try, err, deadline))
	}
}

// connect dials, says hello and opens (or resumes) the session. Called with
// p.mu held, or before p is shared.
func (p *CPUPagePool) connect(ctx context.Context) error {
	wc, err := wire.Dial(p.o.Socket)
	if err != nil {
		return fmt.Errorf("kvpool: %w: %w", errDial, err)
	}
	if err := wc.SetSpin(p.o.SpinWait); err != nil {
		wc.Close()
		return fmt.Errorf("kvpool: %w", err) // Open checked the bound
	}
	if dl, ok := ctx.Deadline(); ok {
		if err := wc.SetDeadline(dl); err != nil {
			wc.Close()
			return fmt.Errorf("kvpool: %w: %w", errDial, err)
		}
		// Clearing it fails only on a closed conn, which the session's first
		// request then reports.
		defer func() { _ = wc.SetDeadline(time.Time{}) }()
	}
	stop := context.AfterFunc(ctx, func() { wc.Close() })
	defer stop()
	p.wc = wc
	var hr wire.HelloReply
	if _, err := p.roundTrip(wire.OpHello, 0, &wire.Hello{Version: wire.Version, Client: p.o.Name}, &hr); err != nil {
		p.dropConn()
		return err
	}
	if hr.Version != wire.Version {
		p.dropConn()
		return fmt.Errorf("kvpool: the agent speaks protocol version %d, this client needs version %d: upgrade the agent", hr.Version, wire.Version)
	}
	req := &wire.Open{Token: p.o.Token, GpuUuid: p.dev.UUID(), InstanceId: p.o.InstanceID, MaxPages: uint32(p.o.MaxPages), Ranks: uint32(p.o.Ranks)}
	if len(p.chunks) > 0 {
		// Its chunks mapped still: resuming it, the agent passes none.
		req.MappedSession = p.session
	}
	for _, r := range p.layout.Regions {
		req.Regions = append(req.Regions, &wire.Region{BytesPerPage: r.PageBytes, PageCount: uint32(r.Pages)})
	}
	var rep wire.OpenReply
	p.opening = true
	files, err := p.roundTrip(wire.OpOpen, 0, req, &rep)
	if err == nil {
		files, err = p.moreFiles(&rep, files)
	}
	p.opening = false
	defer closeFiles(files)
	if err != nil {
		p.dropConn()
		return err
	}
	if err := p.adopt(&rep, files); err != nil {
		p.dropConn()
		return err
	}
	if !p.o.NoLane {
		if err := p.takeLane(); err != nil {
			p.dropConn()
			return err
		}
	}
	// The open's reply and the lane's are the only ones that carry files:
	// from here on the socket refuses them, and each reply is read the
	// cheaper way (where the packets still travel the socket).
	wc.RefuseFiles()
	p.log.Debug("kvpool session", "session", rep.Session, "resumed", rep.Resumed, "chunksMapped", rep.ChunksMapped, "capacity", rep.Capacity,
		"page_size", rep.PageSize, "chunks", len(rep.Chunks), "gpu_numa", p.locality.GPUNUMA, "ranks", p.locality.Ranks)
	return nil
}

// takeLane asks the agent for a lane (wire.Conn.UseLane): the session's
// packets travel a pair of pipes from here on, which cost the kernel less
// a call than the socket does (docs/protocol.md). An agent that refuses it
// (one from before lanes answers "unknown op") leaves them on the socket;
// only a broken connection or a reply that is not a lane's is an error.
func (p *CPUPagePool) takeLane() error {
	p.opening = true
	files, err := p.roundTrip(wire.OpLane, 0, nil, nil)
	p.opening = false
	defer closeFiles(files)
	var refused *Error
	if errors.As(err, &refused) {
		p.log.Debug("kvpool: no lane; packets stay on the socket", "err", err)
		return nil
	}
	if err != nil {
		return err
	}
	if len(files) != 2 {
		return fmt.Errorf("%w: lane reply carried %d fds, want 2", ErrProtocol, len(files))
	}
	// The Conn owns what it is given: duplicates; the files close with the
	// defer.
	fds := [2]int{-1, -1}
	for i, f := range files {
		if err := dupFile(f, &fds[i]); err != nil {
			if i == 1 {
				unix.Close(fds[0])
			}
			return fmt.Errorf("%w: lane: %v", ErrDisconnected, err)
		}
	}
	if err := p.wc.UseLane(fds[0], fds[1]); err != nil {
		return fmt.Errorf("%w: %v", ErrProtocol, err)
	}
	return nil
}

// dupFile stores a close-on-exec duplicate of f's descriptor in fd.
func dupFile(f *os.File, fd *int) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var derr error
	if err := rc.Control(func(s uintptr) { *fd, derr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return err
	}
	if derr != nil {
		return os.NewSyscallError("fcntl", derr)
	}
	return nil
}

// moreFiles fetches the memfds of an open's chunks that its reply could
// not pass (one packet passes at most wire.MaxFDs) with OpMore, after
// those it did; where the reply named only the first chunks (chunk_count
// set: more than a packet can name), each More names the chunks whose fds
// it carries, and they are added to rep. It stops at a reply short of a
// packet's worth, and adopt then reports the count that does not add up.
func (p *CPUPagePool) moreFiles(rep *wire.OpenReply, files []*os.File) ([]*os.File, error) {
	chunks, named := len(rep.Chunks), rep.ChunkCount > uint32(len(rep.Chunks))
	if named {
		// A session binds the chunks its pages need and no more.
		if ppc := uint64(rep.PagesPerChunk); ppc == 0 || uint64(rep.ChunkCount) > (uint64(rep.Capacity)+ppc-1)/ppc {
			return files, fmt.Errorf("%w: open reply says %d chunks for %d pages of %d a chunk", ErrProtocol, rep.ChunkCount, rep.Capacity, rep.PagesPerChunk)
		}
		chunks = int(rep.ChunkCount)
	}
	var mr wire.MoreReply
	for len(files) > 0 && len(files) < chunks && len(files)%wire.MaxFDs == 0 {
		more, err := p.roundTrip(wire.OpMore, 0, &wire.More{Offset: uint32(len(files))}, &mr)
		files = append(files, more...)
		if err == nil && named && len(mr.Chunks) != len(more) {
			err = fmt.Errorf("%w: more names %d chunks but carries %d fds", ErrProtocol, len(mr.Chunks), len(more))
		}
		if err != nil || len(more) == 0 {
			return files, err
		}
		if named {
			rep.Chunks = append(rep.Chunks, mr.Chunks...)
		}
	}
	return files, nil
}

func closeFiles(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}

// adopt maps the chunks of an OpenReply, reusing existing mappings when the
// session was resumed with the same chunks.
func (p *CPUPagePool) adopt(rep *wire.OpenReply, files []*os.File) error {
	if rep.ChunksMapped && (len(files) != 0 || !rep.Resumed || len(p.chunks) == 0 || rep.Session != p.session) {
		// What the client has mapped is let go (once no copy reads it):
		// its next open asks for every chunk.
		p.dropMappings()
		return fmt.Errorf("%w: open reply says session %d's chunks are mapped already (resumed %t, %d fds); this client maps %d chunks of session %d",
			ErrProtocol, rep.Session, rep.Resumed, len(files), len(p.chunks), p.session)
	}
	if !rep.ChunksMapped && len(files) != len(rep.Chunks) {
		return fmt.Errorf("%w: open reply names %d chunks but carries %d fds", ErrProtocol, len(rep.Chunks), len(files))
	}
	if rep.ChunkCount != 0 && int(rep.ChunkCount) != len(rep.Chunks) {
		return fmt.Errorf("%w: open reply says %d chunks but names %d", ErrProtocol, rep.ChunkCount, len(rep.Chunks))
	}
	if rep.PageSize == 0 || rep.PagesPerChunk == 0 || uint64(rep.Capacity) > uint64(rep.PagesPerChunk)*uint64(len(rep.Chunks)) {
		return fmt.Errorf("%w: open reply geometry: page size %d, %d pages per chunk, capacity %d, %d chunks",
			ErrProtocol, rep.PageSize, rep.PagesPerChunk, rep.Capacity, len(rep.Chunks))
	}
	for _, c := range rep.Chunks {
		if c.Size < rep.PageSize*uint64(rep.PagesPerChunk) {
			return fmt.Errorf("%w: chunk %s of %d bytes cannot hold %d pages of %d", ErrProtocol, c.Id, c.Size, rep.PagesPerChunk, rep.PageSize)
		}
	}
	// A new session (even with chunks of the same names, as after an agent
	// restart) means new memory: map it afresh.
	same := rep.Resumed && rep.Session == p.session && rep.PageSize == p.pageSize && int(rep.PagesPerChunk) == p.ppc && len(rep.Chunks) == len(p.chunks)
	for i := 0; same && i < len(rep.Chunks); i++ {
		same = rep.Chunks[i].Id == p.chunks[i].id && rep.Chunks[i].Size == p.chunks[i].size
	}
	if rep.ChunksMapped && !same {
		p.dropMappings()
		return fmt.Errorf("%w: open reply says session %d's chunks are mapped already, but they are not the chunks this client maps", ErrProtocol, rep.Session)
	}
	if !rep.Resumed || !same {
		// A fresh session: nothing of the old one's pages or tickets holds.
		// Their copies' errors belong to that session: drop them.
		_ = p.mover.Wait()
		p.pending, p.fenceDone, p.fenceSent = p.pending[:0], 0, 0
	}
	if !same {
		p.unmapChunks()
		for i, c := range rep.Chunks {
			mem, err := mapChunk(files[i], int64(c.Size))
			if err != nil {
				p.unmapChunks()
				return fmt.Errorf("kvpool: map chunk %s: %w", c.Id, err)
			}
			mc := mappedChunk{id: c.Id, size: c.Size, mem: mem, base: uintptr(unsafePointer(mem))}
			p.chunks = append(p.chunks, mc)
			if err := register(p.dev, mem); err != nil {
				p.unmapChunks()
				return fmt.Errorf("kvpool: register chunk %s: %w", c.Id, err)
			}
		}
	}
	fresh := !same || !rep.Resumed
	p.session, p.pageSize, p.ppc, p.capacity = rep.Session, rep.PageSize, int(rep.PagesPerChunk), int(rep.Capacity)
	p.locality = localityOf(rep)
	if l := p.locality; fresh && l.CrossNUMA() {
		// Once per session: a resume of the same chunks says nothing new.
		p.log.Warn("kvpool: host KV chunks on another NUMA node than the GPU; their copies cross the socket interconnect",
			"device", p.dev.UUID(), "gpu_numa", l.GPUNUMA, "remote", l.Remote, "chunks", len(l.Chunks), "session", rep.Session)
	}
	return nil
}

func register(dev cudart.Device, mem []byte) error {
	for off := 0; off < len(mem); off += maxRegister {
		if err := dev.HostRegister(mem[off:min(len(mem), off+maxRegister)]); err != nil {
			return err
		}
	}
	return nil
}

// dropMappings lets go of the session's chunks once no copy reads them,
// and of the reloads pending on them.
func (p *CPUPagePool) dropMappings() {
	_ = p.mover.Wait()
	p.pending, p.fenceDone, p.fenceSent = p.pending[:0], 0, 0
	p.unmapChunks()
}

func (p *CPUPagePool) unmapChunks() {
	for _, c := range p.chunks {
		for off := 0; off < len(c.mem); off += maxRegister {
			// The memory is unmapped next whatever CUDA says; a failure
			// here leaves nothing registered that a later call could undo.
			_ = p.dev.HostUnregister(c.mem[off:min(len(c.mem), off+maxRegister)])
		}
		hostmemUnmap(c.mem)
	}
	p.chunks = p.chunks[:0]
}

func (p *CPUPagePool) dropConn() {
	if p.wc != nil {
		p.wc.Close()
		p.wc = nil
	}
}

// roundTrip sends one request and reads its reply into rep. A refusal by the
// agent is returned as *Error; a broken connection as ErrDisconnected, with
// the connection dropped.
func (p *CPUPagePool) roundTrip(op wire.Op, fence uint64, req, rep proto.Message) ([]*os.File, error) {
	p.seq++
	return p.exchange(op, p.seq, fence, req, rep)
}

// exchange is roundTrip with the sequence number given.
func (p *CPUPagePool) exchange(op wire.Op, seq uint32, fence uint64, req, rep proto.Message) ([]*os.File, error) {
	if p.o.Trace != nil {
		start := time.Now()
		defer func() { p.o.Trace(op, time.Since(start)) }()
	}
	if p.wc == nil {
		return nil, fmt.Errorf("%w: %s: the connection was dropped", ErrDisconnected, op)
	}
	var err error
	p.out, err = wire.AppendPacket(p.out[:0], wire.Header{Op: op, Seq: seq, Fence: fence}, req)
	if err != nil {
		return nil, fmt.Errorf("kvpool %s: %w", op, err)
	}
	if err := p.wc.Send(p.out, nil); err != nil {
		p.dropConn()
		return nil, fmt.Errorf("%w: %s: %v", ErrDisconnected, op, err)
	}
	pkt, files, err := p.wc.Recv(p.in)
	if err != nil {
		p.dropConn()
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, fmt.Errorf("%w: %s: %v", ErrDisconnected, op, err)
	}
	h, body, err := wire.ParseHeader(pkt)
	if err == nil && (h.Seq != seq || h.Op != op || h.Fence != 0) {
		err = fmt.Errorf("reply op %s seq %d fence %d to request op %s seq %d", h.Op, h.Seq, h.Fence, op, seq)
	}
	if err == nil && h.Status != wire.StatusOK {
		err = wire.DecodeBody(body, &p.errRep)
		if err == nil {
			closeFiles(files)
			if fence > p.fenceSent && h.Status != wire.StatusBadFence && h.Status != wire.StatusClosed {
				p.fenceSent = fence
			}
			return nil, &Error{Op: op, Status: h.Status, Message: p.errRep.Message, Ticket: p.errRep.Ticket}
		}
	}
	if err == nil {
		err = wire.DecodeBody(body, rep)
	}
	if err == nil && len(files) > 0 && !p.opening {
		err = fmt.Errorf("%s reply carried %d fds", op, len(files))
	}
	if err != nil {
		closeFiles(files)
		p.dropConn()
		return nil, fmt.Errorf("%w: %v", ErrProtocol, err)
	}
	if fence > p.fenceSent {
		p.fenceSent = fence
	}
	return files, nil
}
