package unixsock

import (
	"bytes"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

// referenceRights parses oob with golang.org/x/sys/unix, accepting only
// what ParseRights must accept: SCM_RIGHTS messages of whole, non-negative
// descriptors.
func referenceRights(oob []byte) ([]int, bool) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, false
	}
	var fds []int
	for i := range msgs {
		if len(msgs[i].Data)%4 != 0 {
			return nil, false
		}
		got, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			return nil, false
		}
		for _, fd := range got {
			if fd < 0 {
				return nil, false
			}
		}
		fds = append(fds, got...)
	}
	return fds, true
}

// FuzzParseRights: whatever the bytes, ParseRights does not panic and
// returns only non-negative descriptors; what it accepts, x/sys/unix's
// parser reads as the same descriptors; what x/sys reads as SCM_RIGHTS
// messages alone, with no bytes left over, ParseRights accepts alike; and
// the descriptors it returns, encoded again, parse back to themselves.
func FuzzParseRights(f *testing.F) {
	f.Add([]byte{})
	f.Add(unix.UnixRights(3))
	f.Add(unix.UnixRights(3, 4, 5))
	f.Add(slices.Concat(unix.UnixRights(3), unix.UnixRights(7, 8)))
	f.Add(unix.UnixRights(3)[:unix.CmsgLen(4)])
	f.Add(unix.UnixCredentials(&unix.Ucred{Pid: 1, Uid: 2, Gid: 3}))
	f.Add(slices.Concat(unix.UnixRights(3), unix.UnixCredentials(&unix.Ucred{}), unix.UnixRights(9)))
	f.Add(unix.UnixRights(3, 4)[:20])
	f.Add(append(unix.UnixRights(3), 1, 2, 3))
	f.Fuzz(func(t *testing.T, oob []byte) {
		fds, err := ParseRights(oob)
		for _, fd := range fds {
			if fd < 0 {
				t.Fatalf("negative descriptor %d", fd)
			}
		}
		ref, refOK := referenceRights(oob)
		if err == nil {
			if !refOK || !slices.Equal(fds, ref) {
				t.Fatalf("accepted %v; x/sys reads %v (ok %v)", fds, ref, refOK)
			}
		}
		if refOK && len(oob) >= unix.CmsgLen(0) {
			msgs, _ := unix.ParseSocketControlMessage(oob)
			var canon []byte
			for _, m := range msgs {
				fs, _ := unix.ParseUnixRights(&m)
				canon = append(canon, unix.UnixRights(fs...)...)
			}
			if bytes.Equal(canon, oob) && (err != nil || !slices.Equal(fds, ref)) {
				t.Fatalf("refused well-formed rights %v: %v, %v", ref, fds, err)
			}
		}
		if len(fds) > 0 {
			again, err := ParseRights(unix.UnixRights(fds...))
			if err != nil || !slices.Equal(again, fds) {
				t.Fatalf("re-encoded %v parse to %v, %v", fds, again, err)
			}
		}
	})
}
