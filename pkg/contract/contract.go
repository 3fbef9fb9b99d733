// Package contract is what the agent promises a pod and what a pod may rely
// on: where the socket is mounted and what it is called, the environment
// variables the device plugin sets, the form of an allocation token, the
// names of the chunks, and the extended resource a pod requests. The agent
// side (config, plugin, standalone, sizing) and the client side (client)
// both take these from here, so they cannot drift apart.
//
// It imports only the standard library: a client may depend on it without
// pulling in anything of the agent.
package contract

import (
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"path"
	"regexp"
	"strconv"
	"strings"
)

const (
	// DefaultResourceName is the extended resource a pod requests, one
	// unit per chunk.
	DefaultResourceName = "kvpool.io/host-kv"
	// SocketFile is the agent's socket file inside its socket directory,
	// on the host and in the container alike.
	SocketFile = "kvpool.sock"
	// ContainerSocketDir is where Allocate mounts the host's socket
	// directory in a container.
	ContainerSocketDir = "/var/run/kvpool"
	// ContainerSocket is the socket's path inside a container: the value
	// of EnvSocket, and the client's default.
	ContainerSocket = ContainerSocketDir + "/" + SocketFile
	// EnvSocket and EnvToken are the container environment variables
	// Allocate sets: the socket's path in the container and the
	// allocation token. The client reads them when its options leave the
	// socket or the token empty.
	EnvSocket = "KVPOOL_SOCKET"
	EnvToken  = "KVPOOL_TOKEN"
)

// ErrUnknownToken is the error for a token no allocation has: the socket
// server answers it as "unauthorized".
var ErrUnknownToken = errors.New("unknown allocation token")

// tokenBytes is the randomness of a token the agent makes.
const tokenBytes = 32

// NewToken returns a new allocation token: 32 random bytes in unpadded
// base64url (RFC 4648 section 5), 43 characters of A-Z, a-z, 0-9, '-' and
// '_'. Every token the agent hands out, in a cluster or standalone, has this
// form.
func NewToken() string {
	b := make([]byte, tokenBytes)
	rand.Read(b) // never fails: crypto/rand panics instead
	return base64.RawURLEncoding.EncodeToString(b)
}

// IsToken reports whether t has the form of a token NewToken makes (16
// random bytes or more, canonically encoded), as a checkpoint must hold.
func IsToken(t string) bool {
	b, err := base64.RawURLEncoding.DecodeString(t)
	return err == nil && len(b) >= 16 && base64.RawURLEncoding.EncodeToString(b) == t
}

// CheckStaticToken checks a token an operator configures for a standalone
// agent: any non-empty string without white space or commas (a list of
// them is written comma-separated).
func CheckStaticToken(t string) error {
	if t == "" || strings.ContainsAny(t, " \t\r\n\v\f,") {
		return fmt.Errorf("token %q: want a non-empty string without spaces or commas", t)
	}
	return nil
}

// ChunkID names chunk index of a GPU's pool: gpu<G>-numa<N>-<index>, with
// numaX when the NUMA node is unknown (negative). The ID is the device ID
// kubelet sees and the name the socket server uses.
func ChunkID(gpu, numa, index int) string {
	var b [48]byte
	return string(AppendChunkID(b[:0], gpu, numa, index))
}

// AppendChunkID appends ChunkID(gpu, numa, index) to b.
func AppendChunkID(b []byte, gpu, numa, index int) []byte {
	b = strconv.AppendInt(append(b, "gpu"...), int64(gpu), 10)
	b = append(b, "-numa"...)
	if numa >= 0 {
		b = strconv.AppendInt(b, int64(numa), 10)
	} else {
		b = append(b, 'X')
	}
	return strconv.AppendInt(append(b, '-'), int64(index), 10)
}

// ParseChunkID is the inverse of ChunkID; numa is -1 for numaX. It accepts
// exactly what ChunkID makes: ChunkID(ParseChunkID(id)) == id.
func ParseChunkID(id string) (gpu, numa, index int, err error) {
	bad := func(why string) (int, int, int, error) {
		return 0, 0, 0, fmt.Errorf("chunk ID %q: %s (want gpu<G>-numa<N>-<index>)", id, why)
	}
	parts := strings.Split(id, "-")
	if len(parts) != 3 {
		return bad("not three dash-separated parts")
	}
	g, ok := strings.CutPrefix(parts[0], "gpu")
	if !ok {
		return bad("no gpu prefix")
	}
	n, ok := strings.CutPrefix(parts[1], "numa")
	if !ok {
		return bad("no numa prefix")
	}
	if gpu, ok = decimal(g); !ok {
		return bad("bad GPU index")
	}
	if n == "X" {
		numa = -1
	} else if numa, ok = decimal(n); !ok {
		return bad("bad NUMA node")
	}
	if index, ok = decimal(parts[2]); !ok {
		return bad("bad chunk index")
	}
	return gpu, numa, index, nil
}

// decimal parses a canonical non-negative decimal (no sign, no leading
// zero) small enough for any real machine.
func decimal(s string) (int, bool) {
	if s == "" || len(s) > 9 || (len(s) > 1 && s[0] == '0') {
		return 0, false
	}
	v := 0
	for _, c := range s {
		if c < '0' || c > '9' {
			return 0, false
		}
		v = v*10 + int(c-'0')
	}
	return v, true
}

var (
	dnsSubdomain = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
	qualName     = regexp.MustCompile(`^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$`)
)

// CheckResourceName checks an extended resource name as kubelet and the API
// server accept it: domain/name, the domain a fully qualified DNS subdomain
// outside kubernetes.io and k8s.io and not starting with "requests.", the
// name 1 to 63 letters, digits, '-', '_' or '.', starting and ending with a
// letter or digit. The error starts with the name quoted (or "is empty"),
// for the caller to prefix with what it checked.
func CheckResourceName(name string) error {
	domain, n, ok := strings.Cut(name, "/")
	switch {
	case name == "":
		return errors.New("is empty")
	case !ok || strings.Contains(n, "/"):
		return fmt.Errorf("%q is not of the form domain/name (e.g. %s)", name, DefaultResourceName)
	case len(domain) > 253 || !dnsSubdomain.MatchString(domain):
		return fmt.Errorf("%q: domain %q is not a DNS subdomain", name, domain)
	case !strings.Contains(domain, "."):
		return fmt.Errorf("%q: domain %q is not fully qualified", name, domain)
	case domain == "kubernetes.io" || strings.HasSuffix(domain, ".kubernetes.io") || domain == "k8s.io" || strings.HasSuffix(domain, ".k8s.io"):
		return fmt.Errorf("%q: the %s domain is reserved for Kubernetes", name, domain)
	case strings.HasPrefix(domain, "requests."):
		return fmt.Errorf("%q: a domain starting with \"requests.\" names a quota, not a resource", name)
	case len(n) > 63 || !qualName.MatchString(n):
		return fmt.Errorf("%q: name %q must be 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit", name, n)
	}
	return nil
}

// SocketPath is the socket inside a host socket directory.
func SocketPath(dir string) string { return path.Join(dir, SocketFile) }
