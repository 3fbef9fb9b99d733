package plugin

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// PodResourcesClient asks kubelet's PodResources v1 service which pod holds
// which devices.
type PodResourcesClient struct {
	conn    *grpc.ClientConn
	client  podresourcesv1.PodResourcesListerClient
	timeout time.Duration
}

// DialPodResources connects lazily to the PodResources socket (usually
// /var/lib/kubelet/pod-resources/kubelet.sock); the first call dials.
func DialPodResources(socket string) (*PodResourcesClient, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("pod resources client for %s: %w", socket, err)
	}
	return &PodResourcesClient{conn: conn, client: podresourcesv1.NewPodResourcesListerClient(conn), timeout: 5 * time.Second}, nil
}

// Held lists the devices of resource that running pods hold, mapped to
// "namespace/name" of the holder.
func (c *PodResourcesClient) Held(ctx context.Context, resource string) (map[string]string, error) {
	resp, err := c.list(ctx)
	if err != nil {
		return nil, err
	}
	held := make(map[string]string)
	for _, pod := range resp.GetPodResources() {
		name := pod.GetNamespace() + "/" + pod.GetName()
		for _, ctr := range pod.GetContainers() {
			for _, d := range ctr.GetDevices() {
				if d.GetResourceName() != resource {
					continue
				}
				for _, id := range d.GetDeviceIds() {
					held[id] = name
				}
			}
		}
	}
	return held, nil
}

func (c *PodResourcesClient) list(ctx context.Context) (*podresourcesv1.ListPodResourcesResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	resp, err := c.client.List(ctx, &podresourcesv1.ListPodResourcesRequest{})
	if err != nil {
		return nil, fmt.Errorf("pod resources list: %w", err)
	}
	return resp, nil
}

// Close releases the connection.
func (c *PodResourcesClient) Close() error { return c.conn.Close() }
