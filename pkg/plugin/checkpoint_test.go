package plugin

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/pool"
)

func sampleRecords() []Record {
	t0 := time.Date(2026, 11, 29, 8, 0, 0, 0, time.UTC)
	return []Record{
		{Token: contract.NewToken(), Devices: []string{"gpu0-numa0-0", "gpu0-numa0-1"}, FirstSeen: t0, Pod: "ns/a"},
		{Token: contract.NewToken(), Devices: []string{"gpu1-numaX-3"}, FirstSeen: t0.Add(time.Second)},
	}
}

func TestCheckpointRoundTrip(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	if recs, err := LoadCheckpoint(dir); err != nil || recs != nil {
		t.Fatalf("missing checkpoint: %v, %v", recs, err)
	}
	want := sampleRecords()
	if err := SaveCheckpoint(dir, want); err != nil {
		t.Fatal(err)
	}
	got, err := LoadCheckpoint(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.EqualFunc(got, want, func(a, b Record) bool {
		return a.Token == b.Token && slices.Equal(a.Devices, b.Devices) && a.FirstSeen.Equal(b.FirstSeen) && a.Pod == b.Pod
	}) {
		t.Errorf("got %+v, want %+v", got, want)
	}
	if fi, err := os.Stat(filepath.Join(dir, CheckpointFile)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("checkpoint file mode: %v, %v", fi, err)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "*.tmp-*")); len(left) != 0 {
		t.Errorf("temporary files left: %v", left)
	}
	if err := SaveCheckpoint(dir, nil); err != nil {
		t.Fatal(err)
	}
	if got, err := LoadCheckpoint(dir); err != nil || len(got) != 0 {
		t.Errorf("empty checkpoint: %v, %v", got, err)
	}
	// Nothing allocated leaves nothing in the directory (an uninstalled
	// agent leaves no state behind).
	if left, _ := os.ReadDir(dir); len(left) != 0 {
		t.Errorf("an empty checkpoint left files: %v", left)
	}
	if err := SaveCheckpoint(dir, nil); err != nil {
		t.Errorf("saving an empty checkpoint twice: %v", err)
	}
}

func TestDecodeCheckpointRejects(t *testing.T) {
	good, err := EncodeCheckpoint(sampleRecords())
	if err != nil {
		t.Fatal(err)
	}
	recs := sampleRecords()
	enc := func(edit func([]Record)) []byte {
		r := slices.Clone(recs)
		for i := range r {
			r[i].Devices = slices.Clone(r[i].Devices)
		}
		edit(r)
		b, err := EncodeCheckpoint(r)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	cases := []struct {
		name string
		data []byte
		want string
	}{
		{"empty", nil, "EOF"},
		{"truncated", good[:len(good)/2], "unexpected EOF"},
		{"not json", []byte("\x00\x01garbage"), "invalid character"},
		{"trailing data", append(slices.Clone(good), "{}"...), "trailing data"},
		{"unknown field", []byte(`{"version":1,"checksum":"","records":[],"extra":1}`), "unknown field"},
		{"no version", []byte(strings.Replace(string(good), `"version": 3`, `"version": 0`, 1)), "version 0"},
		{"negative version", []byte(strings.Replace(string(good), `"version": 3`, `"version": -1`, 1)), "version -1"},
		// The version is under the checksum: a damaged version number is
		// corruption, whether it reads older or newer.
		{"version damaged down", []byte(strings.Replace(string(good), `"version": 3`, `"version": 2`, 1)), "checksum mismatch"},
		{"version damaged up", []byte(strings.Replace(string(good), `"version": 3`, `"version": 4`, 1)), "checksum mismatch"},
		{"checksum", []byte(strings.Replace(string(good), "gpu0-numa0-1", "gpu0-numa0-2", 1)), "checksum mismatch"},
		{"records not a list", []byte(`{"version":1,"checksum":"44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a","records":{}}`), "records"},
		{"bad token", enc(func(r []Record) { r[0].Token = "short" }), "malformed token"},
		{"repeated token", enc(func(r []Record) { r[1].Token = r[0].Token }), "token repeated"},
		{"no devices", enc(func(r []Record) { r[1].Devices = nil }), "empty or unsorted"},
		{"unsorted devices", enc(func(r []Record) { slices.Reverse(r[0].Devices) }), "empty or unsorted"},
		{"empty device", enc(func(r []Record) { r[1].Devices = []string{""} }), "empty device ID"},
		{"device in two allocations", enc(func(r []Record) { r[1].Devices = []string{"gpu0-numa0-1"} }), "held by two allocations"},
		{"claim without a UID", enc(func(r []Record) { r[1].Claim = &ClaimRef{Namespace: "ns", Name: "c", Request: "kv"} }), "claim without a UID"},
		{"claim UID not a UID", enc(func(r []Record) { r[1].Claim = &ClaimRef{UID: "../etc", Namespace: "ns", Name: "c", Request: "kv"} }), "claim without a UID"},
		{"claim without a request", enc(func(r []Record) { r[1].Claim = &ClaimRef{UID: claimA, Namespace: "ns", Name: "c"} }), "or request"},
		{"claim with a pod", enc(func(r []Record) { r[0].Claim = &ClaimRef{UID: claimA, Namespace: "ns", Name: "c", Request: "kv"} }), "names a device plugin pod"},
		{"claim request twice", enc(func(r []Record) {
			r[0].Pod = ""
			r[0].Claim = &ClaimRef{UID: claimA, Namespace: "ns", Name: "c", Request: "kv"}
			r[1].Claim = &ClaimRef{UID: claimA, Namespace: "ns", Name: "c", Request: "kv"}
		}), "prepared twice"},
		{"claim pod UID", enc(func(r []Record) {
			r[1].Claim = &ClaimRef{UID: claimA, Namespace: "ns", Name: "c", Request: "kv", PodUIDs: []string{"x"}}
		}), "pod UID"},
		{"claim share of nothing", enc(func(r []Record) {
			r[1].Claim = &ClaimRef{UID: claimA, Namespace: "ns", Name: "c", Request: "kv", Shares: []Share{{GPU: 1, Chunks: 0}}}
		}), "share"},
		{"claim picked too few", enc(func(r []Record) {
			r[1].Claim = &ClaimRef{UID: claimA, Namespace: "ns", Name: "c", Request: "kv", Shares: []Share{{GPU: 1, Chunks: 2}}, Picked: []string{"gpu1-numaX-3"}}
		}), "1 picked chunks for shares of 2"},
		{"claim picked elsewhere", enc(func(r []Record) {
			r[1].Claim = &ClaimRef{UID: claimA, Namespace: "ns", Name: "c", Request: "kv", Shares: []Share{{GPU: 1, Chunks: 1}}, Picked: []string{"gpu1-numaX-4"}}
		}), "not among the devices"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := DecodeCheckpoint(c.data)
			if !errors.Is(err, ErrCorruptCheckpoint) || !strings.Contains(err.Error(), c.want) {
				t.Errorf("err = %v, want ErrCorruptCheckpoint containing %q", err, c.want)
			}
			if got != nil {
				t.Errorf("records returned with the error: %v", got)
			}
		})
	}
}

func TestSaveCheckpointErrors(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	os.WriteFile(file, nil, 0o600)
	if err := SaveCheckpoint(file, sampleRecords()); err == nil || !strings.Contains(err.Error(), "save checkpoint") {
		t.Errorf("save under a file: %v", err)
	}
	// An unreadable checkpoint (a directory in its place) is an error, not
	// corruption: the plugin must not quarantine what it cannot read.
	bad := filepath.Join(dir, "bad")
	os.MkdirAll(filepath.Join(bad, CheckpointFile), 0o700)
	if _, err := LoadCheckpoint(bad); err == nil || errors.Is(err, ErrCorruptCheckpoint) {
		t.Errorf("load of a directory: %v", err)
	}
}

func TestFeedSetRejects(t *testing.T) {
	f := NewFeed()
	f.Set([]Device{{ID: "a", Healthy: true}})
	before, ch := f.Devices()
	for _, bad := range [][]Device{{{ID: ""}}, {{ID: "x"}, {ID: "x"}}} {
		if err := f.Set(bad); err == nil {
			t.Errorf("Set(%v) accepted", bad)
		}
	}
	if err := f.Set([]Device{{ID: "a", Healthy: true}}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ch:
		t.Error("a rejected or identical snapshot woke the watchers")
	default:
	}
	if now, _ := f.Devices(); !slices.Equal(now, before) {
		t.Errorf("snapshot changed to %v", now)
	}
}

// A checkpoint over the size limit is not read into memory: it is corrupt,
// and New moves it aside and starts empty.
func TestCheckpointSizeLimit(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, CheckpointFile)
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	// Sparse: MaxCheckpointBytes+1 bytes without writing them.
	if err := f.Truncate(MaxCheckpointBytes + 1); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if _, err := LoadCheckpoint(dir); !errors.Is(err, ErrCorruptCheckpoint) || !strings.Contains(err.Error(), "larger than") {
		t.Fatalf("oversized checkpoint: %v", err)
	}
	p, err := New(Options{Pool: pool.New(), Devices: NewFeed(), Renew: func(string) error { return nil },
		KubeletDir: dir, SocketDir: "/run/kvp", StateDir: dir, Interval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Allocations()) != 0 {
		t.Error("allocations from an oversized checkpoint")
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("oversized checkpoint left in place: %v", err)
	}
}
