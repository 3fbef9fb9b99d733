package chart_test

import (
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/kvpool/kvpool/internal/config"
)

// checkTenantBoundary checks the chart's part of docs/security.md: the
// token binding (hostPID, the pod log directory, the agent config), the Go
// heap limit under the headroom, the NetworkPolicy and the admission policy
// that keeps each agent to its own node's KVPoolNode.
func checkTenantBoundary(t *testing.T, vs valueSet, r rendered) {
	t.Helper()
	c, err := config.Parse([]byte(r.cm.Data["agent.yaml"]))
	if err != nil {
		t.Fatalf("agent config: %v", err)
	}
	if c.TokenBinding != vs.tokenBinding || c.PodLogsDir != "/var/log/pods" {
		t.Errorf("agent config tokenBinding %q podLogsDir %q, want %q /var/log/pods", c.TokenBinding, c.PodLogsDir, vs.tokenBinding)
	}
	if err := config.CheckDirs(c.SocketDir, c.StateDir); err != nil {
		t.Errorf("rendered directories: %v", err)
	}
	checkStreamBounds(t, vs, c)
	for _, e := range r.ds.Spec.Template.Spec.Containers[0].Env {
		if e.Name == "KVPOOL_KEEPER_SOCKET" {
			if err := config.CheckKeeperSocket(c.SocketDir, e.Value); err != nil {
				t.Errorf("rendered keeper socket: %v", err)
			}
		}
	}

	var gml *corev1.EnvVar
	for i, e := range r.ds.Spec.Template.Spec.Containers[0].Env {
		if e.Name == "GOMEMLIMIT" {
			gml = &r.ds.Spec.Template.Spec.Containers[0].Env[i]
		}
	}
	pct := int64(80)
	if vs.netPolicy { // the value set that also sets goMemLimitPercent: 50
		pct = 50
	}
	if want := fmt.Sprint(mustBytes(t, vs.headroom) * pct / 100); gml == nil || gml.Value != want {
		t.Errorf("GOMEMLIMIT = %+v, want %s (%d%% of the headroom %s)", gml, want, pct, vs.headroom)
	}

	if (r.netpol != nil) != vs.netPolicy {
		t.Fatalf("NetworkPolicy rendered %v, want %v", r.netpol != nil, vs.netPolicy)
	}
	if np := r.netpol; np != nil {
		for k, v := range r.ds.Spec.Selector.MatchLabels {
			if np.Spec.PodSelector.MatchLabels[k] != v {
				t.Errorf("NetworkPolicy does not select the agent pods (%s=%s)", k, v)
			}
		}
		if len(np.Spec.PolicyTypes) != 1 || np.Spec.PolicyTypes[0] != "Ingress" || len(np.Spec.Ingress) != 2 {
			t.Fatalf("NetworkPolicy %+v, want Ingress with two rules", np.Spec)
		}
		m, h := np.Spec.Ingress[0], np.Spec.Ingress[1]
		if m.Ports[0].Port.String() != "metrics" || m.From[0].NamespaceSelector == nil ||
			h.Ports[0].Port.String() != "health" || h.From[0].IPBlock == nil || h.From[0].IPBlock.CIDR != "10.0.0.0/16" {
			t.Errorf("NetworkPolicy rules %+v", np.Spec.Ingress)
		}
	}

	if (r.vap != nil) != vs.rbac || (r.vapb != nil) != vs.rbac {
		t.Fatalf("ValidatingAdmissionPolicy rendered %v, binding %v, want %v", r.vap != nil, r.vapb != nil, vs.rbac)
	}
	if r.vap == nil {
		return
	}
	if r.vapb.Spec.PolicyName != r.vap.Name || len(r.vapb.Spec.ValidationActions) != 1 || r.vapb.Spec.ValidationActions[0] != "Deny" {
		t.Errorf("binding %+v does not deny through policy %s", r.vapb.Spec, r.vap.Name)
	}
	sa := "system:serviceaccount:" + namespace + ":" + r.sa.Name
	if mc := r.vap.Spec.MatchConditions; len(mc) != 1 || !strings.Contains(mc[0].Expression, `"`+sa+`"`) {
		t.Errorf("policy match conditions %+v, want the agents' service account %s", mc, sa)
	}
	rules := r.vap.Spec.MatchConstraints.ResourceRules
	if len(rules) != 1 || strings.Join(rules[0].APIGroups, ",") != "kvpool.io" ||
		strings.Join(rules[0].Resources, ",") != "kvpoolnodes,kvpoolnodes/status" {
		t.Errorf("policy resource rules %+v", rules)
	}
	if v := r.vap.Spec.Validations; len(v) != 1 || !strings.Contains(v[0].Expression, "request.userInfo.extra['authentication.kubernetes.io/node-name'].exists(n, n == request.name)") {
		t.Errorf("policy validations %+v", v)
	}
}

// The measured cost of the stream tables (docs/sizing.md, "Agent memory"):
// heap and books memfd per stream, and per byte of its names.
const (
	costPerStream   = 213
	costPerNameByte = 3
)

// checkStreamBounds: the chart derives the bounds over every session's
// stream tables from pool.headroom, so that at those bounds the stream
// tables take at most about 40 % of it (the Go heap limit is 80 %).
func checkStreamBounds(t *testing.T, vs valueSet, c *config.Config) {
	t.Helper()
	h := mustBytes(t, vs.headroom)
	l := c.Limits
	if want := max(h/1024, 1); int64(l.MaxStreams) != want {
		t.Errorf("limits.maxStreams %d, want pool.headroom / 1Ki = %d", l.MaxStreams, want)
	}
	if want := max(h/16, 2048); int64(l.MaxNameBytes) != want {
		t.Errorf("limits.maxNameBytes %d, want pool.headroom / 16 = %d", l.MaxNameBytes, want)
	}
	if want := max(h, 1<<24); int64(l.MaxDevicePagesTotal) != want || l.MaxDevicePagesTotal < l.MaxDevicePages {
		t.Errorf("limits.maxDevicePagesTotal %d, want pool.headroom device pages (a bit each: an eighth of it) = %d, and at least maxDevicePages %d",
			l.MaxDevicePagesTotal, want, l.MaxDevicePages)
	}
	if l.MaxStreamsPerSession > l.MaxStreams || l.MaxNameBytesPerSession > l.MaxNameBytes {
		t.Errorf("one session's bounds %d streams, %d name bytes exceed every session's %d, %d",
			l.MaxStreamsPerSession, l.MaxNameBytesPerSession, l.MaxStreams, l.MaxNameBytes)
	}
	if cost := int64(l.MaxStreams)*costPerStream + int64(l.MaxNameBytes)*costPerNameByte; h >= 64<<20 && cost > h*45/100 {
		t.Errorf("stream tables at their bounds cost about %d MiB, more than 45%% of the %d MiB headroom", cost>>20, h>>20)
	}
}
