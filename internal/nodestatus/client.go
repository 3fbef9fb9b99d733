package nodestatus

import (
	"context"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/kubernetes"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"

	"github.com/kvpool/kvpool/api/v1alpha1"
)

// Client is what a Writer needs of the API server: the Node, for the owner
// reference of a KVPoolNode it creates, and the node's KVPoolNode. Errors
// from the API server are *apierrors.StatusError, so that
// apierrors.IsNotFound, IsConflict and IsAlreadyExists tell them apart: the
// Writer creates a missing object and retries a conflict.
type Client interface {
	// GetNode reads the Node name.
	GetNode(ctx context.Context, name string) (*corev1.Node, error)
	// Get reads the KVPoolNode name.
	Get(ctx context.Context, name string) (*v1alpha1.KVPoolNode, error)
	// Create creates obj and returns it as stored (with its
	// resourceVersion); the API server ignores its status.
	Create(ctx context.Context, obj *v1alpha1.KVPoolNode) (*v1alpha1.KVPoolNode, error)
	// UpdateStatus writes obj's status through the status subresource. It
	// is a conflict when obj's resourceVersion is not the stored one.
	UpdateStatus(ctx context.Context, obj *v1alpha1.KVPoolNode) (*v1alpha1.KVPoolNode, error)
}

// NewClient returns the agent's Client: cs reads the Node, and a REST
// client of the kvpool.io/v1alpha1 group, built from rc, the KVPoolNode.
// It is client-go alone, with a scheme of that one group: the
// controller-runtime client it replaces cost the agent about 6 ms of
// package init at every start (its apiutil builds a second scheme of all
// of client-go's types) for these four calls.
func NewClient(rc *rest.Config, cs kubernetes.Interface) (Client, error) {
	s := runtime.NewScheme()
	if err := v1alpha1.AddToScheme(s); err != nil {
		return nil, err
	}
	cfg := rest.CopyConfig(rc)
	cfg.GroupVersion = &v1alpha1.GroupVersion
	cfg.APIPath = "/apis"
	// A custom resource has no protobuf form.
	cfg.ContentType = runtime.ContentTypeJSON
	cfg.AcceptContentTypes = runtime.ContentTypeJSON
	cfg.NegotiatedSerializer = serializer.NewCodecFactory(s).WithoutConversion()
	if cfg.UserAgent == "" {
		cfg.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	r, err := rest.RESTClientFor(cfg)
	if err != nil {
		return nil, err
	}
	return &kubeClient{nodes: cs.CoreV1().Nodes(), rest: r}, nil
}

// kubeClient is NewClient's Client.
type kubeClient struct {
	nodes typedcorev1.NodeInterface
	rest  rest.Interface
}

// kvpoolnodes is the KVPoolNode's resource, its path under the group.
const kvpoolnodes = "kvpoolnodes"

func (c *kubeClient) GetNode(ctx context.Context, name string) (*corev1.Node, error) {
	return c.nodes.Get(ctx, name, metav1.GetOptions{})
}

func (c *kubeClient) Get(ctx context.Context, name string) (*v1alpha1.KVPoolNode, error) {
	out := &v1alpha1.KVPoolNode{}
	if err := c.rest.Get().Resource(kvpoolnodes).Name(name).Do(ctx).Into(out); err != nil {
		return nil, err
	}
	return out, nil
}

func (c *kubeClient) Create(ctx context.Context, obj *v1alpha1.KVPoolNode) (*v1alpha1.KVPoolNode, error) {
	out := &v1alpha1.KVPoolNode{}
	if err := c.rest.Post().Resource(kvpoolnodes).Body(obj).Do(ctx).Into(out); err != nil {
		return nil, err
	}
	return out, nil
}

func (c *kubeClient) UpdateStatus(ctx context.Context, obj *v1alpha1.KVPoolNode) (*v1alpha1.KVPoolNode, error) {
	out := &v1alpha1.KVPoolNode{}
	if err := c.rest.Put().Resource(kvpoolnodes).Name(obj.Name).SubResource("status").Body(obj).Do(ctx).Into(out); err != nil {
		return nil, err
	}
	return out, nil
}
