package report

// Claim is a ResourceClaim the DRA driver prepared: the chunks each of its
// requests holds, under the pool allocation (never the token) it was
// granted as.
type Claim struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid"`
	// Pods are the UIDs of the pods the claim was reserved for at its last
	// Prepare (its token works only from them with tokenBinding "pod").
	Pods     []string       `json:"pods,omitempty"`
	Requests []ClaimRequest `json:"requests"`
	Chunks   int            `json:"chunks"`
	Bytes    int64          `json:"bytes"`
	GPUs     []int          `json:"gpus,omitempty"`
}

// ClaimRequest is one prepared request of a claim.
type ClaimRequest struct {
	Name       string   `json:"name"`
	Allocation string   `json:"allocation"`
	Chunks     []string `json:"chunks"`
	Bytes      int64    `json:"bytes"`
}
