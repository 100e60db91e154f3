"""`kubectl get <short name>` reaches our resources (issue 14, defect 8).

Before, CharacterSession's short name was `cs`, which kubectl resolves to the built-in ComponentStatus:
the README's `kubectl get cs` listed control-plane components, not sessions.
"""

from __future__ import annotations

import re

from conftest import REPO, Kube, wait_for
from kube_objects import SESSIONS, session_manifest
from vivant.apis import resources


def api_resources(kube: Kube) -> list[tuple[str, set[str], str]]:
    """(plural name, short names, API group) of every resource the cluster serves."""
    out = []
    for line in kube.kubectl("api-resources", "--no-headers", "-o", "wide").stdout.splitlines():
        cols = line.split()
        name, rest = cols[0], cols[1:]
        shorts = set(rest[0].split(",")) if rest and "/" not in rest[0] and rest[0] not in ("true", "false") else set()
        group = next((c for c in rest if "/" in c), "v1")
        out.append((name, shorts, group.rsplit("/", 1)[0] if "/" in group else ""))
    return out


def test_our_short_names_are_ours_alone(kube: Kube, vivant_release: str):
    ours = {resources.SESSION_PLURAL: set(resources.SESSION_SHORT_NAMES), resources.POOL_PLURAL: set(resources.POOL_SHORT_NAMES)}
    served = api_resources(kube)
    assert {n for n, _, g in served if g == resources.GROUP} == set(ours), served
    for plural, shorts in ours.items():
        for short in shorts:
            clash = [(n, g) for n, s, g in served if (short in s or short == n) and not (g == resources.GROUP and n == plural)]
            assert not clash, f"short name {short!r} of {plural} is also {clash}: kubectl resolves it elsewhere"


def test_kubectl_get_by_short_name_lists_sessions(kube: Kube, vivant_release: str, namespace: str):
    kube.apply(session_manifest(namespace, "named", "no-such-pool"))
    for short in resources.SESSION_SHORT_NAMES:
        table = wait_for(lambda short=short: (t := kube.kubectl("get", short, "-n", namespace).stdout) and "named" in t and t,
                         f"`kubectl get {short}` listing the session", 15)
        assert table.split()[:4] == ["NAME", "PHASE", "WORKER", "FPS"], table
    kube.kubectl("delete", SESSIONS, "named", "-n", namespace, "--wait=false")


def test_the_docs_use_names_that_reach_our_resources(kube: Kube, vivant_release: str):
    """Every `kubectl get <x>` in the README, docs, examples and the chart's notes names a resource the cluster
    serves, and none names one that is not what it seems: ComponentStatus (`cs`) in place of sessions."""
    served = api_resources(kube)
    known = {n for n, _, _ in served} | {n[:-1] for n, _, _ in served if n.endswith("s")}  # plural, singular
    known |= {s for _, shorts, _ in served for s in shorts}
    componentstatus = {n for n, shorts, g in served if n == "componentstatuses" for n in (n, *shorts)}
    files = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "examples").rglob("*.yaml"),
             REPO / "charts" / "vivant" / "templates" / "NOTES.txt"]
    used = {(f.relative_to(REPO).as_posix(), word) for f in files
            for m in re.findall(r"kubectl get ([a-z.,]+)", f.read_text()) for word in m.split(",")}
    assert any(word in resources.SESSION_SHORT_NAMES or word == resources.SESSION_PLURAL for _, word in used), used
    wrong = sorted((f, w) for f, w in used if w.split(".")[0] not in known or w in componentstatus)
    assert not wrong, f"`kubectl get` of something that is not served, or is ComponentStatus: {wrong}"
