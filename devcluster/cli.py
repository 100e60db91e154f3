"""`vivant dev cluster up|down|status|build` and `vivant dev livekit up|down|status`: a local GPU fleet and a
LiveKit server on this machine (see docs/local_cluster.md).

`up` builds (first time) or finds the cached control-plane binaries, starts etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, kwok with simulated GPU nodes, a Redis and the pod runner,
writes a kubeconfig and returns; everything keeps running until `down`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from vivant.devcluster.binaries import BinaryError, cache_root, ensure_binaries


def default_state_dir() -> Path:
    return Path(os.environ.get("VIVANT_DEV_CLUSTER_DIR") or cache_root() / "dev-cluster")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", required=True, metavar="cluster")
    cluster = sub.add_parser("cluster", help="a local Kubernetes control plane with simulated GPU nodes")
    verbs = cluster.add_subparsers(dest="verb", required=True, metavar="up|down|status|build")
    up = verbs.add_parser("up", help="start the cluster (builds the binaries the first time)")
    up.add_argument("--nodes", type=int, default=2, help="simulated GPU nodes (default 2)")
    up.add_argument("--gpus-per-node", type=int, default=8, help="nvidia.com/gpu capacity of each node (default 8)")
    up.add_argument("--node-prefix", default="h100", help="node names are <prefix>-<n> (default h100)")
    up.add_argument("--label", action="append", default=None, metavar="KEY=VALUE",
                    help="node label (repeatable; default: an H100 pool's labels)")
    up.add_argument("--taint", action="append", default=None, metavar="KEY=VALUE:EFFECT",
                    help="node taint (repeatable; default nvidia.com/gpu=present:NoSchedule; --taint none for none)")
    up.add_argument("--no-pods", action="store_true", help="do not run processes behind pods (no pod runner)")
    up.add_argument("--no-redis", action="store_true", help="do not start a Redis for the chart's default Secret")
    for v in (up, verbs.add_parser("down", help="stop every process of the cluster"),
              verbs.add_parser("status", help="print the cluster's processes and nodes as JSON")):
        v.add_argument("--state-dir", type=Path, default=None, help="where the cluster keeps its state "
                       "(default $VIVANT_DEV_CLUSTER_DIR or ~/.cache/vivant/dev-cluster)")
    verbs.add_parser("build", help="build (or find cached) kube-apiserver, controller-manager, scheduler, kwok")
    lk = sub.add_parser("livekit", help="a LiveKit server on loopback (built from tools/livekit/go.mod)")
    lk_verbs = lk.add_subparsers(dest="verb", required=True, metavar="up|down|status|build")
    lk_verbs.add_parser("build", help="build (or find cached) livekit-server")
    for v in (lk_verbs.add_parser("up", help="start livekit-server (builds it the first time)"),
              lk_verbs.add_parser("down", help="stop it"), lk_verbs.add_parser("status", help="print its URL and keys")):
        v.add_argument("--state-dir", type=Path, default=None, help="where the server keeps its state "
                       "(default $VIVANT_DEV_CLUSTER_DIR or ~/.cache/vivant/dev-cluster, subfolder livekit)")
    lk_verbs.choices["up"].add_argument("--api-key", default=None, help="API key (default: generated)")
    lk_verbs.choices["up"].add_argument("--api-secret", default=None, help="API secret (default: generated)")


def _labels(items: list[str] | None):
    from vivant.devcluster.cluster import NodePoolSpec

    if items is None:
        return NodePoolSpec.labels
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--label {item!r}: expected KEY=VALUE")
        out.append((key, value))
    return tuple(out)


def _livekit(args: argparse.Namespace) -> int:
    from vivant.devcluster.livekit import LiveKitState, LocalLiveKit

    if args.verb == "build":
        from vivant.devcluster.binaries import ensure_livekit_server

        try:
            print(ensure_livekit_server())
        except BinaryError as exc:
            print(f"vivant dev livekit build: {exc}")
            return 1
        return 0
    folder = (args.state_dir or default_state_dir()) / "livekit"
    if args.verb == "up":
        server = LocalLiveKit(folder, api_key=args.api_key, api_secret=args.api_secret)
        try:
            state = server.up()
        except BinaryError as exc:
            print(f"vivant dev livekit up: {exc}")
            return 1
        print(f"livekit up: {state.url}")
        print(f"export LIVEKIT_URL={state.url} LIVEKIT_API_KEY={state.api_key} LIVEKIT_API_SECRET={state.api_secret}")
        return 0
    if args.verb == "down":
        LocalLiveKit(folder).down()
        print("livekit down")
        return 0
    server = LocalLiveKit(folder)
    state = LiveKitState.load(folder)
    print(json.dumps({"running": server.running(), **({"url": state.url, "api_key": state.api_key} if state else {})},
                     indent=2))
    return 0 if server.running() else 1


def run(args: argparse.Namespace) -> int:
    from vivant.devcluster.cluster import ClusterSpec, LocalCluster, NodePoolSpec, Taint

    if args.what == "livekit":
        return _livekit(args)

    if args.verb == "build":
        try:
            bins = ensure_binaries()
        except BinaryError as exc:
            print(f"vivant dev cluster build: {exc}")
            return 1
        print(json.dumps({k: str(v) for k, v in vars(bins).items()}, indent=2))
        return 0
    state_dir = args.state_dir or default_state_dir()
    if args.verb == "up":
        taints = NodePoolSpec.taints if args.taint is None else tuple(
            Taint.parse(t) for t in args.taint if t != "none")
        pool = NodePoolSpec(nodes=args.nodes, gpus_per_node=args.gpus_per_node, name_prefix=args.node_prefix,
                            labels=_labels(args.label), taints=taints)
        spec = ClusterSpec(state_dir=state_dir, node_pool=pool, run_pods=not args.no_pods, redis=not args.no_redis)
        try:
            state = LocalCluster(spec).up()
        except BinaryError as exc:
            print(f"vivant dev cluster up: {exc}")
            return 1
        print(f"cluster up: {state.server} ({pool.nodes} nodes x {pool.gpus_per_node} GPUs)")
        print(f"export KUBECONFIG={state.kubeconfig}")
        if state.redis_url:
            print(f"redis: {state.redis_url} (Secret vivant-redis in {', '.join(spec.secret_namespaces)})")
        return 0
    cluster = LocalCluster(ClusterSpec(state_dir=state_dir))
    if args.verb == "down":
        cluster.down()
        print("cluster down")
        return 0
    status = cluster.status()
    print(json.dumps(status, indent=2))
    return 0 if status.get("running") else 1
