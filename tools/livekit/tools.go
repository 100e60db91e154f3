//go:build tools

// Package tools pins the LiveKit server that vivant's tests and `vivant dev livekit` run on
// loopback. Nothing here is vivant code: the import only makes `go build` resolve the server's
// command at the version in go.mod. See docs/local_cluster.md.
package tools

import (
	_ "github.com/livekit/livekit-server/cmd/server"
)
