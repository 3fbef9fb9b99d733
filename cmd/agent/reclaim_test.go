package main

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvpool/kvpool/internal/sizing"
	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/wire"
)

// tenantMain is a hostile tenant (the test binary re-executed with
// KVPOOL_TEST_TENANT=1): it opens a session on GPU 1 with the raw protocol,
// maps every chunk it is given and keeps the mappings and the fds. It prints
// "open <chunks> <resize outcomes>" after trying to shrink and grow its
// chunks, then obeys stdin: "fill B" writes byte B everywhere, "check"
// prints "own N foreign M": bytes equal to its last fill, and bytes that are
// neither that nor zero.
func tenantMain() int {
	fail := func(err error) int { fmt.Println("error", err); return 1 }
	wc, err := wire.Dial(os.Getenv("KVPOOL_SOCKET"))
	if err != nil {
		return fail(err)
	}
	buf := make([]byte, wire.MaxMessage+1)
	send := func(op wire.Op, seq uint32, req proto.Message) ([]byte, []*os.File, error) {
		pkt, err := wire.AppendPacket(nil, wire.Header{Op: op, Seq: seq}, req)
		if err != nil {
			return nil, nil, err
		}
		if err := wc.Send(pkt, nil); err != nil {
			return nil, nil, err
		}
		in, files, err := wc.Recv(buf)
		if err != nil {
			return nil, nil, err
		}
		h, body, err := wire.ParseHeader(in)
		if err == nil && h.Status != wire.StatusOK {
			err = fmt.Errorf("%s: %s", op, h.Status)
		}
		return body, files, err
	}
	if _, _, err := send(wire.OpHello, 1, &wire.Hello{Version: wire.Version, Client: "hostile-tenant"}); err != nil {
		return fail(err)
	}
	body, files, err := send(wire.OpOpen, 2, &wire.Open{Token: os.Getenv("KVPOOL_TOKEN"), GpuUuid: cudart.SimulatedUUID(1), InstanceId: client.InstanceID(),
		Regions: []*wire.Region{{BytesPerPage: 4096, PageCount: 64}}})
	if err != nil {
		return fail(err)
	}
	var rep wire.OpenReply
	if err := wire.DecodeBody(body, &rep); err != nil {
		return fail(err)
	}
	var mems [][]byte
	outcome := func(err error) string {
		if err == nil {
			return "ok"
		}
		return unix.ErrnoName(err.(unix.Errno))
	}
	var res []string
	for i, f := range files {
		size := int64(rep.Chunks[i].Size)
		fd := int(f.Fd())
		res = append(res, outcome(unix.Ftruncate(fd, 0)), outcome(unix.Ftruncate(fd, size+1<<30)), outcome(unix.Fallocate(fd, 0, size, 256<<20)))
		m, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			return fail(err)
		}
		mems = append(mems, m)
	}
	fmt.Println("open", len(files), strings.Join(res, ","))
	var fill byte
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		cmd, arg, _ := strings.Cut(sc.Text(), " ")
		switch cmd {
		case "fill":
			n, _ := strconv.Atoi(arg)
			fill = byte(n)
			for _, m := range mems {
				for i := range m {
					m[i] = fill
				}
			}
			fmt.Println("filled")
		case "check":
			own, foreign := 0, 0
			for _, m := range mems {
				for _, b := range m {
					switch {
					case b == fill && b != 0:
						own++
					case b != 0:
						foreign++
					}
				}
			}
			fmt.Println("own", own, "foreign", foreign)
		}
	}
	return 0
}

// tenant drives a tenantMain process.
type tenant struct {
	t   *testing.T
	in  io.WriteCloser
	out *bufio.Scanner
}

func startTenant(t *testing.T, socket, token string) (*tenant, string) {
	t.Helper()
	exe, _ := os.Executable()
	cmd := exec.Command(exe)
	cmd.Env = []string{"KVPOOL_TEST_TENANT=1", "KVPOOL_SOCKET=" + socket, "KVPOOL_TOKEN=" + token}
	in, _ := cmd.StdinPipe()
	outp, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); cmd.Process.Kill(); cmd.Wait() })
	tn := &tenant{t: t, in: in, out: bufio.NewScanner(outp)}
	return tn, tn.line()
}

func (tn *tenant) line() string {
	tn.t.Helper()
	if !tn.out.Scan() {
		tn.t.Fatalf("tenant ended: %v", tn.out.Err())
	}
	return tn.out.Text()
}

func (tn *tenant) do(cmd string) string {
	tn.t.Helper()
	fmt.Fprintln(tn.in, cmd)
	return tn.line()
}

// A hostile tenant tries to resize its chunks (refused by the seals), fills
// them and keeps its mappings and fds after its pod is gone. The agent
// reclaims the chunks without touching them, drops them and puts fresh
// memory behind the same device IDs, keeping the device list at its size
// (unhealthy meanwhile). The old tenant's mappings lose their pages and
// never see the next tenant's bytes, nor the other way round; the agent
// keeps serving.
func TestReclaimRenewsChunksAgainstHostileTenant(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	n := newTestNode(t)
	root, kdir, sockDir, k, prs := n.root, n.kubelet, n.sock, n.k, n.prs
	a := spawnAgent(t, []string{"NODE_NAME=node-a", "KVPOOL_LOG_FORMAT=json"},
		"--simulate-gpus", "2", "--kubelet-dir", kdir, "--socket-dir", sockDir, "--state-dir", filepath.Join(root, "state"),
		"--pool-bytes", "256Mi", "--chunk-bytes", "32Mi", "--reserve-bytes", "64Mi", "--huge-pages", "never",
		"--metrics-address", "127.0.0.1:0", "--health-address", "127.0.0.1:0",
		"--reclaim-interval", "100ms", "--reclaim-grace-period", "300ms", "--token-binding", "none")
	k.WaitRegister(20 * time.Second)
	var shrunk atomic.Int32 // device lists of another size than 8
	allHealthy := func(l []*pluginapi.Device) bool {
		if len(l) != 8 {
			shrunk.Add(1)
			return false
		}
		for _, d := range l {
			if d.Health != pluginapi.Healthy {
				return false
			}
		}
		return true
	}
	k.WaitList(allHealthy)
	health, metricsAddr := waitReady(t, a)
	var ids []string
	for _, l := range a.log.all("pool plan gpu") {
		if l["gpu"] == float64(1) {
			g := sizing.GPUPlan{GPU: 1, NUMA: int(l["numa"].(float64)), Chunks: int(l["chunks"].(float64))}
			ids = g.ChunkIDs()[:2]
		}
	}
	if len(ids) != 2 {
		t.Fatal("no plan for GPU 1 in the log")
	}
	hostSock := filepath.Join(sockDir, contract.SocketFile)
	res := contract.DefaultResourceName

	respA, err := allocate(t, k, ids...)
	if err != nil {
		t.Fatal(err)
	}
	prs.SetPods(map[string]map[string][]string{"a": {res: ids}})
	a.log.wait(t, "allocation held by pod", map[string]any{"pod": "default/a"})
	tenantA, opened := startTenant(t, hostSock, respA.Envs[contract.EnvToken])
	if opened != "open 2 EPERM,EPERM,EPERM,EPERM,EPERM,EPERM" {
		t.Fatalf("tenant A: %q (want 2 chunks, every shrink and growth refused)", opened)
	}
	if got := tenantA.do("fill 170"); got != "filled" {
		t.Fatal(got)
	}
	full := fmt.Sprintf("own %d foreign 0", 2*32<<20)
	if got := tenantA.do("check"); got != full {
		t.Fatalf("tenant A after its fill: %q, want %q", got, full)
	}

	// Pod a goes away; its tenant process keeps its mappings and fds.
	shrunk.Store(0) // lists before the pool was full do not count
	prs.SetPods(nil)
	for _, id := range ids {
		a.log.wait(t, "chunk renewed", map[string]any{"chunk": id})
	}
	k.WaitList(allHealthy)
	if n := shrunk.Load(); n != 0 {
		t.Errorf("%d device lists without all 8 chunks during the renewal", n)
	}
	if got := tenantA.do("check"); got != "own 0 foreign 0" {
		t.Errorf("tenant A's kept mappings after reclaim: %q, want every page released (zeros)", got)
	}
	resp, err := http.Get("http://" + health + "/livez")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("agent not live after the reclaim: %v %v", err, resp)
	}
	resp.Body.Close()

	// The same devices go to pod b.
	respB, err := allocate(t, k, ids...)
	if err != nil {
		t.Fatal(err)
	}
	if respB.Envs[contract.EnvToken] == respA.Envs[contract.EnvToken] {
		t.Fatal("pod b got pod a's token")
	}
	prs.SetPods(map[string]map[string][]string{"b": {res: ids}})
	tenantB, opened := startTenant(t, hostSock, respB.Envs[contract.EnvToken])
	if !strings.HasPrefix(opened, "open 2 ") {
		t.Fatalf("tenant B: %q", opened)
	}
	if got := tenantB.do("check"); got != "own 0 foreign 0" {
		t.Errorf("tenant B's fresh chunks: %q, want all zero", got)
	}
	tenantB.do("fill 187")
	if got := tenantA.do("check"); got != "own 0 foreign 0" {
		t.Errorf("tenant A sees tenant B's bytes: %q", got)
	}
	tenantA.do("fill 170")
	if got := tenantB.do("check"); got != full {
		t.Errorf("tenant B after tenant A wrote its old mappings: %q, want %q", got, full)
	}

	// Old tokens are dead.
	if _, opened := startTenant(t, hostSock, respA.Envs[contract.EnvToken]); !strings.Contains(opened, "unauthorized") {
		t.Errorf("tenant A's old token: %q, want unauthorized", opened)
	}
	mresp, err := http.Get("http://" + metricsAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	if !regexp.MustCompile(`(?m)^kvpool_chunk_renew_seconds_count\{gpu="1"\} 2$`).Match(body) {
		t.Errorf("metrics lack two renewals on GPU 1:\n%s", grepLines(string(body), "renew"))
	}
	for _, l := range a.log.all("chunk renewed") {
		if ns, ok := l["took"].(float64); ok {
			t.Logf("renewed %v (32Mi) in %v", l["chunk"], time.Duration(ns))
		}
	}
	a.stop(t)
}

// In cluster mode (tokenBinding pod, the default) a token works only from a
// process in the pod that holds its allocation: this test's tenant process
// is in no pod, so its valid token is refused, and the refusal says why.
func TestClusterModeTokenBoundToPod(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	n := newTestNode(t)
	root, kdir, sockDir, k, prs := n.root, n.kubelet, n.sock, n.k, n.prs
	a := spawnAgent(t, []string{"NODE_NAME=node-a", "KVPOOL_LOG_FORMAT=json"},
		"--simulate-gpus", "2", "--kubelet-dir", kdir, "--socket-dir", sockDir, "--state-dir", filepath.Join(root, "state"),
		"--pool-bytes", "128Mi", "--chunk-bytes", "32Mi", "--reserve-bytes", "64Mi", "--huge-pages", "never",
		"--metrics-address", "", "--health-address", "127.0.0.1:0", "--pod-logs-dir", filepath.Join(root, "pods"))
	k.WaitRegister(20 * time.Second)
	waitReady(t, a)
	var ids []string
	for _, l := range a.log.all("pool plan gpu") {
		if l["gpu"] == float64(1) {
			g := sizing.GPUPlan{GPU: 1, NUMA: int(l["numa"].(float64)), Chunks: int(l["chunks"].(float64))}
			ids = g.ChunkIDs()
		}
	}
	k.WaitList(func(l []*pluginapi.Device) bool { return len(l) == 4 })
	resp, err := allocate(t, k, ids...)
	if err != nil {
		t.Fatal(err)
	}
	prs.SetPods(map[string]map[string][]string{"a": {contract.DefaultResourceName: ids}})
	_, opened := startTenant(t, filepath.Join(sockDir, contract.SocketFile), resp.Envs[contract.EnvToken])
	if !strings.Contains(opened, "unauthorized") {
		t.Errorf("tenant outside any pod: %q, want unauthorized", opened)
	}
	a.log.wait(t, "token refused", nil)
	if l := a.log.find("token refused", nil); l == nil || !strings.Contains(fmt.Sprint(l["err"]), "not in a Kubernetes pod") {
		t.Errorf("refusal logged as %v, want the reason (not in a Kubernetes pod)", l)
	}
	a.stop(t)
}
