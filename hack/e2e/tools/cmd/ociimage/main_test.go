package main

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// readArchive returns the archive's files by name.
func readArchive(t *testing.T, path string) map[string][]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string][]byte{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out[h.Name] = b
	}
}

func blobOf(t *testing.T, files map[string][]byte, d string) []byte {
	t.Helper()
	b, ok := files["blobs/sha256/"+strings.TrimPrefix(d, "sha256:")]
	if !ok {
		t.Fatalf("blob %s missing", d)
	}
	if got := digest(b); got != d {
		t.Fatalf("blob %s has digest %s", d, got)
	}
	return b
}

func TestArchiveIsAConsistentOCILayout(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "app")
	if err := os.WriteFile(src, []byte("#!binary"), 0o755); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "img.tar")
	if err := run(out, "/app serve", []string{"a.local/x:1", "b.local/y:2"}, []string{"/bin/app=" + src}, []string{"/bin/sh=app"}); err != nil {
		t.Fatal(err)
	}
	files := readArchive(t, out)
	if string(files["oci-layout"]) != `{"imageLayoutVersion":"1.0.0"}` {
		t.Fatalf("oci-layout = %q", files["oci-layout"])
	}
	var index struct{ Manifests []blob }
	if err := json.Unmarshal(files["index.json"], &index); err != nil {
		t.Fatal(err)
	}
	if len(index.Manifests) != 2 || index.Manifests[0].Annotations["io.containerd.image.name"] != "a.local/x:1" ||
		index.Manifests[1].Annotations["org.opencontainers.image.ref.name"] != "b.local/y:2" {
		t.Fatalf("index names: %+v", index.Manifests)
	}
	var manifest struct {
		Config blob
		Layers []blob
	}
	if err := json.Unmarshal(blobOf(t, files, index.Manifests[0].Digest), &manifest); err != nil {
		t.Fatal(err)
	}
	var config struct {
		Config struct{ Entrypoint []string }
		RootFS struct {
			DiffIDs []string `json:"diff_ids"`
		} `json:"rootfs"`
	}
	if err := json.Unmarshal(blobOf(t, files, manifest.Config.Digest), &config); err != nil {
		t.Fatal(err)
	}
	if strings.Join(config.Config.Entrypoint, " ") != "/app serve" {
		t.Errorf("entrypoint %q", config.Config.Entrypoint)
	}
	if len(manifest.Layers) != 1 || len(config.RootFS.DiffIDs) != 1 || config.RootFS.DiffIDs[0] != manifest.Layers[0].Digest {
		t.Fatalf("layers %+v, diff_ids %v", manifest.Layers, config.RootFS.DiffIDs)
	}
	layer := tar.NewReader(bytes.NewReader(blobOf(t, files, manifest.Layers[0].Digest)))
	seen := map[string]*tar.Header{}
	for {
		h, err := layer.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		seen[h.Name] = h
	}
	if h := seen["bin/app"]; h == nil || h.Size != 8 || h.Mode&0o111 == 0 {
		t.Errorf("bin/app: %+v", h)
	}
	if h := seen["bin/sh"]; h == nil || h.Typeflag != tar.TypeSymlink || h.Linkname != "app" {
		t.Errorf("bin/sh: %+v", h)
	}
	if h := seen["bin/"]; h == nil || h.Typeflag != tar.TypeDir {
		t.Errorf("bin/ directory missing")
	}

	// Same inputs, same bytes: digests are stable across runs.
	out2 := filepath.Join(dir, "img2.tar")
	if err := run(out2, "/app serve", []string{"a.local/x:1", "b.local/y:2"}, []string{"/bin/app=" + src}, []string{"/bin/sh=app"}); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(out)
	b, _ := os.ReadFile(out2)
	if !bytes.Equal(a, b) {
		t.Error("two runs with the same inputs wrote different archives")
	}
}

func TestBadArguments(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "f")
	if err := os.WriteFile(src, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "out.tar")
	cases := []struct {
		name         string
		out          string
		names, files []string
		links        []string
		want         string
	}{
		{"no output", "", []string{"a:1"}, []string{"/f=" + src}, nil, "need -o"},
		{"no name", out, nil, []string{"/f=" + src}, nil, "need -o"},
		{"no file", out, []string{"a:1"}, nil, nil, "need -o"},
		{"relative dest", out, []string{"a:1"}, []string{"f=" + src}, nil, "bad -file"},
		{"no source", out, []string{"a:1"}, []string{"/f="}, nil, "bad -file"},
		{"no equals", out, []string{"a:1"}, []string{"/f"}, nil, "bad -file"},
		{"missing source", out, []string{"a:1"}, []string{"/f=" + filepath.Join(dir, "nope")}, nil, "read "},
		{"bad link", out, []string{"a:1"}, []string{"/f=" + src}, []string{"sh=busybox"}, "bad -link"},
		{"empty link target", out, []string{"a:1"}, []string{"/f=" + src}, []string{"/bin/sh="}, "bad -link"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := run(c.out, "", c.names, c.files, c.links)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want it to mention %q", err, c.want)
			}
			if _, statErr := os.Stat(out); statErr == nil {
				t.Fatalf("a failed run wrote %s", out)
			}
		})
	}
}
