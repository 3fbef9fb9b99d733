package main

import (
	"bytes"
	"io"
	"os"
	"strings"
	"testing"
)

// Misuse of the release commands is refused with a message naming the
// problem, before anything talks to a cluster.
func TestReleaseFlagsMisuse(t *testing.T) {
	t.Setenv("KUBECONFIG", "")
	cases := []struct {
		name, cmd string
		args      []string
		want      string
	}{
		{"install without chart", "install", []string{"-kubeconfig", "k"}, "-chart is required"},
		{"upgrade without chart", "upgrade", []string{"-kubeconfig", "k"}, "-chart is required"},
		{"no kubeconfig", "uninstall", nil, "no kubeconfig"},
		{"stray argument", "install", []string{"-chart", "c", "-kubeconfig", "k", "extra"}, "unexpected arguments"},
		{"unknown flag", "uninstall", []string{"-kubeconfig", "k", "-force"}, "flag provided but not defined"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := runRelease(c.cmd, c.args)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err %v, want one containing %q", err, c.want)
			}
		})
	}
	if err := runRelease("rollback", []string{"-chart", "c", "-kubeconfig", "k"}); err == nil {
		t.Error("an unknown release command was accepted")
	}
}

// render writes the chart's manifests as one YAML stream, without the
// NOTES and helpers, and refuses a missing chart.
func TestRenderRepoChart(t *testing.T) {
	if err := render([]string{"-chart", "does-not-exist"}); err == nil || !strings.Contains(err.Error(), "load chart") {
		t.Errorf("missing chart: %v", err)
	}
	if err := render([]string{"-chart", "../../../charts/kvpool", "stray"}); err == nil {
		t.Error("stray argument accepted")
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = w
	done := make(chan []byte)
	go func() { b, _ := io.ReadAll(r); done <- b }()
	err = render([]string{"-chart", "../../../charts/kvpool", "-namespace", "ns1"})
	w.Close()
	os.Stdout = stdout
	out := <-done
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"kind: DaemonSet", "kind: ConfigMap", "namespace: ns1"} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("rendered chart lacks %q", want)
		}
	}
	if bytes.Contains(out, []byte("NOTES.txt")) {
		t.Error("NOTES.txt rendered as a manifest")
	}
}
