package config

import (
	"strings"
	"testing"
)

// TestStrictDecoding: the file is decoded strictly by Kubernetes' own
// decoders (sigs.k8s.io/yaml, sigs.k8s.io/json). A key set twice, a key
// the AgentConfig does not have, or one in the wrong case is an error that
// names it (every unknown key, with its path), and Parse returns no config.
func TestStrictDecoding(t *testing.T) {
	for _, c := range []struct {
		name, yaml string
		want       []string
	}{
		{"unknown field", head + "poolSize: 3\n", []string{`unknown field "poolSize"`}},
		{"every unknown field, with its path", head + "poolSize: 3\nsizing:\n  poolbytes: 3Gi\n  chunkBytes: 1Gi\n  chunks: 4\n",
			[]string{`unknown field "poolSize"`, `unknown field "sizing.poolbytes"`, `unknown field "sizing.chunks"`}},
		{"wrong case", head + "SocketDir: /x\n", []string{`unknown field "SocketDir"`}},
		{"wrong case, nested", head + "sizing:\n  PoolBytes: 3Gi\n", []string{`unknown field "sizing.PoolBytes"`}},
		{"the same key in two cases", head + "socketDir: /a\nSocketDir: /b\n", []string{`unknown field "SocketDir"`}},
		{"duplicate key", head + "socketDir: /a\nsocketDir: /b\n", []string{`key "socketDir" already set`}},
		{"duplicate nested key", head + "sizing:\n  poolBytes: 1Gi\n  poolBytes: 2Gi\n", []string{`key "poolBytes" already set`}},
		{"duplicate apiVersion", head + "apiVersion: config.kvpool.io/v1alpha1\n", []string{`key "apiVersion" already set`}},
		{"a value of the wrong type", head + "sizing:\n  fraction: [1]\n", []string{"sizing.fraction"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := Parse([]byte(c.yaml))
			if err == nil {
				t.Fatalf("Parse accepted it: %+v", got)
			}
			if got != nil {
				t.Errorf("Parse returned a config with the error")
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
		})
	}
}

// A YAML scalar goes into a string field as a string, as it did before the
// strict decoders: a numeric token is a token, not a type error.
func TestStrictDecodingKeepsScalarsAsStrings(t *testing.T) {
	c, err := Parse([]byte(head + "standalone:\n  tokens: [1234, dev]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Standalone.Tokens; len(got) != 2 || got[0] != "1234" || got[1] != "dev" {
		t.Errorf("tokens %q, want [1234 dev]", got)
	}
}
