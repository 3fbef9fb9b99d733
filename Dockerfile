# syntax=docker/dockerfile:1
#
# kvpool images, built from the repository root:
#
#   docker build -t ghcr.io/kvpool/kvpool-agent:0.1.0 .                      # node agent (default target)
#   docker build --target kvclient -t ghcr.io/kvpool/kvclient:0.1.0 .        # example client
#
# or `make image`. The agent is built with cgo: go-nvml dlopens
# libnvidia-ml.so.1 at run time through libc's dlopen, so the binary links
# glibc dynamically. The builder and the runtime are the same Debian release
# (13, trixie), so the glibc symbol versions the binary needs are the ones the
# runtime has. Neither NVML nor CUDA is in the image: on a GPU node the
# NVIDIA container runtime injects libnvidia-ml (NVIDIA_VISIBLE_DEVICES,
# NVIDIA_DRIVER_CAPABILITIES=utility, set by the chart); without it the agent
# says so and runs without GPU discovery.
#
# Pinning: both bases are pinned by tag here because this repository is built
# where images cannot be pulled to read their digests. For a release, pin by
# digest as well: make image RUNTIME_IMAGE=gcr.io/distroless/cc-debian13:nonroot@sha256:<digest>
ARG GO_IMAGE=golang:1.26-trixie
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian13:nonroot
ARG CLIENT_RUNTIME_IMAGE=gcr.io/distroless/static-debian13:nonroot

FROM ${GO_IMAGE} AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ENV OUT=/out
# The agent's one build command. test/chart runs exactly this line, and checks
# that the Makefile's `agent` target is the same, so the image cannot drift
# from what CI compiles.
RUN CGO_ENABLED=1 go build -trimpath -buildvcs=false -ldflags="-s -w" -o "${OUT}/kvpool-agent" ./cmd/agent

# The example client needs no cgo: a static binary on distroless static.
FROM build AS build-kvclient
RUN CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags="-s -w" -o "${OUT}/kvclient" ./cmd/kvclient

# Example client for config/examples, non-root.
FROM ${CLIENT_RUNTIME_IMAGE} AS kvclient
COPY --from=build-kvclient /out/kvclient /usr/local/bin/kvclient
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kvclient"]

# The node agent. distroless cc: glibc, libgcc and CA certificates, no shell,
# no package manager. The image's default user is non-root (65532), which is
# enough for `--standalone`. The Helm chart runs the agent as uid 0 with every
# capability dropped except IPC_LOCK and SYS_NICE, because kubelet's
# device-plugin and pod-resources sockets are owned by root and not writable
# by any other user (see charts/kvpool/README.md).
FROM ${RUNTIME_IMAGE} AS agent
COPY --from=build /out/kvpool-agent /usr/local/bin/kvpool-agent
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kvpool-agent"]
