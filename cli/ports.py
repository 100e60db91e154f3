"""Free loopback ports for the processes vivant starts side by side on one host: the worker's rank rendezvous, the
dev cluster's servers (etcd, kube-apiserver, LiveKit), and the servers the tests and benchmarks start.

A port is found by binding port 0 and closing the socket; another process can take it before the caller binds it, a
window every caller here accepts (each starts its server right away and fails loudly if the bind fails)."""

from __future__ import annotations

import socket


def free_port(kind: socket.SocketKind = socket.SOCK_STREAM) -> int:
    """A port on 127.0.0.1 that was free a moment ago, for `kind` (TCP by default, SOCK_DGRAM for UDP)."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
