package chart_test

import (
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// dockerfileRun returns the shell command of the Dockerfile's RUN
// instruction that builds ./cmd/agent, with line continuations joined.
func dockerfileRun(t *testing.T, dockerfile []byte) string {
	t.Helper()
	var found []string
	sc := bufio.NewScanner(bytes.NewReader(dockerfile))
	var cur strings.Builder
	for sc.Scan() {
		line := sc.Text()
		if cur.Len() == 0 && (strings.HasPrefix(strings.TrimSpace(line), "#") || strings.TrimSpace(line) == "") {
			continue
		}
		if strings.HasSuffix(line, `\`) {
			cur.WriteString(strings.TrimSuffix(line, `\`))
			continue
		}
		cur.WriteString(line)
		instr := strings.TrimSpace(cur.String())
		cur.Reset()
		if cmd, ok := strings.CutPrefix(instr, "RUN "); ok && strings.Contains(cmd, "./cmd/agent") {
			found = append(found, strings.TrimSpace(cmd))
		}
	}
	if len(found) != 1 {
		t.Fatalf("want exactly one RUN that builds ./cmd/agent in the Dockerfile, found %d: %q", len(found), found)
	}
	return found[0]
}

// makeRecipe returns the recipe of a Makefile target as the shell sees it
// ($$ unescaped).
func makeRecipe(t *testing.T, makefile []byte, target string) string {
	t.Helper()
	lines := strings.Split(string(makefile), "\n")
	for i, l := range lines {
		if l == target+":" {
			var recipe []string
			for _, r := range lines[i+1:] {
				if !strings.HasPrefix(r, "\t") {
					break
				}
				recipe = append(recipe, strings.ReplaceAll(strings.TrimPrefix(r, "\t"), "$$", "$"))
			}
			return strings.Join(recipe, "\n")
		}
	}
	t.Fatalf("Makefile has no target %q", target)
	return ""
}

// TestDockerfileBuild builds the agent with the Dockerfile's own build
// command (run verbatim by sh, with OUT pointing at a temporary directory as
// the Dockerfile's ENV OUT does), and checks the binary: it runs, it is
// stripped (-s), it holds no path of this checkout (-trimpath), and when the
// agent links go-nvml it is a cgo binary linked against glibc, as the
// distroless cc base expects. The Makefile's agent target must be the same
// command, so `make agent`, the image and this test cannot drift apart.
func TestDockerfileBuild(t *testing.T) {
	root := repoRoot(t)
	cmdline := dockerfileRun(t, readFile(t, "Dockerfile"))
	if got := makeRecipe(t, readFile(t, "Makefile"), "agent"); got != cmdline {
		t.Errorf("Makefile agent target\n  %s\ndiffers from the Dockerfile's\n  %s", got, cmdline)
	}
	if !regexp.MustCompile(`(^|\s)CGO_ENABLED=1\s`).MatchString(cmdline) {
		t.Errorf("build command %q does not enable cgo, which go-nvml needs", cmdline)
	}
	if !regexp.MustCompile(`-o "\$\{OUT\}/`).MatchString(cmdline) {
		t.Fatalf("build command %q does not write under ${OUT}", cmdline)
	}
	if _, err := exec.LookPath("sh"); err != nil {
		t.Skip("no sh to run the Dockerfile's command")
	}
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "sh", "-c", cmdline)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "OUT="+out)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", cmdline, err, b)
	}
	bin := filepath.Join(out, "kvpool-agent")
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatalf("built binary: %v", err)
	}
	defer f.Close()
	if f.Section(".symtab") != nil {
		t.Error("binary has a symbol table: -ldflags=-s did not take")
	}
	raw, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(raw, []byte(root+"/")) {
		t.Errorf("binary contains the checkout path %s: -trimpath did not take", root)
	}

	list := exec.Command("go", "list", "-deps", "./cmd/agent")
	list.Dir = root
	deps, err := list.Output()
	if err != nil {
		t.Fatalf("go list -deps ./cmd/agent: %v", err)
	}
	if bytes.Contains(deps, []byte("github.com/NVIDIA/go-nvml/")) {
		libs, err := f.ImportedLibraries()
		if err != nil {
			t.Fatal(err)
		}
		if !containsPrefix(libs, "libc.so") {
			t.Errorf("agent links go-nvml but is not a cgo binary on glibc: imported libraries %v", libs)
		}
	} else {
		t.Log("agent does not link go-nvml yet; cgo linkage not checked")
	}

	// It starts: a broken dynamic link (missing symbol, wrong loader) dies
	// before main, with the loader's message.
	run := exec.CommandContext(ctx, bin, "--help")
	b, _ := run.CombinedOutput()
	if run.ProcessState == nil || !run.ProcessState.Exited() {
		t.Fatalf("%s --help did not exit normally: %v\n%s", bin, run.ProcessState, b)
	}
	for _, bad := range []string{"undefined symbol", "error while loading shared libraries"} {
		if bytes.Contains(b, []byte(bad)) {
			t.Errorf("%s --help: %q\n%s", bin, bad, b)
		}
	}
}

func containsPrefix(list []string, prefix string) bool {
	for _, s := range list {
		if strings.HasPrefix(s, prefix) {
			return true
		}
	}
	return false
}
