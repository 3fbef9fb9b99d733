module github.com/kvpool/kvpool

go 1.26.0

require (
	golang.org/x/sys v0.50.0
	google.golang.org/grpc v1.85.0
	k8s.io/kubelet v0.37.2
)

require (
	golang.org/x/net v0.60.0 // indirect
	golang.org/x/text v0.42.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260817212433-ac3dfec99bb1 // indirect
	google.golang.org/protobuf v1.36.12 // indirect
)
