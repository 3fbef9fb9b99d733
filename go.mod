module github.com/kvpool/kvpool

go 1.26.0

require golang.org/x/sys v0.50.0

require google.golang.org/protobuf v1.36.12
