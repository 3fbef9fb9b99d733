package chart_test

import (
	"regexp"
	"strings"
	"sync"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"helm.sh/helm/v4/pkg/chart"
	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/common/util"
	"helm.sh/helm/v4/pkg/chart/loader"
	"helm.sh/helm/v4/pkg/engine"
)

var (
	loadOnce   sync.Once
	loadedCh   chart.Charter
	loadChErr  error
	plainWhole = regexp.MustCompile(`^[1-9][0-9]{0,12}(Ki|Mi|Gi)?$`)
)

// FuzzPoolBytes feeds arbitrary strings to pool.bytes, the value the chart
// parses itself (schema pattern plus the kvpool.bytes template). Whatever the
// input, either rendering fails with an error naming the value, or the memory
// request is exactly that quantity (as apimachinery reads it) plus the
// headroom. Whole quantities of at least one chunk (2Mi here) must render.
func FuzzPoolBytes(f *testing.F) {
	for _, s := range []string{"16Gi", "1", "0", "1.5Gi", "16GB", "010Gi", "9007199254740991Ki", "8191Pi", "1e9", "+1Gi", "-1Gi", " 1Gi", "1Gi\n", "１Gi"} {
		f.Add(s)
	}
	loadOnce.Do(func() { loadedCh, loadChErr = loader.Load(chartDir(f)) })
	if loadChErr != nil {
		f.Fatal(loadChErr)
	}
	headroom := resource.MustParse("512Mi")
	f.Fuzz(func(t *testing.T, s string) {
		vals := map[string]any{"pool": map[string]any{"bytes": s, "chunkBytes": "2Mi"}}
		opts := common.ReleaseOptions{Name: releaseName, Namespace: namespace, IsInstall: true}
		rv, err := util.ToRenderValues(loadedCh, vals, opts, common.DefaultCapabilities)
		var files map[string]string
		if err == nil {
			files, err = engine.Render(loadedCh, rv)
		}
		if err != nil {
			if !strings.Contains(err.Error(), "bytes") {
				t.Fatalf("pool.bytes=%q: error does not name the value: %v", s, err)
			}
			if q, perr := resource.ParseQuantity(s); perr == nil && plainWhole.MatchString(s) && q.Value() >= 2<<20 {
				t.Fatalf("pool.bytes=%q is a plain whole quantity but was refused: %v", s, err)
			}
			return
		}
		want, perr := resource.ParseQuantity(s)
		if perr != nil {
			t.Fatalf("pool.bytes=%q rendered, but it is not a Kubernetes quantity: %v", s, perr)
		}
		want.Add(headroom)
		pool := want.Value() - headroom.Value()
		want.Add(*resource.NewQuantity((pool+511)/512, resource.BinarySI))     // the page tables
		want.Add(*resource.NewQuantity(linkBytes(pool), resource.BinarySI))    // the page links
		want.Add(*resource.NewQuantity(headroom.Value()/2, resource.BinarySI)) // the spare's
		var ds *appsv1.DaemonSet
		for _, o := range decodeAll(t, files) {
			if d, ok := o.typed.(*appsv1.DaemonSet); ok && !strings.HasSuffix(d.Name, "-keeper") {
				ds = d
			}
		}
		if ds == nil {
			t.Fatal("no DaemonSet")
		}
		got := ds.Spec.Template.Spec.Containers[0].Resources.Limits[corev1.ResourceMemory]
		if got.Cmp(want) != 0 || got.Sign() <= 0 {
			t.Fatalf("pool.bytes=%q: memory limit %s, want %s", s, got.String(), want.String())
		}
	})
}
