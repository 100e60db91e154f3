//go:build tools

// Package tools pins the real Kubernetes control plane and kwok that vivant's
// tests and `vivant dev cluster` run on loopback. Nothing here is vivant code:
// the imports only make `go build` resolve these commands at the versions in
// go.mod. See docs/ARCHITECTURE.md (local cluster).
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "sigs.k8s.io/kwok/cmd/kwok"
)
