package plugin

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/kvpool/kvpool/pkg/contract"
)

// CheckpointFile is the name of the plugin's checkpoint inside the state
// directory.
const CheckpointFile = "plugin-checkpoint.json"

// ErrCorruptCheckpoint reports a checkpoint that cannot be trusted: it does
// not parse, its checksum does not match, or its content is inconsistent.
var ErrCorruptCheckpoint = errors.New("corrupt plugin checkpoint")

const checkpointVersion = 1

// Record is one allocation as the checkpoint keeps it.
type Record struct {
	Token     string    `json:"token"`
	Devices   []string  `json:"devices"` // sorted
	FirstSeen time.Time `json:"firstSeen"`
	// Pod is namespace/name of the pod PodResources last listed as holding
	// the devices; empty when no pod has been seen with them yet.
	Pod string `json:"pod,omitempty"`
}

type checkpointFile struct {
	Version  int             `json:"version"`
	Checksum string          `json:"checksum"` // hex SHA-256 of Records as encoded
	Records  json.RawMessage `json:"records"`
}

// EncodeCheckpoint serialises records with a version and a checksum.
func EncodeCheckpoint(recs []Record) ([]byte, error) {
	if recs == nil {
		recs = []Record{}
	}
	body, err := json.Marshal(recs)
	if err != nil {
		return nil, fmt.Errorf("encode checkpoint: %w", err)
	}
	sum := sha256.Sum256(body)
	return json.MarshalIndent(checkpointFile{Version: checkpointVersion, Checksum: hex.EncodeToString(sum[:]), Records: body}, "", "  ")
}

// DecodeCheckpoint parses and verifies a checkpoint. Any defect is reported
// as ErrCorruptCheckpoint.
func DecodeCheckpoint(data []byte) ([]Record, error) {
	var f checkpointFile
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrCorruptCheckpoint, err)
	}
	if dec.More() {
		return nil, fmt.Errorf("%w: trailing data", ErrCorruptCheckpoint)
	}
	if f.Version != checkpointVersion {
		return nil, fmt.Errorf("%w: version %d, want %d", ErrCorruptCheckpoint, f.Version, checkpointVersion)
	}
	// The checksum covers the compact encoding, whatever the indentation.
	var compact bytes.Buffer
	if err := json.Compact(&compact, f.Records); err != nil {
		return nil, fmt.Errorf("%w: records: %v", ErrCorruptCheckpoint, err)
	}
	sum := sha256.Sum256(compact.Bytes())
	if hex.EncodeToString(sum[:]) != f.Checksum {
		return nil, fmt.Errorf("%w: checksum mismatch", ErrCorruptCheckpoint)
	}
	var recs []Record
	rdec := json.NewDecoder(bytes.NewReader(compact.Bytes()))
	rdec.DisallowUnknownFields()
	if err := rdec.Decode(&recs); err != nil {
		return nil, fmt.Errorf("%w: records: %v", ErrCorruptCheckpoint, err)
	}
	tokens := make(map[string]bool, len(recs))
	devs := make(map[string]string)
	for i, r := range recs {
		if !contract.IsToken(r.Token) {
			return nil, fmt.Errorf("%w: record %d: malformed token", ErrCorruptCheckpoint, i)
		}
		if tokens[r.Token] {
			return nil, fmt.Errorf("%w: record %d: token repeated", ErrCorruptCheckpoint, i)
		}
		tokens[r.Token] = true
		if len(r.Devices) == 0 || !slices.IsSorted(r.Devices) {
			return nil, fmt.Errorf("%w: record %d: device list empty or unsorted", ErrCorruptCheckpoint, i)
		}
		for _, d := range r.Devices {
			if d == "" {
				return nil, fmt.Errorf("%w: record %d: empty device ID", ErrCorruptCheckpoint, i)
			}
			if _, dup := devs[d]; dup {
				return nil, fmt.Errorf("%w: device %s held by two allocations", ErrCorruptCheckpoint, d)
			}
			devs[d] = r.Token
		}
	}
	return recs, nil
}

// MaxCheckpointBytes bounds the checkpoint read at start: far more than
// any node's allocations take (one record is about 200 bytes, and a node
// has at most a few thousand chunks), far less than the agent's headroom.
const MaxCheckpointBytes = 16 << 20

// LoadCheckpoint reads the checkpoint in dir. A missing file is an empty
// checkpoint, not an error; a file over MaxCheckpointBytes is corrupt
// (ErrCorruptCheckpoint) and is not read.
func LoadCheckpoint(dir string) ([]Record, error) {
	path := filepath.Join(dir, CheckpointFile)
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("load checkpoint: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxCheckpointBytes+1))
	if err != nil {
		return nil, fmt.Errorf("load checkpoint: %w", err)
	}
	if len(data) > MaxCheckpointBytes {
		return nil, fmt.Errorf("load checkpoint %s: %w: larger than %d bytes", path, ErrCorruptCheckpoint, MaxCheckpointBytes)
	}
	recs, err := DecodeCheckpoint(data)
	if err != nil {
		return nil, fmt.Errorf("load checkpoint %s: %w", filepath.Join(dir, CheckpointFile), err)
	}
	return recs, nil
}

// SaveCheckpoint replaces the checkpoint in dir atomically: it writes a
// temporary file, syncs it, renames it over the old one and syncs the
// directory, so a crash leaves either the old or the new checkpoint.
func SaveCheckpoint(dir string, recs []Record) error {
	data, err := EncodeCheckpoint(recs)
	if err != nil {
		return err
	}
	if len(recs) == 0 {
		// No allocations: no file (a missing checkpoint loads as empty), so
		// an agent that stops with nothing allocated, as on uninstall,
		// leaves nothing in the state directory.
		if err := os.Remove(filepath.Join(dir, CheckpointFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("save checkpoint: %w", err)
		}
		return syncDir(dir)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("save checkpoint: %w", err)
	}
	tmp, err := os.CreateTemp(dir, CheckpointFile+".tmp-*")
	if err != nil {
		return fmt.Errorf("save checkpoint: %w", err)
	}
	defer os.Remove(tmp.Name()) // no-op after the rename
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("save checkpoint: write: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("save checkpoint: sync: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("save checkpoint: %w", err)
	}
	if err := os.Rename(tmp.Name(), filepath.Join(dir, CheckpointFile)); err != nil {
		return fmt.Errorf("save checkpoint: %w", err)
	}
	return syncDir(dir)
}

// syncDir makes a rename or removal in dir durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("save checkpoint: open dir: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("save checkpoint: sync dir: %w", err)
	}
	return nil
}

// quarantineCheckpoint moves an untrusted checkpoint aside so that the next
// save does not destroy the evidence, and returns the new path.
func quarantineCheckpoint(dir string, now time.Time) (string, error) {
	dst := filepath.Join(dir, fmt.Sprintf("%s.corrupt-%s", CheckpointFile, now.UTC().Format("20060102T150405.000000000")))
	if err := os.Rename(filepath.Join(dir, CheckpointFile), dst); err != nil {
		return "", fmt.Errorf("quarantine checkpoint: %w", err)
	}
	return dst, nil
}
