"""The control-plane binaries of the local cluster: built once from the pinned Go module, then cached.

`tools/cluster/go.mod` pins `k8s.io/kubernetes` (kube-apiserver, kube-controller-manager,
kube-scheduler) and `sigs.k8s.io/kwok`; `go.sum` pins every byte of their sources. The cache folder is
keyed by a hash of go.mod, go.sum, the Go version and the target platform, so a second run (or a
second checkout on the same machine) finds the binaries in seconds and a changed pin builds anew.
etcd comes from the Debian package `etcd-server` (`make sysdeps`), found on PATH.

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
GO_MODULE = REPO / "tools" / "cluster"
# binary name -> Go package path inside the tools module's dependencies
PACKAGES: dict[str, str] = {
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kwok": "sigs.k8s.io/kwok/cmd/kwok",
}


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


def cache_key(go_version: str) -> str:
    """Hash of what decides the binaries' bytes: the module pins, the toolchain and the platform."""
    h = hashlib.sha256()
    for name in ("go.mod", "go.sum"):
        h.update((GO_MODULE / name).read_bytes())
    h.update(f"{go_version} {sys.platform} {os.uname().machine} {ldflags()}".encode())
    return h.hexdigest()[:16]


def _etcd() -> Path:
    found = shutil.which("etcd")
    if found is None:
        raise BinaryError("etcd not found: install the Debian package `etcd-server` (`make sysdeps` does, as root)")
    return Path(found)


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
    m = re.search(r"^\s*k8s\.io/kubernetes\s+(v\d+\.\d+\.\d+)\s*$", (GO_MODULE / "go.mod").read_text(), re.M)
    if m is None:
        raise BinaryError(f"{GO_MODULE / 'go.mod'}: expected a line `k8s.io/kubernetes vX.Y.Z`")
    return m.group(1)


def ldflags() -> str:
    """Strip symbols, and stamp the release into the binaries: without it the apiserver reports
    v0.0.0-master and Helm refuses charts that require a kubeVersion."""
    version = kubernetes_version()
    major, minor = version[1:].split(".")[:2]
    base = "k8s.io/component-base/version"
    return (f"-s -w -X {base}.gitVersion={version} -X {base}.gitMajor={major} -X {base}.gitMinor={minor} "
            f"-X {base}.gitTreeState=clean -X {base}.buildDate=1970-01-01T00:00:00Z")


def build(dest: Path, *, go: str, log=print) -> None:
    """`go build` every package of PACKAGES into `dest`, printing progress (one line per ~20 packages)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [go, "build", "-v", "-trimpath", f"-ldflags={ldflags()}", "-o", str(dest) + "/", *PACKAGES.values()]
    log(f"building {', '.join(PACKAGES)} from {GO_MODULE.name}/go.mod (first time: ~10 min on 2 cores)")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=GO_MODULE, env=_build_env(), stdout=subprocess.PIPE,
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
    log(f"built in {time.monotonic() - start:.0f} s")


def ensure_binaries(*, build_missing: bool = True, log=print) -> ClusterBinaries:
    """Find the cached binaries for the current pins, building them first if needed."""
    go = go_command()
    folder = cache_root() / "cluster-bin" / cache_key(_go_version(go))
    names = list(PACKAGES)
    if not all((folder / n).exists() for n in names):
        if not build_missing:
            raise BinaryError(f"cluster binaries not built yet (expected in {folder}); run `vivant dev cluster build`")
        folder.parent.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not all((folder / n).exists() for n in names):  # another process may have built it meanwhile
                tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                build(tmp, go=go, log=log)
                shutil.rmtree(folder, ignore_errors=True)
                tmp.rename(folder)
    return ClusterBinaries(
        etcd=_etcd(),
        kube_apiserver=folder / "kube-apiserver",
        kube_controller_manager=folder / "kube-controller-manager",
        kube_scheduler=folder / "kube-scheduler",
        kwok=folder / "kwok",
    )
