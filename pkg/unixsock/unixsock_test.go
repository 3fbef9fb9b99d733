package unixsock

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Listen makes the directory and the socket file with the modes asked
// for, replaces a stale socket file, and refuses a live socket and any
// other file.
func TestListen(t *testing.T) {
	for _, tc := range []struct {
		mode, dir os.FileMode
	}{{0o666, 0o755}, {0o600, 0o700}} {
		path := filepath.Join(t.TempDir(), "sub", "s.sock")
		l, err := Listen(path, tc.mode)
		if err != nil {
			t.Fatal(err)
		}
		fi, err := os.Lstat(path)
		if err != nil || fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != tc.mode {
			t.Errorf("mode %v: socket %v, %v", tc.mode, fi.Mode(), err)
		}
		if di, err := os.Stat(filepath.Dir(path)); err != nil || di.Mode().Perm() != tc.dir {
			t.Errorf("mode %v: directory %v, %v", tc.mode, di.Mode(), err)
		}
		// Live: refused, and the listener goes on.
		if _, err := Listen(path, tc.mode); !errors.Is(err, ErrInUse) {
			t.Errorf("listen on a live socket: %v", err)
		}
		c, err := net.Dial(Network, path)
		if err != nil {
			t.Fatalf("the first listener is gone: %v", err)
		}
		c.Close()
		// Stale: the file stays when its listener goes, as after a crash.
		l.SetUnlinkOnClose(false)
		l.Close()
		if _, err := os.Lstat(path); err != nil {
			t.Fatal(err)
		}
		l2, err := Listen(path, tc.mode)
		if err != nil {
			t.Fatalf("listen over a stale socket: %v", err)
		}
		l2.Close()
	}
	path := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(path, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(path, 0o666); err == nil {
		t.Fatal("listen over a regular file succeeded")
	}
	if b, err := os.ReadFile(path); err != nil || string(b) != "keep me" {
		t.Errorf("the file was touched: %q, %v", b, err)
	}
}

func socketpair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conv := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "sp")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c.(*net.UnixConn)
	}
	return conv(fds[0]), conv(fds[1])
}

func TestPeerOf(t *testing.T) {
	a, _ := socketpair(t)
	p, err := PeerOf(a)
	if err != nil {
		t.Fatal(err)
	}
	if p.PID != int32(os.Getpid()) || p.UID != uint32(os.Getuid()) || p.GID != uint32(os.Getgid()) {
		t.Errorf("peer %+v, want this process", p)
	}
}

// cmsg builds one control message by hand, padded as the kernel pads it.
func cmsg(level, typ int32, data []byte) []byte {
	b := make([]byte, unix.CmsgSpace(len(data)))
	binary.NativeEndian.PutUint64(b, uint64(unix.CmsgLen(len(data))))
	binary.NativeEndian.PutUint32(b[8:], uint32(level))
	binary.NativeEndian.PutUint32(b[12:], uint32(typ))
	copy(b[unix.CmsgLen(0):], data)
	return b
}

func TestParseRights(t *testing.T) {
	if unix.SizeofCmsghdr != 16 {
		t.Skip("the hand-built messages assume a 64-bit cmsghdr")
	}
	creds := unix.UnixCredentials(&unix.Ucred{Pid: 1, Uid: 2, Gid: 3})
	two := unix.UnixRights(7, 8)
	for _, tc := range []struct {
		name string
		oob  []byte
		fds  []int
		ok   bool
	}{
		{"empty", nil, nil, true},
		{"one", unix.UnixRights(3), []int{3}, true},
		{"three in one", unix.UnixRights(3, 4, 5), []int{3, 4, 5}, true},
		{"two messages", slices.Concat(unix.UnixRights(3), two), []int{3, 7, 8}, true},
		{"padding cut off", unix.UnixRights(3)[:unix.CmsgLen(4)], []int{3}, true},
		{"credentials alone", creds, nil, false},
		// The descriptors around a foreign message are returned with the
		// error, for the caller to close.
		{"credentials between", slices.Concat(unix.UnixRights(3), creds, two), []int{3, 7, 8}, false},
		{"other level", cmsg(unix.SOL_IP, unix.SCM_RIGHTS, []byte{1, 0, 0, 0}), nil, false},
		{"half a descriptor", cmsg(unix.SOL_SOCKET, unix.SCM_RIGHTS, []byte{1, 0, 0, 0, 2, 0}), nil, false},
		{"negative descriptor", cmsg(unix.SOL_SOCKET, unix.SCM_RIGHTS, []byte{1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff}), []int{1}, false},
		{"short header", unix.UnixRights(3)[:10], nil, false},
		{"length past the end", unix.UnixRights(3, 4)[:20], nil, false},
		{"length under a header", func() []byte { b := unix.UnixRights(3); b[0] = 8; return b }(), nil, false},
		{"trailing bytes", append(unix.UnixRights(3), 0, 0, 0), []int{3}, false},
	} {
		fds, err := ParseRights(tc.oob)
		if !slices.Equal(fds, tc.fds) || (err == nil) != tc.ok {
			t.Errorf("%s: %v, %v; want %v, ok %v", tc.name, fds, err, tc.fds, tc.ok)
		}
		if err != nil && !errors.Is(err, ErrControl) {
			t.Errorf("%s: %v does not wrap ErrControl", tc.name, err)
		}
	}
}

func memfd(t *testing.T) *os.File {
	t.Helper()
	fd, err := unix.MemfdCreate("unixsock-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "memfd")
	t.Cleanup(func() { f.Close() })
	return f
}

func recvOOB(t *testing.T, c *net.UnixConn) []byte {
	t.Helper()
	oob := make([]byte, 256)
	_, oobn, flags, _, err := c.ReadMsgUnix(make([]byte, 16), oob)
	if err != nil || flags&unix.MSG_CTRUNC != 0 {
		t.Fatalf("recv: %v, flags %#x", err, flags)
	}
	return oob[:oobn]
}

// Files hands over the descriptors a real packet carried; when the control
// message holds anything besides SCM_RIGHTS (here the credentials a
// receiver with SO_PASSCRED gets on every packet) it refuses it, and the
// descriptors that came with it are closed, not leaked. (The keeper used
// to skip such a message and keep the descriptors; the copy API's
// connection refused it and leaked them when the buffer did not parse.)
func TestFilesRealSocket(t *testing.T) {
	a, b := socketpair(t)
	f := memfd(t)
	if _, _, err := a.WriteMsgUnix([]byte("x"), unix.UnixRights(int(f.Fd()), int(f.Fd())), nil); err != nil {
		t.Fatal(err)
	}
	files, err := Files(recvOOB(t, b), "got")
	if err != nil || len(files) != 2 {
		t.Fatalf("files %v, %v", files, err)
	}
	for _, g := range files {
		var st1, st2 unix.Stat_t
		if unix.Fstat(int(g.Fd()), &st1) != nil || unix.Fstat(int(f.Fd()), &st2) != nil || st1.Ino != st2.Ino {
			t.Error("a received file is not the memfd sent")
		}
		g.Close()
	}

	rc, err := b.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PASSCRED, 1) }); err != nil || serr != nil {
		t.Fatal(err, serr)
	}
	if _, _, err := a.WriteMsgUnix([]byte("x"), unix.UnixRights(int(f.Fd())), nil); err != nil {
		t.Fatal(err)
	}
	oob := recvOOB(t, b)
	fds, perr := ParseRights(oob)
	if perr == nil || len(fds) != 1 {
		t.Fatalf("rights with credentials: %v, %v; want the fd and an error", fds, perr)
	}
	if files, err := Files(oob, "got"); err == nil || files != nil {
		t.Fatalf("Files: %v, %v; want an error and no files", files, err)
	}
	if _, err := unix.FcntlInt(uintptr(fds[0]), unix.F_GETFD, 0); !errors.Is(err, unix.EBADF) {
		t.Errorf("the received fd %d is still open: %v", fds[0], err)
	}
}

// The accept loop admits every connection, runs the work Admit returns,
// and on the end of ctx stops, lets Stop close the connections and waits
// for that work; a listener closed under it ends it with the error.
func TestAcceptorServe(t *testing.T) {
	path := filepath.Join(t.TempDir(), "a.sock")
	l, err := Listen(path, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	var admitted, served, stopped atomic.Int32
	conns := make(chan *net.UnixConn, 8)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Acceptor{
			Admit: func(uc *net.UnixConn) func() {
				if admitted.Add(1) == 2 {
					uc.Close() // refused: no work
					return nil
				}
				conns <- uc
				return func() {
					_, _ = uc.Read(make([]byte, 1)) // until Stop closes it
					served.Add(1)
				}
			},
			Stop: func() {
				stopped.Add(1)
				for len(conns) > 0 {
					(<-conns).Close()
				}
			},
		}.Serve(ctx, l)
	}()
	for range 3 {
		c, err := net.Dial(Network, path)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	for admitted.Load() < 3 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Serve after cancel: %v", err)
	}
	if served.Load() != 2 || stopped.Load() != 1 {
		t.Errorf("served %d, stopped %d; want 2 and 1", served.Load(), stopped.Load())
	}

	l, err = Listen(path, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		done <- Acceptor{Admit: func(uc *net.UnixConn) func() { uc.Close(); return nil }}.Serve(context.Background(), l)
	}()
	l.Close()
	if err := <-done; !errors.Is(err, net.ErrClosed) {
		t.Errorf("Serve on a closed listener: %v", err)
	}
}

func TestTemporary(t *testing.T) {
	for err, want := range map[error]bool{
		&net.OpError{Op: "accept", Err: os.NewSyscallError("accept4", unix.EMFILE)}: true,
		unix.ECONNABORTED: true,
		net.ErrClosed:     false,
		unix.EBADF:        false,
	} {
		if Temporary(err) != want {
			t.Errorf("Temporary(%v) = %v", err, !want)
		}
	}
}
