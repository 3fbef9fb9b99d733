package contract

import (
	"encoding/base64"
	"strings"
	"testing"
)

func TestChunkID(t *testing.T) {
	for _, c := range []struct {
		gpu, numa, idx int
		id             string
	}{{0, 0, 0, "gpu0-numa0-0"}, {3, 1, 17, "gpu3-numa1-17"}, {1, -1, 2, "gpu1-numaX-2"}} {
		if got := ChunkID(c.gpu, c.numa, c.idx); got != c.id {
			t.Errorf("ChunkID(%d,%d,%d) = %s", c.gpu, c.numa, c.idx, got)
		}
		g, n, i, err := ParseChunkID(c.id)
		if err != nil || g != c.gpu || n != c.numa || i != c.idx {
			t.Errorf("ParseChunkID(%s) = %d %d %d %v", c.id, g, n, i, err)
		}
	}
	for _, bad := range []string{"", "gpu0-numa0", "gpu0-numa0-1-2", "cpu0-numa0-1", "gpu0-node0-1", "gpu-numa0-1",
		"gpu0-numa-1-1", "gpu00-numa0-1", "gpu0-numa0-+1", "gpu0-numaY-1", "gpu0-numa0-1234567890", "gpu0-numa0-c0007"} {
		if _, _, _, err := ParseChunkID(bad); err == nil || !strings.Contains(err.Error(), "chunk ID") {
			t.Errorf("ParseChunkID(%q) err = %v", bad, err)
		}
	}
}

func FuzzParseChunkID(f *testing.F) {
	for _, s := range []string{"gpu0-numa0-0", "gpu7-numaX-1023", "gpu1-numa01-2", "gpu-numa-"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, id string) {
		g, n, i, err := ParseChunkID(id)
		if err != nil {
			return
		}
		if back := ChunkID(g, n, i); back != id {
			t.Fatalf("ParseChunkID(%q) then ChunkID = %q", id, back)
		}
	})
}

// Every token NewToken makes has the documented form, and no two are alike.
func TestNewToken(t *testing.T) {
	seen := map[string]bool{}
	for range 100 {
		tok := NewToken()
		if len(tok) != 43 || !IsToken(tok) || CheckStaticToken(tok) != nil || seen[tok] {
			t.Fatalf("token %q: length %d, IsToken %v, static check %v, seen %v", tok, len(tok), IsToken(tok), CheckStaticToken(tok), seen[tok])
		}
		if b, err := base64.RawURLEncoding.DecodeString(tok); err != nil || len(b) != 32 {
			t.Fatalf("token %q does not decode to 32 bytes: %d, %v", tok, len(b), err)
		}
		seen[tok] = true
	}
	for _, bad := range []string{"", "short", "kvp-0123", "with space in it but long enough", NewToken() + "=", strings.Repeat("A", 43) + " "} {
		if IsToken(bad) {
			t.Errorf("IsToken(%q) = true", bad)
		}
	}
}

func TestCheckStaticToken(t *testing.T) {
	for _, ok := range []string{"tok", "c-abi", "kvp-0123", NewToken()} {
		if err := CheckStaticToken(ok); err != nil {
			t.Errorf("CheckStaticToken(%q) = %v", ok, err)
		}
	}
	for _, bad := range []string{"", "a b", "a,b", "a\tb", "a\n"} {
		if err := CheckStaticToken(bad); err == nil || !strings.Contains(err.Error(), "without spaces or commas") {
			t.Errorf("CheckStaticToken(%q) = %v", bad, err)
		}
	}
}

func TestCheckResourceName(t *testing.T) {
	for _, ok := range []string{DefaultResourceName, "example.com/kv", "a.b.c/X_y.z-1"} {
		if err := CheckResourceName(ok); err != nil {
			t.Errorf("CheckResourceName(%q) = %v", ok, err)
		}
	}
	for _, c := range []struct{ name, want string }{
		{"", "is empty"},
		{"hostkv", "not of the form domain/name"},
		{"a.io/b/c", "not of the form domain/name"},
		{"kvpool/kv", "not fully qualified"},
		{"KVPool.io/kv", "not a DNS subdomain"},
		{"kubernetes.io/kv", "reserved for Kubernetes"},
		{"x.k8s.io/kv", "reserved for Kubernetes"},
		{"requests.kvpool.io/kv", "names a quota"},
		{"kvpool.io/-kv", `name "-kv" must be`},
		{"kvpool.io/host kv", `name "host kv" must be`},
		{"kvpool.io/" + strings.Repeat("k", 64), "must be 1-63"},
	} {
		if err := CheckResourceName(c.name); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("CheckResourceName(%q) = %v, want %q", c.name, err, c.want)
		}
	}
}

func TestContainerSocket(t *testing.T) {
	if ContainerSocket != "/var/run/kvpool/kvpool.sock" || SocketPath(ContainerSocketDir) != ContainerSocket {
		t.Errorf("ContainerSocket %q, SocketPath(ContainerSocketDir) %q", ContainerSocket, SocketPath(ContainerSocketDir))
	}
}
