package plugin

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvpool/kvpool/pkg/pool"
)

// v1Records are the records of testdata/checkpoint-v1.json, a checkpoint
// as the version 1 encoder wrote it (checksum over the records alone).
func v1Records() []Record {
	t0 := time.Date(2026, 11, 29, 8, 0, 0, 0, time.UTC)
	return []Record{
		{Token: "m_k9URAZLPJZQg1NSHgyPzqKDVzmqY6aPkQBydHCnC4", Devices: []string{"gpu0-numa0-0", "gpu0-numa0-1"}, FirstSeen: t0, Pod: "ns/a"},
		{Token: "yK43rSgAiwnNsWkH210lRiaE0QF0yfzqmIjvNgKiFkQ", Devices: []string{"gpu1-numaX-3"}, FirstSeen: t0.Add(time.Second)},
	}
}

func sameRecords(a, b []Record) bool {
	return slices.EqualFunc(a, b, func(x, y Record) bool {
		return x.Token == y.Token && slices.Equal(x.Devices, y.Devices) && x.FirstSeen.Equal(y.FirstSeen) && x.Pod == y.Pod &&
			sameClaim(x.Claim, y.Claim)
	})
}

func sameClaim(a, b *ClaimRef) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.UID == b.UID && a.Namespace == b.Namespace && a.Name == b.Name && a.Request == b.Request &&
		slices.Equal(a.PodUIDs, b.PodUIDs) && slices.Equal(a.Shares, b.Shares) && slices.Equal(a.Picked, b.Picked)
}

// v3Records are the records of testdata/checkpoint-v3.json: a device
// plugin allocation and a claim's (named chunks and a share).
func v3Records() []Record {
	t0 := time.Date(2026, 12, 1, 8, 0, 0, 0, time.UTC)
	return []Record{
		{Token: "m_k9URAZLPJZQg1NSHgyPzqKDVzmqY6aPkQBydHCnC4", Devices: []string{"gpu0-numa0-0"}, FirstSeen: t0, Pod: "ns/a"},
		{Token: "yK43rSgAiwnNsWkH210lRiaE0QF0yfzqmIjvNgKiFkQ", Devices: []string{"gpu1-numa1-0", "gpu1-numa1-1", "gpu1-numa1-2"}, FirstSeen: t0,
			Claim: &ClaimRef{UID: "0b5a3b0e-5d5c-4cf4-9f43-2f0b9f6d0a11", Namespace: "ns", Name: "kv", Request: "host-kv",
				PodUIDs: []string{"3f2b1c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"}, Shares: []Share{{GPU: 1, Chunks: 2}},
				Picked: []string{"gpu1-numa1-1", "gpu1-numa1-2"}}},
	}
}

// The version 3 golden file decodes to v3Records, and the current
// encoder writes exactly it: a change of the format is a new version.
func TestCheckpointV3Golden(t *testing.T) {
	golden, err := os.ReadFile("testdata/checkpoint-v3.json")
	if err != nil {
		t.Fatal(err)
	}
	got, version, err := decodeCheckpoint(golden)
	if err != nil || version != 3 || !sameRecords(got, v3Records()) {
		t.Fatalf("golden: version %d, %+v, %v", version, got, err)
	}
	enc, err := EncodeCheckpoint(v3Records())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(bytes.TrimSpace(golden), enc) {
		t.Errorf("the encoder no longer writes the version 3 golden file:\n%s", enc)
	}
}

// envelope is a checkpoint file of any version with the checksum given.
func envelope(t *testing.T, version int, sum string, recs []Record) []byte {
	t.Helper()
	body, err := json.Marshal(recs)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(checkpointFile{Version: version, Checksum: sum, Records: body})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func compactRecords(t *testing.T, recs []Record) []byte {
	t.Helper()
	b, err := json.Marshal(recs)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Each version decodes to the current records or is refused: version 1
// (the golden file of the old encoder) converts, version 2 is current, an
// intact version 3 is newer (refused, not corrupt), a version 3 whose
// checksum does not match is corrupt.
func TestDecodeCheckpointVersions(t *testing.T) {
	v1, err := os.ReadFile("testdata/checkpoint-v1.json")
	if err != nil {
		t.Fatal(err)
	}
	recs := v1Records()
	v3, err := EncodeCheckpoint(recs)
	if err != nil {
		t.Fatal(err)
	}
	body := compactRecords(t, recs)
	v2 := envelope(t, 2, checksumV2(2, body), recs)
	for _, c := range []struct {
		name        string
		data        []byte
		wantVersion int
		wantErr     error
		wantMsg     string
	}{
		{"version 1 converts", v1, 1, nil, ""},
		{"version 2 converts", v2, 2, nil, ""},
		{"version 3 is current", v3, 3, nil, ""},
		{"version 1 with the version 2 checksum", envelope(t, 1, checksumV2(1, body), recs), 0, ErrCorruptCheckpoint, "checksum mismatch"},
		{"version 2 with the version 1 checksum", envelope(t, 2, checksumV1(body), recs), 0, ErrCorruptCheckpoint, "checksum mismatch"},
		{"version 2 with a claim (a version 3 field)", envelope(t, 2, checksumV2(2, compactRecords(t, v3Records())), v3Records()), 0, ErrCorruptCheckpoint, "unknown field"},
		{"newer version", envelope(t, 4, checksumV2(4, body), recs), 0, ErrNewerCheckpoint, "version 4, this agent reads versions 1 to 3"},
		{"much newer version", envelope(t, 1000, checksumV2(1000, body), recs), 0, ErrNewerCheckpoint, "version 1000"},
		{"newer version, damaged", envelope(t, 4, checksumV2(3, body), recs), 0, ErrCorruptCheckpoint, "checksum mismatch"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, version, err := decodeCheckpoint(c.data)
			if c.wantErr == nil {
				if err != nil || version != c.wantVersion || !sameRecords(got, recs) {
					t.Fatalf("got version %d, %+v, %v; want version %d, %+v", version, got, err, c.wantVersion, recs)
				}
				return
			}
			if !errors.Is(err, c.wantErr) || !strings.Contains(err.Error(), c.wantMsg) || got != nil {
				t.Fatalf("got %v, %v; want %v containing %q", got, err, c.wantErr, c.wantMsg)
			}
			if c.wantErr == ErrNewerCheckpoint && errors.Is(err, ErrCorruptCheckpoint) {
				t.Errorf("a newer checkpoint reported as corrupt: %v", err)
			}
		})
	}
}

// New restores every version it reads and rewrites an older one in the
// current version; it refuses a newer one and leaves it untouched (a
// downgrade must not destroy the newer agent's state); it quarantines a
// corrupt one and starts empty.
func TestNewCheckpointVersions(t *testing.T) {
	v1, err := os.ReadFile("testdata/checkpoint-v1.json")
	if err != nil {
		t.Fatal(err)
	}
	recs := v1Records()
	v3, err := EncodeCheckpoint(recs)
	if err != nil {
		t.Fatal(err)
	}
	body := compactRecords(t, recs)
	v2 := envelope(t, 2, checksumV2(2, body), recs)
	newer := envelope(t, 4, checksumV2(4, body), recs)
	for _, c := range []struct {
		name        string
		file        []byte
		refused     bool
		quarantined bool
		restored    []Record
		onDisk      []byte // nil: the current encoding of restored
	}{
		{name: "version 1 is converted and rewritten", file: v1, restored: recs},
		{name: "version 2 is converted and rewritten", file: v2, restored: recs},
		{name: "version 3 is read as it is", file: v3, restored: recs, onDisk: v3},
		{name: "newer version is refused and kept", file: newer, refused: true, onDisk: newer},
		{name: "corrupt version 1 is quarantined", file: bytes.Replace(v1, []byte("gpu1-numaX-3"), []byte("gpu1-numaX-4"), 1), quarantined: true},
		{name: "damaged newer version is quarantined", file: envelope(t, 4, checksumV1(body), recs), quarantined: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, CheckpointFile)
			if err := os.WriteFile(path, c.file, 0o600); err != nil {
				t.Fatal(err)
			}
			p, err := New(Options{Pool: pool.New(), Devices: NewFeed(), Renew: func(string) error { return nil },
				KubeletDir: dir, SocketDir: "/run/kvp", StateDir: dir, Interval: time.Hour, Logger: quietLogger()})
			if c.refused {
				if !errors.Is(err, ErrNewerCheckpoint) || errors.Is(err, ErrCorruptCheckpoint) || p != nil ||
					!strings.Contains(err.Error(), "run the newer agent again, or move the file away") {
					t.Fatalf("New: %v, %v; want ErrNewerCheckpoint saying what to do", p, err)
				}
			} else if err != nil {
				t.Fatal(err)
			} else if got := p.Allocations(); !sameRecords(got, c.restored) {
				t.Errorf("restored %+v, want %+v", got, c.restored)
			}
			moved, _ := filepath.Glob(path + ".corrupt-*")
			if c.quarantined != (len(moved) == 1) {
				t.Errorf("quarantined copies %v, want quarantined %v", moved, c.quarantined)
			}
			if c.quarantined {
				if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("corrupt checkpoint still in place: %v", err)
				}
				return
			}
			data, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if c.onDisk != nil {
				if !bytes.Equal(data, c.onDisk) {
					t.Errorf("checkpoint changed:\n%s\nwant\n%s", data, c.onDisk)
				}
				return
			}
			got, version, err := decodeCheckpoint(data)
			if err != nil || version != checkpointVersion || !sameRecords(got, c.restored) {
				t.Errorf("rewritten checkpoint: version %d, %+v, %v; want version %d, %+v", version, got, err, checkpointVersion, c.restored)
			}
		})
	}
}
