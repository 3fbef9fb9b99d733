// Package unixsock is the Unix-socket plumbing the copy API's server, its
// client and the keeper share: listening on a socket file (a stale one
// replaced, a live one refused, the file's mode), the peer's credentials
// (SO_PEERCRED), the file descriptors of a received control message
// (SCM_RIGHTS) and an accept loop that rides out temporary failures.
//
// Every socket is SOCK_SEQPACKET (Network). The package imports only the
// standard library and golang.org/x/sys/unix: the client side may use it.
package unixsock

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Network is the socket type: one packet per message, message boundaries
// kept, connection oriented.
const Network = "unixpacket"

// ErrInUse reports a socket file another process is listening on.
var ErrInUse = errors.New("another process is listening on the socket")

// Listen creates the socket file at path and listens on it. mode is the
// file's permission. A mode with no group or other bits (0600) makes the
// socket private: a missing directory is created 0700 and the file is bound
// under umask 077, so it never exists with a wider mode, even for a moment.
// Any other mode: a missing directory is created 0755 and the file is set
// to mode after the bind. A socket file left at path by an earlier process
// (nobody listening) is replaced; one that somebody listens on is refused
// with ErrInUse, and any other kind of file at path is refused.
func Listen(path string, mode os.FileMode) (*net.UnixListener, error) {
	private := mode.Perm()&0o077 == 0
	dirMode := os.FileMode(0o755)
	if private {
		dirMode = 0o700
	}
	if err := os.MkdirAll(filepath.Dir(path), dirMode); err != nil {
		return nil, fmt.Errorf("socket directory: %w", err)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("%s exists and is not a socket", path)
		}
		if c, err := net.Dial(Network, path); err == nil {
			c.Close()
			return nil, fmt.Errorf("%s: %w", path, ErrInUse)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("remove stale socket: %w", err)
		}
	}
	var old int
	if private {
		old = unix.Umask(0o077)
	}
	l, err := net.ListenUnix(Network, &net.UnixAddr{Name: path, Net: Network})
	if private {
		unix.Umask(old)
	}
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	if err := os.Chmod(path, mode.Perm()); err != nil {
		l.Close()
		return nil, fmt.Errorf("chmod socket: %w", err)
	}
	return l, nil
}

// Peer is the credentials of a connected peer process (SO_PEERCRED), as
// the kernel took them when it connected.
type Peer struct {
	PID int32
	UID uint32
	GID uint32
}

// PeerOf reads the credentials of uc's peer.
func PeerOf(uc *net.UnixConn) (Peer, error) {
	rc, err := uc.SyscallConn()
	if err != nil {
		return Peer{}, err
	}
	var cred *unix.Ucred
	var gerr error
	if err := rc.Control(func(fd uintptr) {
		cred, gerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Peer{}, err
	}
	if gerr != nil {
		return Peer{}, fmt.Errorf("SO_PEERCRED: %w", gerr)
	}
	return Peer{PID: cred.Pid, UID: cred.Uid, GID: cred.Gid}, nil
}

// ErrControl reports a received control message that is not made of
// whole SCM_RIGHTS messages.
var ErrControl = errors.New("unexpected control message")

// ParseRights returns the file descriptors that the SCM_RIGHTS messages of
// a received control buffer carry, in order. Anything else in the buffer
// is an error wrapping ErrControl: a message of another level or type (an
// SCM_CREDENTIALS, say), a length that does not fit the buffer, a payload
// of no whole number of descriptors, a negative descriptor, bytes after
// the last message. The descriptors of the well-formed SCM_RIGHTS
// messages come back with that error too: the kernel installed them in
// this process, and the caller must close them (Files does).
//
// It reads bytes only (no descriptor is touched), so any input is safe.
func ParseRights(oob []byte) ([]int, error) {
	hdrLen := unix.CmsgLen(0)           // the header, padded
	align := unix.CmsgSpace(1) - hdrLen // the alignment of messages
	var h unix.Cmsghdr                  // decoded by copy: oob need not be aligned
	hb := unsafe.Slice((*byte)(unsafe.Pointer(&h)), unsafe.Sizeof(h))
	var fds []int
	var ferr error
	bad := func(format string, args ...any) {
		if ferr == nil {
			ferr = fmt.Errorf("%w: %s", ErrControl, fmt.Sprintf(format, args...))
		}
	}
	for off := 0; off < len(oob); {
		rest := oob[off:]
		if len(rest) < hdrLen {
			bad("%d bytes at offset %d, less than a header", len(rest), off)
			break
		}
		copy(hb, rest)
		n := uint64(h.Len)
		if n < uint64(hdrLen) || n > uint64(len(rest)) {
			bad("message at offset %d claims %d bytes, %d left", off, n, len(rest))
			break
		}
		data := rest[hdrLen:n]
		switch {
		case h.Level != unix.SOL_SOCKET || h.Type != unix.SCM_RIGHTS:
			bad("level %d type %d at offset %d, want SCM_RIGHTS", h.Level, h.Type, off)
		case len(data)%4 != 0:
			bad("SCM_RIGHTS at offset %d of %d bytes, not whole descriptors", off, len(data))
		default:
			for i := 0; i < len(data); i += 4 {
				fd := int32(binary.NativeEndian.Uint32(data[i:]))
				if fd < 0 {
					bad("descriptor %d at offset %d", fd, off)
					continue
				}
				fds = append(fds, int(fd))
			}
		}
		// The last message's padding may be cut off; nothing follows it.
		off += min((int(n)+align-1)/align*align, len(rest))
	}
	return fds, ferr
}

// Files is ParseRights with the descriptors as files, named name, for the
// caller to own. On an error it closes every descriptor it found and
// returns none.
func Files(oob []byte, name string) ([]*os.File, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	fds, err := ParseRights(oob)
	if err != nil {
		for _, fd := range fds {
			_ = unix.Close(fd) // nothing to do about a failed close of an fd we never used
		}
		return nil, err
	}
	files := make([]*os.File, len(fds))
	for i, fd := range fds {
		files[i] = os.NewFile(uintptr(fd), name)
	}
	return files, nil
}

// Acceptor is an accept loop's callbacks.
type Acceptor struct {
	// Admit decides what becomes of a new connection and returns the work
	// that serves it, which runs in a goroutine of its own, or nil when
	// it has dealt with the connection already (refused and closed it).
	Admit func(uc *net.UnixConn) func()
	// Retry, when set, is told of each temporary accept failure and how
	// long the loop waits before it accepts again.
	Retry func(err error, wait time.Duration)
	// Stop, when set, is called once accepting has ended and before the
	// loop waits for the work it started: it closes the connections, so
	// that their work returns.
	Stop func()
}

// Serve accepts connections on l until ctx ends or accepting fails for
// good, hands each to a.Admit, and then closes l, calls a.Stop and waits
// for every goroutine it started. A temporary failure (out of file
// descriptors or memory, a connection aborted before it was taken: see
// Temporary) is retried after a backoff of 5 ms doubling to 1 s. It
// returns nil when ctx ended, else the error that ended accepting.
func (a Acceptor) Serve(ctx context.Context, l *net.UnixListener) error {
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	var wg sync.WaitGroup
	var err error
	var backoff time.Duration
	for {
		uc, aerr := l.AcceptUnix()
		if aerr != nil {
			if ctx.Err() != nil {
				break
			}
			if Temporary(aerr) {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				if a.Retry != nil {
					a.Retry(aerr, backoff)
				}
				t := time.NewTimer(backoff)
				select {
				case <-t.C:
				case <-ctx.Done():
					t.Stop()
				}
				continue
			}
			err = fmt.Errorf("accept: %w", aerr)
			break
		}
		backoff = 0
		if run := a.Admit(uc); run != nil {
			wg.Go(run)
		}
	}
	l.Close()
	if a.Stop != nil {
		a.Stop()
	}
	wg.Wait()
	return err
}

// Temporary reports whether an accept error is one to retry: out of file
// descriptors or memory, or a connection aborted before it was taken.
func Temporary(err error) bool {
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM,
		syscall.ECONNABORTED, syscall.EINTR, syscall.EAGAIN, syscall.EPROTO, syscall.EPERM} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}
