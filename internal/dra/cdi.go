package dra

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/plugin"
)

// CDIClass is the class part of the CDI kind of the driver's devices:
// "<driver>/host-kv".
const CDIClass = "host-kv"

// cdiSpecs writes and removes the driver's CDI specs: one file per claim,
// <dir>/<driver>_<claim UID>.json, with one CDI device per request (the
// socket directory mounted read-only, KVPOOL_SOCKET and the request's
// KVPOOL_TOKEN). The file holds tokens, so it is the owner's alone (the
// container runtime reads it as root); it is written to a temporary name
// the runtime ignores and renamed into place.
type cdiSpecs struct {
	dir, driver, socketDir string
}

func (c cdiSpecs) kind() string { return c.driver + "/" + CDIClass }

func (c cdiSpecs) prefix() string { return c.driver + "_" }

// path is the spec file of claim uid (a UID: checked by the caller).
func (c cdiSpecs) path(uid string) string { return filepath.Join(c.dir, c.prefix()+uid+".json") }

// spec is the CDI spec of a claim's grants.
func (c cdiSpecs) spec(uid string, grants []plugin.ClaimGrant) (*cdispec.Spec, error) {
	s := &cdispec.Spec{Kind: c.kind()}
	for _, g := range grants {
		s.Devices = append(s.Devices, cdispec.Device{
			Name: cdiName(uid, g.Request),
			ContainerEdits: cdispec.ContainerEdits{
				Env: envOf(g.Token),
				// Read-only, as the device plugin mounts it: connecting
				// needs write permission on the socket inode only.
				Mounts: []*cdispec.Mount{{HostPath: c.socketDir, ContainerPath: contract.ContainerSocketDir,
					Type: "bind", Options: []string{"rbind", "ro", "nosuid", "nodev"}}},
			},
		})
	}
	v, err := cdispec.MinimumRequiredVersion(s)
	if err != nil {
		return nil, err
	}
	s.Version = v
	return s, nil
}

// write writes claim uid's spec and returns the CDI device ID of each
// request.
func (c cdiSpecs) write(uid string, grants []plugin.ClaimGrant) (map[string]string, error) {
	if !plugin.ValidUID(uid) {
		return nil, fmt.Errorf("CDI spec: claim UID %q is not a UID", uid)
	}
	s, err := c.spec(uid, grants)
	if err != nil {
		return nil, fmt.Errorf("CDI spec of claim %s: %w", uid, err)
	}
	data, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("CDI spec of claim %s: %w", uid, err)
	}
	if err := writeFile(c.dir, c.path(uid), data); err != nil {
		return nil, fmt.Errorf("CDI spec of claim %s: %w", uid, err)
	}
	ids := make(map[string]string, len(grants))
	for _, g := range grants {
		ids[g.Request] = c.kind() + "=" + cdiName(uid, g.Request)
	}
	return ids, nil
}

// writeFile replaces path atomically with data, mode 0600: a temporary
// file (a name the runtime does not read), synced, renamed, the directory
// synced.
func writeFile(dir, path string, data []byte) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // after the rename: nothing there
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return err
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// remove deletes claim uid's spec; none there is fine.
func (c cdiSpecs) remove(uid string) error {
	if !plugin.ValidUID(uid) {
		return fmt.Errorf("CDI spec: claim UID %q is not a UID", uid)
	}
	if err := os.Remove(c.path(uid)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove the CDI spec of claim %s: %w", uid, err)
	}
	return nil
}

// list returns the claim UIDs the driver has specs for.
func (c cdiSpecs) list() ([]string, error) {
	entries, err := os.ReadDir(c.dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("CDI spec directory: %w", err)
	}
	var uids []string
	for _, e := range entries {
		name, ok := strings.CutPrefix(e.Name(), c.prefix())
		if !ok || !e.Type().IsRegular() {
			continue
		}
		uid, ok := strings.CutSuffix(name, ".json")
		if ok && plugin.ValidUID(uid) {
			uids = append(uids, uid)
		}
	}
	slices.Sort(uids)
	return uids, nil
}

// prune removes the specs of claims not in keep and returns their UIDs.
func (c cdiSpecs) prune(keep map[string]bool) ([]string, error) {
	uids, err := c.list()
	if err != nil {
		return nil, err
	}
	var removed []string
	var errs []error
	for _, uid := range uids {
		if keep[uid] {
			continue
		}
		if err := c.remove(uid); err != nil {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, uid)
	}
	return removed, errors.Join(errs...)
}
