// Package python holds the Python client (kvpool, over libkvpool.so) and
// the Go tests that run its pytest suite (pytest_test.go) and check the Go
// client against the same golden vectors (this file).
package python

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/poolerr"
	"github.com/kvpool/kvpool/pkg/standalone"
)

type golden struct {
	Layouts []struct {
		Name        string `json:"name"`
		BufferBytes int    `json:"buffer_bytes"`
		Regions     []struct {
			Offset    uint64 `json:"offset"`
			Stride    uint64 `json:"stride"`
			PageBytes uint64 `json:"page_bytes"`
			Pages     int    `json:"pages"`
		} `json:"regions"`
	} `json:"layouts"`
	Scenario struct {
		Layout   string     `json:"layout"`
		MaxPages int        `json:"max_pages"`
		Ops      []goldenOp `json:"ops"`
		SHA256   string     `json:"sha256"`
	} `json:"scenario"`
}

type goldenOp struct {
	Op        string          `json:"op"`
	Rid       string          `json:"rid"`
	Label     string          `json:"label"`
	Pages     []int32         `json:"pages"`
	StoredLen int64           `json:"stored_len"`
	Position  int64           `json:"position"`
	Released  int64           `json:"released"`
	Byte      byte            `json:"byte"`
	Want      json.RawMessage `json:"want"`
	Error     string          `json:"error"`
}

var goldenErrors = map[string]error{
	"duplicate_stream": poolerr.ErrDuplicateStream,
	"unknown_stream":   poolerr.ErrUnknownStream,
	"out_of_range":     poolerr.ErrOutOfRange,
	"page_count":       poolerr.ErrPageCount,
}

// seedPool gives the Go client the seed engine's readings where the seed's
// doc is silent (docs/python.md): discard and num_pages of an unknown
// stream, an offload of zero pages. The Python layer does the same.
type seedPool struct{ *client.CPUPagePool }

func (p seedPool) discard(rid, label string) error {
	if err := p.Discard(rid, label); err != nil && !errors.Is(err, poolerr.ErrUnknownStream) {
		return err
	}
	return nil
}

func (p seedPool) numPages(rid, label string) (int, error) {
	n, err := p.NumPages(rid, label)
	if errors.Is(err, poolerr.ErrUnknownStream) {
		return 0, nil
	}
	return n, err
}

func (p seedPool) offload(o goldenOp) (bool, error) {
	if len(o.Pages) == 0 {
		return false, nil
	}
	return p.OffloadStream(o.Rid, o.Label, o.Pages, o.StoredLen, o.Position, o.Released)
}

// TestGoldenScenarioGoClient runs testdata/golden.json's scenario on the Go
// client over the simulator and an in-process agent: the outcomes and the
// final device bytes must be the ones the Python suite checks too.
func TestGoldenScenarioGoClient(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("testdata", "golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	var g golden
	if err := json.Unmarshal(raw, &g); err != nil {
		t.Fatal(err)
	}
	sc := g.Scenario
	var regions []cudart.Region
	var bufBytes int
	dev, err := cudart.NewSim(cudart.SimOptions{CopyDelay: 500e3}).Open(0)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	for _, l := range g.Layouts {
		if l.Name != sc.Layout {
			continue
		}
		bufBytes = l.BufferBytes
		base, err := dev.MemAlloc(uint64(bufBytes))
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range l.Regions {
			regions = append(regions, cudart.Region{Base: base + cudart.DevicePtr(r.Offset), Stride: r.Stride, PageBytes: r.PageBytes, Pages: r.Pages})
		}
	}
	if regions == nil {
		t.Fatalf("scenario layout %q is not among the layouts", sc.Layout)
	}
	base := regions[0].Base
	buf := make([]byte, bufBytes)
	for i := range buf {
		buf[i] = byte(i*7 + i/251)
	}
	if err := dev.MemcpyHtoD(base, buf); err != nil {
		t.Fatal(err)
	}

	a, err := standalone.Start(standalone.Config{GPUs: 1, ChunksPerGPU: 1, ChunkBytes: 4 << 20, Tokens: []string{"golden"},
		Socket: filepath.Join(t.TempDir(), "kv.sock"), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	defer func() { cancel(); <-done; a.Close() }()
	cp, err := client.Open(ctx, client.Options{Socket: a.Socket, Token: "golden", Device: dev, Regions: regions, MaxPages: sc.MaxPages})
	if err != nil {
		t.Fatal(err)
	}
	defer cp.Close()
	p := seedPool{cp}

	for k, o := range sc.Ops {
		var got any
		var err error
		switch o.Op {
		case "offload":
			got, err = p.offload(o)
		case "reload":
			var st client.OffloadedStream
			st, err = p.ReloadStream(o.Rid, o.Label, o.Pages)
			got = map[string]any{"stored_len": float64(st.StoredLen), "position": float64(st.Position),
				"released": float64(st.Released), "num_pages": float64(len(st.CPUPageIndices))}
		case "discard":
			err = p.discard(o.Rid, o.Label)
		case "remove_request":
			err = p.RemoveRequest(o.Rid)
		case "num_pages":
			var n int
			n, err = p.numPages(o.Rid, o.Label)
			got = float64(n)
		case "labels":
			var ls []string
			ls, err = p.Labels(o.Rid)
			l := make([]any, len(ls))
			for i, s := range ls {
				l[i] = s
			}
			got = l
		case "is_offloaded":
			got, err = p.IsOffloaded(o.Rid)
		case "num_free_pages":
			var n int
			n, err = p.NumFreePages()
			got = float64(n)
		case "synchronize":
			err = p.Synchronize()
		case "poison":
			for _, r := range regions {
				for _, pg := range o.Pages {
					poison := make([]byte, r.PageBytes)
					for i := range poison {
						poison[i] = o.Byte
					}
					if err := dev.MemcpyHtoD(r.Base+cudart.DevicePtr(uint64(pg)*r.Stride), poison); err != nil {
						t.Fatal(err)
					}
				}
			}
		default:
			t.Fatalf("op %d: unknown op %q", k, o.Op)
		}
		if o.Error != "" {
			if !errors.Is(err, goldenErrors[o.Error]) {
				t.Fatalf("op %d %+v: got error %v, want %s", k, o, err, o.Error)
			}
			continue
		}
		if err != nil {
			t.Fatalf("op %d %+v: %v", k, o, err)
		}
		if o.Want != nil {
			var want any
			if err := json.Unmarshal(o.Want, &want); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("op %d %+v: got %v, want %v", k, o, got, want)
			}
		}
	}
	if err := p.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if err := dev.MemcpyDtoH(buf, base); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(buf)
	if got := hex.EncodeToString(sum[:]); got != sc.SHA256 {
		t.Fatalf("device bytes after the scenario: sha256 %s, golden %s", got, sc.SHA256)
	}
}
