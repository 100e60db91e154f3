"""The real servers the local cluster and the tests run: built once from pinned Go modules, then cached.

`tools/cluster/go.mod` pins `k8s.io/kubernetes` (kube-apiserver, kube-controller-manager,
kube-scheduler) and `sigs.k8s.io/kwok`; `tools/etcd/go.mod` pins etcd 3.6 (a v1.36 apiserver needs
its watch-progress requests, which Debian's etcd 3.4 lacks); `tools/livekit/go.mod` pins
`livekit-server`; each `go.sum` pins every byte of the sources. A module's cache folder is keyed by a hash of its go.mod, go.sum, the
Go version, the target platform and the link flags, so a second run (or a second checkout on the same
machine) finds the binaries in seconds and a changed pin builds anew.

Cache root: `$VIVANT_CACHE_DIR`, else `$XDG_CACHE_HOME/vivant`, else `~/.cache/vivant`. A build
writes into a temporary folder next to the final one and renames it into place, under a file lock,
so two test runs never see a half-written binary.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class GoModule:
    """One pinned Go module under tools/ and the commands built from it (binary name -> package)."""

    folder: Path
    cache_name: str
    packages: tuple[tuple[str, str], ...]


CLUSTER_MODULE = GoModule(
    folder=REPO / "tools" / "cluster",
    cache_name="cluster-bin",
    packages=(
        ("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"),
        ("kube-controller-manager", "k8s.io/kubernetes/cmd/kube-controller-manager"),
        ("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler"),
        ("kwok", "sigs.k8s.io/kwok/cmd/kwok"),
    ),
)
ETCD_MODULE = GoModule(
    folder=REPO / "tools" / "etcd",
    cache_name="etcd-bin",
    packages=(("etcd", "./cmd/etcd"),),
)
LIVEKIT_MODULE = GoModule(
    folder=REPO / "tools" / "livekit",
    cache_name="livekit-bin",
    packages=(("livekit-server", "github.com/livekit/livekit-server/cmd/server"),),
)


class BinaryError(RuntimeError):
    """A binary is missing and cannot be built here (no Go toolchain, a failed build)."""


@dataclass(frozen=True)
class ClusterBinaries:
    """Absolute paths of the programs a local cluster runs."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kwok: Path


def cache_root() -> Path:
    if os.environ.get("VIVANT_CACHE_DIR"):
        return Path(os.environ["VIVANT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vivant"


def go_command() -> str:
    """The `go` to build with: $VIVANT_GO, else `go` on PATH, else the one `make install` put in the venv."""
    for candidate in (os.environ.get("VIVANT_GO"), shutil.which("go"), str(Path(sys.prefix) / "bin" / "go")):
        if candidate and (Path(candidate).is_file() or shutil.which(candidate)):
            return candidate
    raise BinaryError("no Go toolchain: install Go >= 1.26 or run `make install` (it fetches one when `go` is missing)")


def tool(name: str) -> str:
    """`kubectl` / `helm`: the ones `make install` put next to this Python (pinned), else PATH's."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise BinaryError(f"{name} not found: run `make install` (it installs helm and kubectl into .venv/bin)")
    return found


def _go_version(go: str) -> str:
    return subprocess.run([go, "env", "GOVERSION"], check=True, capture_output=True, text=True).stdout.strip()


def cache_key(module: GoModule, go_version: str) -> str:
    """Hash of what decides the binaries' bytes: the module pins, the toolchain, the platform, the flags."""
    h = hashlib.sha256()
    for name in ("go.mod", "go.sum"):
        h.update((module.folder / name).read_bytes())
    h.update(f"{go_version} {sys.platform} {os.uname().machine} {ldflags(module)}".encode())
    return h.hexdigest()[:16]


def _build_env() -> dict[str, str]:
    env = dict(os.environ)
    env["CGO_ENABLED"] = "0"
    # A Go 1.27 toolchain turns the jsonv2 experiment on; a kube-apiserver built so serves /openapi/v2
    # broken (kubectl apply fails). Keep the experiment off whatever the toolchain.
    env["GOEXPERIMENT"] = "nojsonv2"
    env.setdefault("GOFLAGS", "-mod=mod")
    return env


def kubernetes_version() -> str:
    """The k8s.io/kubernetes release go.mod pins, e.g. v1.36.3."""
    m = re.search(r"^\s*k8s\.io/kubernetes\s+(v\d+\.\d+\.\d+)\s*$", (CLUSTER_MODULE.folder / "go.mod").read_text(), re.M)
    if m is None:
        raise BinaryError(f"{CLUSTER_MODULE.folder / 'go.mod'}: expected a line `k8s.io/kubernetes vX.Y.Z`")
    return m.group(1)


def ldflags(module: GoModule) -> str:
    """Strip symbols; for Kubernetes, stamp the release into the binaries: without it the apiserver
    reports v0.0.0-master and Helm refuses charts that require a kubeVersion."""
    if module is not CLUSTER_MODULE:
        return "-s -w"
    version = kubernetes_version()
    major, minor = version[1:].split(".")[:2]
    base = "k8s.io/component-base/version"
    return (f"-s -w -X {base}.gitVersion={version} -X {base}.gitMajor={major} -X {base}.gitMinor={minor} "
            f"-X {base}.gitTreeState=clean -X {base}.buildDate=1970-01-01T00:00:00Z")


def build(module: GoModule, dest: Path, *, go: str, log=print) -> None:
    """`go build` every package of the module into `dest`, printing progress (one line per 20 packages)."""
    dest.mkdir(parents=True, exist_ok=True)
    names = [name for name, _ in module.packages]
    cmd = [go, "build", "-v", "-trimpath", f"-ldflags={ldflags(module)}", "-o", str(dest) + "/",
           *(pkg for _, pkg in module.packages)]
    log(f"building {', '.join(names)} from tools/{module.folder.name}/go.mod (the first time takes minutes)")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=module.folder, env=_build_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    tail: list[str] = []
    compiled = 0
    for line in proc.stdout:
        compiled += 1
        tail = (tail + [line.rstrip()])[-30:]
        if compiled % 20 == 0:
            log(f"  ... {compiled} packages compiled ({time.monotonic() - start:.0f} s): {line.strip()}")
    if proc.wait() != 0:
        raise BinaryError("go build failed:\n" + "\n".join(tail))
    for name, pkg in module.packages:  # `go build -o dir/` names each binary after its package's folder
        built = dest / pkg.rsplit("/", 1)[-1]
        if built.name != name:
            built.rename(dest / name)
    log(f"built in {time.monotonic() - start:.0f} s")


def ensure_module(module: GoModule, *, build_missing: bool = True, log=print) -> Path:
    """The folder holding the module's binaries for its current pins, building them first if needed."""
    go = go_command()
    folder = cache_root() / module.cache_name / cache_key(module, _go_version(go))
    names = [name for name, _ in module.packages]
    if not all((folder / n).exists() for n in names):
        if not build_missing:
            raise BinaryError(f"{', '.join(names)} not built yet (expected in {folder})")
        folder.parent.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not all((folder / n).exists() for n in names):  # another process may have built it meanwhile
                tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                build(module, tmp, go=go, log=log)
                shutil.rmtree(folder, ignore_errors=True)
                tmp.rename(folder)
    return folder


def ensure_binaries(*, build_missing: bool = True, log=print) -> ClusterBinaries:
    """The cluster's binaries (see ensure_module), etcd included."""
    folder = ensure_module(CLUSTER_MODULE, build_missing=build_missing, log=log)
    etcd = ensure_module(ETCD_MODULE, build_missing=build_missing, log=log) / "etcd"
    return ClusterBinaries(
        etcd=etcd,
        kube_apiserver=folder / "kube-apiserver",
        kube_controller_manager=folder / "kube-controller-manager",
        kube_scheduler=folder / "kube-scheduler",
        kwok=folder / "kwok",
    )


def ensure_livekit_server(*, build_missing: bool = True, log=print) -> Path:
    """The livekit-server binary for tools/livekit's pins; `$VIVANT_LIVEKIT_SERVER` names one built elsewhere (a
    machine without Go, e.g. the GPU machine, is handed the binary built here: bench/run_gpu.sh)."""
    given = os.environ.get("VIVANT_LIVEKIT_SERVER")
    if given:
        if not Path(given).is_file() or not os.access(given, os.X_OK):
            raise BinaryError(f"VIVANT_LIVEKIT_SERVER = {given!r}: expected an executable livekit-server binary")
        return Path(given)
    return ensure_module(LIVEKIT_MODULE, build_missing=build_missing, log=log) / "livekit-server"
