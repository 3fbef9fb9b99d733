module github.com/kvpool/kvpool

go 1.26
