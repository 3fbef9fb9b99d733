package chaos

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// The environment variables the chaos test reads are the ones its
// package comment and docs/architecture.md name (issue 23: the docs said
// KVPOOL_CHAOS_MAX_UP, the code read KVPOOL_CHAOS_MAX_UP_MS).
func TestKnobsDocumented(t *testing.T) {
	src, err := os.ReadFile("chaos_test.go")
	if err != nil {
		t.Fatal(err)
	}
	loss, err := os.ReadFile("keeperloss_test.go")
	if err != nil {
		t.Fatal(err)
	}
	spare, err := os.ReadFile("spare_test.go")
	if err != nil {
		t.Fatal(err)
	}
	arch, err := os.ReadFile("../../docs/architecture.md")
	if err != nil {
		t.Fatal(err)
	}
	read := regexp.MustCompile(`envInt\(t, "(KVPOOL_CHAOS_[A-Z_]+)"`).FindAllStringSubmatch(string(src)+string(loss)+string(spare), -1)
	if len(read) == 0 {
		t.Fatal("no knob found in chaos_test.go")
	}
	comment := string(src[:strings.Index(string(src), "package chaos")])
	named := regexp.MustCompile(`KVPOOL_CHAOS_[A-Z_]+`)
	for _, doc := range []struct{ name, text string }{{"the package comment", comment}, {"docs/architecture.md", string(arch)}} {
		seen, done := map[string]bool{}, map[string]bool{}
		for _, n := range named.FindAllString(doc.text, -1) {
			seen[n] = true
		}
		for _, m := range read {
			if !seen[m[1]] && !done[m[1]] {
				t.Errorf("%s does not name %s, which the test reads", doc.name, m[1])
			}
			delete(seen, m[1])
			done[m[1]] = true // a knob two tests read
		}
		for n := range seen {
			t.Errorf("%s names %s, which the test does not read", doc.name, n)
		}
	}
}
