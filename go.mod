module github.com/kvpool/kvpool

go 1.26.0

require golang.org/x/sys v0.50.0
