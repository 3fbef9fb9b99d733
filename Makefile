# Developer entry points. CI runs .ci/run, which uses the same commands.
OUT ?= bin
IMAGE_REPO ?= ghcr.io/kvpool
VERSION ?= 0.1.0
RUNTIME_IMAGE ?= gcr.io/distroless/cc-debian13:nonroot
export OUT

.PHONY: all build agent test lint chart-test image

all: build lint test

build:
	go build ./...

# The Dockerfile's build command, character for character (test/chart checks).
agent:
	CGO_ENABLED=1 go build -trimpath -buildvcs=false -ldflags="-s -w" -o "$${OUT}/kvpool-agent" ./cmd/agent

test:
	go test -race ./...
	cd test/chart && go test -race ./...

# go vet, gofmt, then golangci-lint (.golangci.yml) at the version hack/lint.sh pins.
lint:
	go vet ./...
	@files=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$files" ]; then echo "gofmt needed on: $$files"; exit 1; fi
	hack/lint.sh

# Render, lint and check the Helm chart with the Helm v4 SDK (no helm binary
# needed). test/chart is its own module: the Helm SDK stays out of go.mod.
chart-test:
	cd test/chart && go test ./...

image:
	docker build --build-arg RUNTIME_IMAGE=$(RUNTIME_IMAGE) -t $(IMAGE_REPO)/kvpool-agent:$(VERSION) .
	docker build --build-arg RUNTIME_IMAGE=$(RUNTIME_IMAGE) --target kvclient -t $(IMAGE_REPO)/kvclient:$(VERSION) .
