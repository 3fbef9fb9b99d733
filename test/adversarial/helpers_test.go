package adversarial

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvpool/kvpool/pkg/wire"
)

// runHelper is this binary run as a helper process, for attacks that need
// a PID of their own. It reports on stdout and stops when stdin closes.
//
//	hold N     keep N connections open that never say hello, redialing
//	           those the agent closes; prints "held" once N were tried
//	redial N   keep N connections that say hello and never open, each
//	           dialed again the moment the agent closes it
//	owner      open a session (token, GPU 1, instance from the
//	           environment), offload stream "secret", print "ready"; on
//	           the stdin line "drop" close the connection, print "dropped"
func runHelper(role string) int {
	sock := os.Getenv("KVPOOL_SOCKET")
	stop := make(chan struct{})
	lines := make(chan string, 4)
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(stop)
	}()
	switch {
	case strings.HasPrefix(role, "hold "):
		n, _ := strconv.Atoi(strings.TrimPrefix(role, "hold "))
		conns := make([]*wire.Conn, n)
		for i := range conns {
			conns[i], _ = wire.Dial(sock)
		}
		fmt.Println("held")
		for {
			select {
			case <-stop:
				return 0
			case <-time.After(50 * time.Millisecond):
			}
			// Redial every connection the agent has closed.
			for i, c := range conns {
				if c != nil {
					c.SetReadDeadline(time.Now().Add(time.Millisecond))
					var b [64]byte
					if _, _, err := c.Recv(b[:]); err == nil || errors.Is(err, io.EOF) || !isTimeout(err) {
						c.Close()
						c = nil
					}
				}
				if c == nil {
					conns[i], _ = wire.Dial(sock)
				}
			}
		}
	case strings.HasPrefix(role, "redial "):
		// Connections that say hello and never open, each dialed again
		// the moment the agent closes it.
		n, _ := strconv.Atoi(strings.TrimPrefix(role, "redial "))
		for range n {
			go func() {
				for {
					c, err := wire.Dial(sock)
					if err != nil {
						time.Sleep(time.Millisecond)
						continue
					}
					pkt, _ := wire.AppendPacket(nil, wire.Header{Op: wire.OpHello, Seq: 1}, &wire.Hello{Version: wire.Version, Client: "squatter"})
					_ = c.Send(pkt, nil)
					var b [4096]byte
					for {
						if _, _, err := c.Recv(b[:]); err != nil {
							break
						}
					}
					c.Close()
				}
			}()
		}
		fmt.Println("redialing")
		<-stop
		return 0
	case role == "owner":
		c, err := wire.Dial(sock)
		if err != nil {
			fmt.Println("error", err)
			return 1
		}
		r := &raw{t: helperT{}, c: c, buf: make([]byte, wire.MaxMessage+1)}
		_, files := r.open(os.Getenv("KVPOOL_TOKEN"), 1, os.Getenv("KVPOOL_ADV_INSTANCE"), layout(64), 16)
		closeAll(files)
		var rep wire.OffloadReply
		if st, msg, _, _ := r.do(wire.OpOffload, &wire.Offload{Rid: "secret", Label: "k", GpuPages: []int32{1, 2, 3}}, &rep); st != 0 || !rep.Ok {
			fmt.Println("error offload", st, msg)
			return 1
		}
		fmt.Println("ready")
		for {
			select {
			case <-stop:
				return 0
			case l := <-lines:
				if l == "drop" {
					c.Close()
					fmt.Println("dropped")
				}
			}
		}
	}
	fmt.Println("unknown role", role)
	return 2
}

func isTimeout(err error) bool {
	var t interface{ Timeout() bool }
	return errors.As(err, &t) && t.Timeout()
}

// helperT lets the raw client run outside a test: a failure ends the
// helper process.
type helperT struct{ testing.TB }

func (helperT) Helper()                   {}
func (helperT) Cleanup(func())            {}
func (helperT) Fatal(args ...any)         { fmt.Println(append([]any{"error"}, args...)...); os.Exit(1) }
func (helperT) Fatalf(f string, a ...any) { fmt.Println("error", fmt.Sprintf(f, a...)); os.Exit(1) }

// helper is a running helper process.
type helper struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Scanner
}

func startHelper(t *testing.T, a *agentProc, role string, env ...string) *helper {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	h := &helper{cmd: exec.Command(exe)}
	h.cmd.Env = append([]string{"KVPOOL_ADV_ROLE=" + role, "KVPOOL_SOCKET=" + a.socket}, env...)
	if h.stdin, err = h.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	stdout, err := h.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	h.cmd.Stderr = os.Stderr
	h.out = bufio.NewScanner(stdout)
	if err := h.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.stop)
	return h
}

// expect reads the helper's next line and wants it to be want.
func (h *helper) expect(t *testing.T, want string) {
	t.Helper()
	got := make(chan string, 1)
	go func() {
		if h.out.Scan() {
			got <- h.out.Text()
		} else {
			got <- "(helper exited)"
		}
	}()
	select {
	case l := <-got:
		if l != want {
			t.Fatalf("helper said %q, want %q", l, want)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("helper silent, want %q", want)
	}
}

func (h *helper) say(t *testing.T, line string) {
	t.Helper()
	if _, err := fmt.Fprintln(h.stdin, line); err != nil {
		t.Fatal(err)
	}
}

func (h *helper) stop() {
	h.stdin.Close()
	done := make(chan struct{})
	go func() { h.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		h.cmd.Process.Kill()
		<-done
	}
}
