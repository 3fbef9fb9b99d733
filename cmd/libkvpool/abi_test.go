package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	stdsync "sync"
	"testing"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/standalone"
	"github.com/kvpool/kvpool/pkg/wire"
)

// TestCProgram builds libkvpool.so (without -race: a c-shared library
// cannot have it), compiles testdata/smoke.c against kvpool.h with -Wall
// -Werror, and runs it against an in-process agent: the ABI as a C engine
// sees it, every function of the header linked and called.
func TestCProgram(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds the shared library")
	}
	cc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("no gcc to compile the C program")
	}
	dir := t.TempDir()
	lib := filepath.Join(dir, "libkvpool.so")
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command to build the library")
	}
	build := exec.Command(gobin, "build", "-buildmode=c-shared", "-o", lib, ".")
	build.Env = append(os.Environ(), "GOFLAGS=")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	prog := filepath.Join(dir, "smoke")
	for _, std := range []string{"-std=c11", "-std=c99"} {
		cmd := exec.Command(cc, std, "-Wall", "-Wextra", "-Werror", "-pthread", "-I.", "-o", prog, "testdata/smoke.c", "-L"+dir, "-lkvpool", "-Wl,-rpath,"+dir)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("compile smoke.c %s: %v\n%s", std, err, out)
		}
	}
	// The header is C++ too.
	if cxx, err := exec.LookPath("g++"); err == nil {
		src := filepath.Join(dir, "h.cc")
		os.WriteFile(src, []byte("#include \"kvpool.h\"\nint main() { kvpool_options o{}; o.struct_size = sizeof o; o.backend = \"sim\"; return kvpool_abi_version() == KVPOOL_ABI_VERSION ? 0 : 1; }\n"), 0o644)
		cmd := exec.Command(cxx, "-Wall", "-Werror", "-I.", "-o", filepath.Join(dir, "hcc"), src, "-L"+dir, "-lkvpool", "-Wl,-rpath,"+dir)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("compile as C++: %v\n%s", err, out)
		}
		if out, err := exec.Command(filepath.Join(dir, "hcc")).CombinedOutput(); err != nil {
			t.Fatalf("C++ program: %v\n%s", err, out)
		}
	}

	var mu stdsync.Mutex
	var opened []int
	a, err := standalone.Start(standalone.Config{GPUs: 2, ChunksPerGPU: 1, ChunkBytes: 4 << 20, Tokens: []string{"c-abi"},
		Socket: filepath.Join(dir, "kv.sock"), Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Hooks: server.Hooks{Session: func(ev server.SessionEvent, info server.SessionInfo) {
			if ev == server.SessionOpened {
				mu.Lock()
				opened = append(opened, info.GPU)
				mu.Unlock()
			}
		}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	defer func() { cancel(); <-done; a.Close() }()
	// Outside a container the simulator's device 0 is the agent's GPU 0; in
	// a container given GPU 1 (NVIDIA_VISIBLE_DEVICES), device 0 is GPU 1.
	for _, c := range []struct {
		env  []string
		want int
	}{{nil, 0}, {[]string{cudart.EnvNVIDIAVisible + "=" + cudart.SimulatedUUID(1)}, 1}} {
		mu.Lock()
		opened = nil
		mu.Unlock()
		run := exec.Command(prog)
		run.Env = append(append(os.Environ(), "KVPOOL_SOCKET="+a.Socket, "KVPOOL_TOKEN=c-abi"), c.env...)
		out, err := run.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "C ABI: OK") {
			t.Fatalf("smoke %v: %v\n%s", c.env, err, out)
		}
		mu.Lock()
		for _, g := range opened {
			if g != c.want {
				t.Errorf("smoke %v: a session opened on host GPU %d, want %d (%v)", c.env, g, c.want, opened)
			}
		}
		if len(opened) == 0 {
			t.Errorf("smoke %v: no session opened", c.env)
		}
		mu.Unlock()
	}
}

func TestSpansOf(t *testing.T) {
	// Regions that overlap (K and V interleaved in one tensor) register as
	// one range; separate tensors as their own.
	rs := []struct{ base, stride, page, pages uint64 }{{0x1000, 64, 32, 4}, {0x1020, 64, 32, 4}, {0x9000, 16, 16, 2}}
	var regions []regionArg
	for _, r := range rs {
		regions = append(regions, regionArg(r))
	}
	got, err := spansOf(0, toRegions(regions))
	if err != nil {
		t.Fatal(err)
	}
	want := []span{{0, 0x1000, 3*64 + 32 + 32}, {0, 0x9000, 32}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("spans %+v, want %+v", got, want)
	}
	if _, err := spansOf(0, toRegions([]regionArg{{0x1000, 8, 16, 2}})); err == nil {
		t.Fatal("a stride below the page size was accepted")
	}
}

// regionArg and toRegions let tests build regions without the C types.
type regionArg struct{ base, stride, page, pages uint64 }

func toRegions(rs []regionArg) []cudart.Region {
	out := make([]cudart.Region, len(rs))
	for i, r := range rs {
		out[i] = cudart.Region{Base: cudart.DevicePtr(r.base), Stride: r.stride, PageBytes: r.page, Pages: int(r.pages)}
	}
	return out
}

// The kvpool.h codes follow the wire status, one hop from pkg/wire's table:
// a refusal by its status, a pool error raised on this side like the
// refusal of the same meaning, a status of a newer agent KVPOOL_ERR_OTHER.
func TestStatusCodes(t *testing.T) {
	want := map[wire.Status]int{
		wire.StatusUnknownStream: errUnknownStream, wire.StatusDuplicateStream: errDuplicateStream,
		wire.StatusPageCount: errPageCount, wire.StatusOutOfRange: errOutOfRange,
		wire.StatusDuplicateIndex: errDuplicateIndex, wire.StatusBadName: errBadName,
		wire.StatusBadSize: errBadSize, wire.StatusClosed: errClosed, wire.StatusUnauthorized: errUnauthorized,
		wire.StatusBusy: errBusy, wire.StatusNoCapacity: errNoCapacity,
	}
	for _, st := range append(wire.Statuses(), 29) {
		if st == wire.StatusOK {
			continue
		}
		code, ok := want[st]
		if !ok {
			code = errOther
		}
		if got := int(statusOf(&client.Error{Op: wire.OpReload, Status: st})); got != code {
			t.Errorf("refusal %s: code %d, want %d", st, got, code)
		}
		if pe := wire.ErrorOf(st); pe != nil {
			if got := int(statusOf(fmt.Errorf("kvpool: local check: %w", pe))); got != code {
				t.Errorf("local %v: code %d, want %d", pe, got, code)
			}
		}
	}
	for err, code := range map[error]int{
		client.ErrDisconnected: errDisconnected, client.ErrProtocol: errProtocol,
		&cudart.Error{Call: "cuMemcpyBatchAsync", Name: "CUDA_ERROR_INVALID_VALUE"}: errCUDA, errors.New("something else"): errOther,
	} {
		if got := int(statusOf(fmt.Errorf("kvpool: %w", err))); got != code {
			t.Errorf("%v: code %d, want %d", err, got, code)
		}
	}
}
