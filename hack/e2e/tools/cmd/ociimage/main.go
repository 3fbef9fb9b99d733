// Command ociimage writes a single-layer OCI image archive (an OCI image
// layout packed in a tar) from files on the host, without Docker or a
// registry. The result imports with `ctr -n k8s.io images import`.
//
//	ociimage -o img.tar -name kvpool.local/e2e:dev -entrypoint /pause \
//	    -file /pause=bin/pause -file /bin/busybox=/bin/busybox -link /bin/sh=busybox
package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path"
	"runtime"
	"sort"
	"strings"
	"time"
)

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(s string) error { *l = append(*l, s); return nil }

// epoch keeps the archive reproducible: same inputs, same digests.
var epoch = time.Unix(0, 0).UTC()

func main() {
	var names, files, links listFlag
	out := flag.String("o", "", "output archive path")
	entry := flag.String("entrypoint", "", "image entrypoint (space separated)")
	flag.Var(&names, "name", "image reference (repeatable)")
	flag.Var(&files, "file", "DEST=SRC: copy host file SRC to DEST in the image (repeatable)")
	flag.Var(&links, "link", "DEST=TARGET: symlink DEST -> TARGET in the image (repeatable)")
	flag.Parse()
	if err := run(*out, *entry, names, files, links); err != nil {
		fmt.Fprintln(os.Stderr, "ociimage:", err)
		os.Exit(1)
	}
}

type blob struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
	Platform    *platform         `json:"platform,omitempty"`
}

type platform struct {
	Architecture string `json:"architecture"`
	OS           string `json:"os"`
}

func digest(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func run(out, entry string, names, files, links []string) error {
	if out == "" || len(names) == 0 || len(files) == 0 {
		return errors.New("need -o, at least one -name and at least one -file")
	}
	layer, err := buildLayer(files, links)
	if err != nil {
		return err
	}
	configJSON, manifestJSON, indexJSON, err := describe(entry, names, layer)
	if err != nil {
		return err
	}
	return writeArchive(out, []archiveEntry{
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", indexJSON},
		{"blobs/sha256/" + strings.TrimPrefix(digest(layer), "sha256:"), layer},
		{"blobs/sha256/" + strings.TrimPrefix(digest(configJSON), "sha256:"), configJSON},
		{"blobs/sha256/" + strings.TrimPrefix(digest(manifestJSON), "sha256:"), manifestJSON},
	})
}

// describe returns the image's config, its manifest over the one layer,
// and the index naming it once per name.
func describe(entry string, names []string, layer []byte) (configJSON, manifestJSON, indexJSON []byte, err error) {
	config := map[string]any{
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"created":      epoch.Format(time.RFC3339),
		"config": map[string]any{
			"Entrypoint": strings.Fields(entry),
			"Env":        []string{"PATH=/bin:/usr/bin"},
			"WorkingDir": "/",
		},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{digest(layer)}},
	}
	if configJSON, err = json.Marshal(config); err != nil {
		return nil, nil, nil, err
	}
	manifest := map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config":        blob{MediaType: "application/vnd.oci.image.config.v1+json", Digest: digest(configJSON), Size: int64(len(configJSON))},
		"layers":        []blob{{MediaType: "application/vnd.oci.image.layer.v1.tar", Digest: digest(layer), Size: int64(len(layer))}},
	}
	if manifestJSON, err = json.Marshal(manifest); err != nil {
		return nil, nil, nil, err
	}
	var index struct {
		SchemaVersion int    `json:"schemaVersion"`
		MediaType     string `json:"mediaType"`
		Manifests     []blob `json:"manifests"`
	}
	index.SchemaVersion = 2
	index.MediaType = "application/vnd.oci.image.index.v1+json"
	for _, n := range names {
		index.Manifests = append(index.Manifests, blob{
			MediaType: "application/vnd.oci.image.manifest.v1+json",
			Digest:    digest(manifestJSON),
			Size:      int64(len(manifestJSON)),
			Annotations: map[string]string{
				"io.containerd.image.name":          n,
				"org.opencontainers.image.ref.name": n,
			},
			Platform: &platform{Architecture: runtime.GOARCH, OS: "linux"},
		})
	}
	indexJSON, err = json.Marshal(index)
	return configJSON, manifestJSON, indexJSON, err
}

// archiveEntry is one file of the OCI archive.
type archiveEntry struct {
	name string
	data []byte
}

// writeArchive writes the entries as a tar file at out.
func writeArchive(out string, entries []archiveEntry) error {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	add := func(name string, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), ModTime: epoch, Typeflag: tar.TypeReg}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	for _, e := range entries {
		if err := add(e.name, e.data); err != nil {
			return fmt.Errorf("write %s: %w", e.name, err)
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return os.WriteFile(out, buf.Bytes(), 0o644)
}

// buildLayer returns an uncompressed tar holding the files, the symlinks and
// every parent directory they need.
func buildLayer(files, links []string) ([]byte, error) {
	type item struct {
		dest, src, target string
	}
	var items []item
	for _, f := range files {
		dest, src, ok := strings.Cut(f, "=")
		if !ok || !path.IsAbs(dest) || src == "" {
			return nil, fmt.Errorf("bad -file %q: want /DEST=SRC", f)
		}
		items = append(items, item{dest: path.Clean(dest), src: src})
	}
	for _, l := range links {
		dest, target, ok := strings.Cut(l, "=")
		if !ok || !path.IsAbs(dest) || target == "" {
			return nil, fmt.Errorf("bad -link %q: want /DEST=TARGET", l)
		}
		items = append(items, item{dest: path.Clean(dest), target: target})
	}
	dirs := map[string]bool{"tmp": true, "dev": true, "proc": true, "sys": true, "etc": true, "var/run": true}
	for _, it := range items {
		for d := path.Dir(strings.TrimPrefix(it.dest, "/")); d != "." && d != ""; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	for d := range dirs {
		for p := path.Dir(d); p != "."; p = path.Dir(p) {
			dirs[p] = true
		}
	}
	sortedDirs := make([]string, 0, len(dirs))
	for d := range dirs {
		sortedDirs = append(sortedDirs, d)
	}
	sort.Strings(sortedDirs)
	sort.Slice(items, func(i, j int) bool { return items[i].dest < items[j].dest })

	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, d := range sortedDirs {
		mode := int64(0o755)
		if d == "tmp" {
			mode = 0o1777
		}
		if err := tw.WriteHeader(&tar.Header{Name: d + "/", Mode: mode, ModTime: epoch, Typeflag: tar.TypeDir}); err != nil {
			return nil, err
		}
	}
	for _, it := range items {
		name := strings.TrimPrefix(it.dest, "/")
		if it.target != "" {
			if err := tw.WriteHeader(&tar.Header{Name: name, Linkname: it.target, Mode: 0o777, ModTime: epoch, Typeflag: tar.TypeSymlink}); err != nil {
				return nil, err
			}
			continue
		}
		data, err := os.ReadFile(it.src)
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", it.src, err)
		}
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o755, Size: int64(len(data)), ModTime: epoch, Typeflag: tar.TypeReg}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
