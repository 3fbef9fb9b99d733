package wire

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// Network is the socket type the protocol runs on: one packet per message,
// message boundaries kept, connection oriented.
const Network = "unixpacket"

// ErrTooLarge reports a packet longer than MaxMessage. The receiver closes
// the connection: the rest of the packet is lost, so the peer's state is
// unknown.
var ErrTooLarge = errors.New("packet exceeds the maximum message size")

// Conn sends and receives packets on a SOCK_SEQPACKET Unix connection. A
// Conn is not safe for concurrent use by several readers or several
// writers; one reader and one writer may run at once.
type Conn struct {
	uc  *net.UnixConn
	oob []byte
}

// NewConn wraps a connected unixpacket socket.
func NewConn(uc *net.UnixConn) *Conn {
	return &Conn{uc: uc, oob: make([]byte, unix.CmsgSpace(4*MaxFDs))}
}

// Dial connects to the socket at path.
func Dial(path string) (*Conn, error) {
	uc, err := net.DialUnix(Network, nil, &net.UnixAddr{Name: path, Net: Network})
	if err != nil {
		return nil, fmt.Errorf("wire: dial %s: %w", path, err)
	}
	return NewConn(uc), nil
}

// UnixConn returns the underlying connection.
func (c *Conn) UnixConn() *net.UnixConn { return c.uc }

// Close closes the connection.
func (c *Conn) Close() error { return c.uc.Close() }

// Send writes one packet, passing fds by SCM_RIGHTS when there are any. The
// caller keeps ownership of fds.
func (c *Conn) Send(pkt []byte, fds []int) error {
	if len(pkt) > MaxMessage {
		return fmt.Errorf("wire: send %d bytes: %w", len(pkt), ErrTooLarge)
	}
	if len(fds) > MaxFDs {
		return fmt.Errorf("wire: send %d fds, at most %d", len(fds), MaxFDs)
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	n, _, err := c.uc.WriteMsgUnix(pkt, oob, nil)
	if err != nil {
		return fmt.Errorf("wire: send: %w", err)
	}
	if n != len(pkt) {
		return fmt.Errorf("wire: send: short write %d of %d bytes", n, len(pkt))
	}
	return nil
}

// Recv reads one packet into buf (which should have room for MaxMessage+1
// bytes, so that an oversized packet is detected) and returns it with the
// files passed alongside. The caller owns the files. A packet longer than
// MaxMessage, or whose descriptors did not fit, returns an error wrapping
// ErrTooLarge; the connection should then be closed. io.EOF means the peer
// closed the connection.
func (c *Conn) Recv(buf []byte) ([]byte, []*os.File, error) {
	n, oobn, flags, _, err := c.uc.ReadMsgUnix(buf, c.oob)
	var files []*os.File
	if oobn > 0 {
		var perr error
		files, perr = parseRights(c.oob[:oobn])
		if err == nil {
			err = perr
		}
	}
	if err == nil && n == 0 {
		err = io.EOF
	}
	if err == nil && (flags&unix.MSG_TRUNC != 0 || n > MaxMessage) {
		err = fmt.Errorf("wire: recv: %w (limit %d)", ErrTooLarge, MaxMessage)
	}
	if err == nil && flags&unix.MSG_CTRUNC != 0 {
		err = fmt.Errorf("wire: recv: %w: file descriptors truncated (limit %d)", ErrTooLarge, MaxFDs)
	}
	if err != nil {
		for _, f := range files {
			f.Close()
		}
		return nil, nil, err
	}
	return buf[:n], files, nil
}

// parseRights returns the fds of every SCM_RIGHTS message in oob as files.
func parseRights(oob []byte) ([]*os.File, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("wire: control message: %w", err)
	}
	var files []*os.File
	var ferr error
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			if ferr == nil {
				ferr = fmt.Errorf("wire: control message: %w", err)
			}
			continue
		}
		for _, fd := range fds {
			files = append(files, os.NewFile(uintptr(fd), "kvpool-fd"))
		}
	}
	return files, ferr
}
