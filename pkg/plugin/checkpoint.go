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
// New moves such a file aside and starts without its allocations.
var ErrCorruptCheckpoint = errors.New("corrupt plugin checkpoint")

// ErrNewerCheckpoint reports an intact checkpoint of a version newer than
// this agent reads: a newer agent wrote it, and this one (a downgrade)
// would lose what it does not understand. New refuses it and leaves the
// file as it is.
var ErrNewerCheckpoint = errors.New("plugin checkpoint written by a newer agent")

// Checkpoint versions. The file is an envelope {version, checksum,
// records}; what changes between versions is the records' format and, up
// to version 2, the checksum.
//
//   - Version 1: the checksum is the SHA-256 of the records alone.
//   - Version 2: the checksum covers the version and the records
//     (checksumV2). An agent that refuses newer versions must be able to
//     tell a newer file from a damaged one: with the version under the
//     checksum, a damaged version number is corruption, never "newer". The
//     envelope and this checksum are fixed from version 2 on, so that every
//     reader can check any later version's file; a later version changes
//     only the records.
//   - Version 3: a record may name the ResourceClaim request the DRA
//     driver prepared it for (Record.Claim); records without one are the
//     device plugin's, as before.
//
// Each version's records are read in their own format (recordV1, ...) and
// converted to Record; SaveCheckpoint writes checkpointVersion only, and
// New rewrites a file of an older version at once.
const (
	checkpointVersion = 3
	oldestCheckpoint  = 1
)

// Record is one allocation as the checkpoint keeps it.
type Record struct {
	Token     string    `json:"token"`
	Devices   []string  `json:"devices"` // sorted
	FirstSeen time.Time `json:"firstSeen"`
	// Pod is namespace/name of the pod PodResources last listed as holding
	// the devices; empty when no pod has been seen with them yet. Empty
	// for a claim's allocation.
	Pod string `json:"pod,omitempty"`
	// Claim is the ResourceClaim request the DRA driver prepared this
	// allocation for; nil for the device plugin's allocations. Its
	// lifetime is the claim's: Unprepare ends it, PodResources never does.
	Claim *ClaimRef `json:"claim,omitempty"`
}

// ClaimRef names the ResourceClaim request an allocation serves, and
// what the DRA driver asked for it, so that a repeated Prepare (kubelet
// retries, the agent restarted) is recognised and answered the same.
type ClaimRef struct {
	UID       string `json:"uid"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// Request is the claim's request ("request" or "request/subrequest").
	Request string `json:"request"`
	// PodUIDs are the pods the claim was reserved for at the last
	// Prepare: with tokenBinding "pod" the token works only from them.
	PodUIDs []string `json:"podUIDs,omitempty"`
	// Shares are the shares of GPUs' consumable devices the request was
	// allocated (chunks the ledger picked, listed in Picked); the rest of
	// the record's devices were named by the scheduler.
	Shares []Share  `json:"shares,omitempty"`
	Picked []string `json:"picked,omitempty"` // sorted
}

// Share is a number of chunks of one GPU, which the ledger picks.
type Share struct {
	GPU    int `json:"gpu"`
	Chunks int `json:"chunks"`
}

// recordV1 is a record of versions 1 and 2 (which changed only the
// checksum), frozen: a change of Record is a new version whose conversion
// turns the older records into the new ones.
type recordV1 struct {
	Token     string    `json:"token"`
	Devices   []string  `json:"devices"`
	FirstSeen time.Time `json:"firstSeen"`
	Pod       string    `json:"pod,omitempty"`
}

// current converts a version 1 (or 2) record: a device plugin allocation.
func (r recordV1) current() Record {
	return Record{Token: r.Token, Devices: r.Devices, FirstSeen: r.FirstSeen, Pod: r.Pod}
}

// recordV3 is a record of version 3, frozen like recordV1.
type recordV3 struct {
	Token     string    `json:"token"`
	Devices   []string  `json:"devices"`
	FirstSeen time.Time `json:"firstSeen"`
	Pod       string    `json:"pod,omitempty"`
	Claim     *claimV3  `json:"claim,omitempty"`
}

type claimV3 struct {
	UID       string    `json:"uid"`
	Namespace string    `json:"namespace"`
	Name      string    `json:"name"`
	Request   string    `json:"request"`
	PodUIDs   []string  `json:"podUIDs,omitempty"`
	Shares    []shareV3 `json:"shares,omitempty"`
	Picked    []string  `json:"picked,omitempty"`
}

type shareV3 struct {
	GPU    int `json:"gpu"`
	Chunks int `json:"chunks"`
}

// current converts a version 3 record, field by field.
func (r recordV3) current() Record {
	out := Record{Token: r.Token, Devices: r.Devices, FirstSeen: r.FirstSeen, Pod: r.Pod}
	if c := r.Claim; c != nil {
		out.Claim = &ClaimRef{UID: c.UID, Namespace: c.Namespace, Name: c.Name, Request: c.Request,
			PodUIDs: c.PodUIDs, Picked: c.Picked}
		for _, s := range c.Shares {
			// A conversion: it stops compiling once Share changes, and
			// must then be written field by field.
			out.Claim.Shares = append(out.Claim.Shares, Share(s))
		}
	}
	return out
}

type checkpointFile struct {
	Version  int             `json:"version"`
	Checksum string          `json:"checksum"` // hex SHA-256: checksumV1 or checksumV2
	Records  json.RawMessage `json:"records"`
}

// checksumV1 is version 1's checksum: the compact records alone.
func checksumV1(records []byte) string {
	sum := sha256.Sum256(records)
	return hex.EncodeToString(sum[:])
}

// checksumV2 is the checksum of version 2 and later: the version and the
// compact records.
func checksumV2(version int, records []byte) string {
	h := sha256.New()
	fmt.Fprintf(h, "kvpool plugin checkpoint v%d\n", version)
	h.Write(records)
	return hex.EncodeToString(h.Sum(nil))
}

// EncodeCheckpoint serialises records with the current version and its
// checksum.
func EncodeCheckpoint(recs []Record) ([]byte, error) {
	if recs == nil {
		recs = []Record{}
	}
	body, err := json.Marshal(recs)
	if err != nil {
		return nil, fmt.Errorf("encode checkpoint: %w", err)
	}
	return json.MarshalIndent(checkpointFile{Version: checkpointVersion, Checksum: checksumV2(checkpointVersion, body), Records: body}, "", "  ")
}

// DecodeCheckpoint parses and verifies a checkpoint of any version this
// agent reads, and returns its records in the current format. A defect is
// ErrCorruptCheckpoint; an intact file of a newer version is
// ErrNewerCheckpoint.
func DecodeCheckpoint(data []byte) ([]Record, error) {
	recs, _, err := decodeCheckpoint(data)
	return recs, err
}

// decodeCheckpoint is DecodeCheckpoint, also returning the version read.
func decodeCheckpoint(data []byte) ([]Record, int, error) {
	var f checkpointFile
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return nil, 0, fmt.Errorf("%w: %v", ErrCorruptCheckpoint, err)
	}
	if dec.More() {
		return nil, 0, fmt.Errorf("%w: trailing data", ErrCorruptCheckpoint)
	}
	if f.Version < oldestCheckpoint {
		return nil, 0, fmt.Errorf("%w: version %d, want %d to %d", ErrCorruptCheckpoint, f.Version, oldestCheckpoint, checkpointVersion)
	}
	// The checksum covers the compact encoding, whatever the indentation.
	var compact bytes.Buffer
	if err := json.Compact(&compact, f.Records); err != nil {
		return nil, 0, fmt.Errorf("%w: records: %v", ErrCorruptCheckpoint, err)
	}
	want := checksumV2(f.Version, compact.Bytes())
	if f.Version == 1 {
		want = checksumV1(compact.Bytes())
	}
	if f.Checksum != want {
		return nil, 0, fmt.Errorf("%w: checksum mismatch", ErrCorruptCheckpoint)
	}
	if f.Version > checkpointVersion {
		return nil, 0, fmt.Errorf("%w: version %d, this agent reads versions %d to %d", ErrNewerCheckpoint, f.Version, oldestCheckpoint, checkpointVersion)
	}
	recs, err := decodeRecords(f.Version, compact.Bytes())
	if err != nil {
		return nil, 0, fmt.Errorf("%w: records: %v", ErrCorruptCheckpoint, err)
	}
	if err := checkRecords(recs); err != nil {
		return nil, 0, err
	}
	return recs, f.Version, nil
}

// decodeRecords reads the records of version in that version's format
// (versions 1 and 2 share one) and converts them to Record.
func decodeRecords(version int, data []byte) ([]Record, error) {
	rdec := json.NewDecoder(bytes.NewReader(data))
	rdec.DisallowUnknownFields()
	if version < 3 {
		var old []recordV1
		if err := rdec.Decode(&old); err != nil {
			return nil, err
		}
		recs := make([]Record, len(old))
		for i, r := range old {
			recs[i] = r.current()
		}
		return recs, nil
	}
	var v3 []recordV3
	if err := rdec.Decode(&v3); err != nil {
		return nil, err
	}
	recs := make([]Record, len(v3))
	for i, r := range v3 {
		recs[i] = r.current()
	}
	return recs, nil
}

// checkRecords checks what every allocation must be: a well-formed token
// of its own, and a non-empty sorted list of devices no other allocation
// holds.
func checkRecords(recs []Record) error {
	tokens := make(map[string]bool, len(recs))
	devs := make(map[string]string)
	claims := make(map[string]bool)
	for i, r := range recs {
		if !contract.IsToken(r.Token) {
			return fmt.Errorf("%w: record %d: malformed token", ErrCorruptCheckpoint, i)
		}
		if tokens[r.Token] {
			return fmt.Errorf("%w: record %d: token repeated", ErrCorruptCheckpoint, i)
		}
		tokens[r.Token] = true
		if len(r.Devices) == 0 || !slices.IsSorted(r.Devices) {
			return fmt.Errorf("%w: record %d: device list empty or unsorted", ErrCorruptCheckpoint, i)
		}
		for _, d := range r.Devices {
			if d == "" {
				return fmt.Errorf("%w: record %d: empty device ID", ErrCorruptCheckpoint, i)
			}
			if _, dup := devs[d]; dup {
				return fmt.Errorf("%w: device %s held by two allocations", ErrCorruptCheckpoint, d)
			}
			devs[d] = r.Token
		}
		if r.Claim != nil {
			if err := checkClaim(r, claims); err != nil {
				return fmt.Errorf("%w: record %d: %v", ErrCorruptCheckpoint, i, err)
			}
		}
	}
	return nil
}

// checkClaim checks a claim's allocation: the claim named, its request
// once, its pods UIDs, its shares positive and its picked chunks among
// the record's devices, as many as the shares asked. seen collects the
// claims' requests.
func checkClaim(r Record, seen map[string]bool) error {
	c := r.Claim
	switch {
	case !ValidUID(c.UID) || c.Name == "" || c.Namespace == "" || c.Request == "":
		return errors.New("claim without a UID, namespace, name or request")
	case r.Pod != "":
		return errors.New("claim allocation names a device plugin pod")
	case seen[c.UID+"/"+c.Request]:
		return fmt.Errorf("claim %s request %s prepared twice", c.UID, c.Request)
	case !slices.IsSorted(c.Picked):
		return errors.New("picked chunks unsorted")
	}
	seen[c.UID+"/"+c.Request] = true
	for _, u := range c.PodUIDs {
		if !ValidUID(u) {
			return fmt.Errorf("pod UID %q", u)
		}
	}
	want := 0
	for _, s := range c.Shares {
		if s.Chunks <= 0 || s.GPU < 0 {
			return fmt.Errorf("share %+v", s)
		}
		want += s.Chunks
	}
	if len(c.Picked) != want {
		return fmt.Errorf("%d picked chunks for shares of %d", len(c.Picked), want)
	}
	for _, d := range c.Picked {
		if _, ok := slices.BinarySearch(r.Devices, d); !ok {
			return fmt.Errorf("picked chunk %s not among the devices", d)
		}
	}
	return nil
}

// MaxCheckpointBytes bounds the checkpoint read at start: far more than
// any node's allocations take (one record is about 200 bytes, and a node
// has at most a few thousand chunks), far less than the agent's headroom.
const MaxCheckpointBytes = 16 << 20

// LoadCheckpoint reads the checkpoint in dir, of any version this agent
// reads, in the current format. A missing file is an empty checkpoint, not
// an error; a file over MaxCheckpointBytes is corrupt
// (ErrCorruptCheckpoint) and is not read; a newer version is
// ErrNewerCheckpoint.
func LoadCheckpoint(dir string) ([]Record, error) {
	recs, _, err := loadCheckpoint(dir)
	return recs, err
}

// loadCheckpoint is LoadCheckpoint, also returning the version read (0 for
// no file).
func loadCheckpoint(dir string) ([]Record, int, error) {
	path := filepath.Join(dir, CheckpointFile)
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, fmt.Errorf("load checkpoint: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxCheckpointBytes+1))
	if err != nil {
		return nil, 0, fmt.Errorf("load checkpoint: %w", err)
	}
	if len(data) > MaxCheckpointBytes {
		return nil, 0, fmt.Errorf("load checkpoint %s: %w: larger than %d bytes", path, ErrCorruptCheckpoint, MaxCheckpointBytes)
	}
	recs, version, err := decodeCheckpoint(data)
	if err != nil {
		return nil, 0, fmt.Errorf("load checkpoint %s: %w", path, err)
	}
	return recs, version, nil
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
