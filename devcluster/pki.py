"""TLS and service-account keys of a local cluster, made on the fly with `openssl` (Debian's).

One throwaway CA signs the apiserver's serving certificate (for 127.0.0.1 and the in-cluster names)
and the client certificates of the admin (group `system:masters`), the controller-manager and the
scheduler (their well-known user names, which the apiserver's default RBAC roles are bound to). A
separate RSA key signs service-account tokens. Everything lives under the cluster's state folder
and dies with it; nothing here is meant for a real cluster.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

DAYS = "30"
SERVING_NAMES = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                 "kubernetes.default.svc.cluster.local")
SERVING_IPS = ("127.0.0.1", "10.96.0.1")


@dataclass(frozen=True)
class ClientCert:
    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterPki:
    ca_cert: Path
    ca_key: Path
    serving: ClientCert
    admin: ClientCert
    controller_manager: ClientCert
    scheduler: ClientCert
    sa_key: Path
    sa_pub: Path


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {proc.stderr.strip()}")


def _signed(folder: Path, name: str, subject: str, ext: str | None = None) -> ClientCert:
    key, csr, crt = folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.crt"
    _openssl("genrsa", "-out", key.name, "2048", cwd=folder)
    _openssl("req", "-new", "-key", key.name, "-subj", subject, "-out", csr.name, cwd=folder)
    args = ["x509", "-req", "-in", csr.name, "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", crt.name, "-days", DAYS, "-sha256"]
    if ext:
        (folder / f"{name}.ext").write_text(ext)
        args += ["-extfile", f"{name}.ext"]
    _openssl(*args, cwd=folder)
    key.chmod(0o600)
    return ClientCert(cert=crt, key=key)


def make_pki(folder: Path) -> ClusterPki:
    """Create (or reuse, if complete) the CA, certificates and keys under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "ca.crt").exists():
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
                 "-days", DAYS, "-subj", "/CN=vivant-dev-cluster-ca", cwd=folder)
        alt = ",".join([f"DNS:{n}" for n in SERVING_NAMES] + [f"IP:{ip}" for ip in SERVING_IPS])
        serving_ext = f"subjectAltName={alt}\nextendedKeyUsage=serverAuth\n"
        client_ext = "extendedKeyUsage=clientAuth\n"
        _signed(folder, "apiserver", "/CN=kube-apiserver", serving_ext)
        _signed(folder, "admin", "/O=system:masters/CN=vivant-dev-admin", client_ext)
        _signed(folder, "controller-manager", "/CN=system:kube-controller-manager", client_ext)
        _signed(folder, "scheduler", "/CN=system:kube-scheduler", client_ext)
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=folder)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=folder)
    return ClusterPki(
        ca_cert=folder / "ca.crt", ca_key=folder / "ca.key",
        serving=ClientCert(folder / "apiserver.crt", folder / "apiserver.key"),
        admin=ClientCert(folder / "admin.crt", folder / "admin.key"),
        controller_manager=ClientCert(folder / "controller-manager.crt", folder / "controller-manager.key"),
        scheduler=ClientCert(folder / "scheduler.crt", folder / "scheduler.key"),
        sa_key=folder / "sa.key", sa_pub=folder / "sa.pub",
    )


def kubeconfig(server: str, ca: Path, *, user: str, cert: ClientCert | None = None, token: str | None = None) -> dict:
    """A kubeconfig (as a dict, for yaml.safe_dump) with one cluster, one user and one current context."""
    creds: dict[str, str] = {}
    if cert is not None:
        creds = {"client-certificate": str(cert.cert), "client-key": str(cert.key)}
    if token is not None:
        creds = {"token": token}
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "vivant-dev", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "vivant-dev", "context": {"cluster": "vivant-dev", "user": user}}],
        "current-context": "vivant-dev",
    }
