#!/usr/bin/env bash
# Regenerates pkg/wire/kvpool.pb.go from pkg/wire/kvpool.proto.
# Needs protoc (Debian: apt-get install -y protobuf-compiler) and
# protoc-gen-go v1.36.12 (go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$(go env GOPATH)/bin:$PATH"
protoc --proto_path=pkg/wire --go_out=pkg/wire --go_opt=paths=source_relative pkg/wire/kvpool.proto
