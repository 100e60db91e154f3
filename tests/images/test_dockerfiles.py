"""The deployable images (images/*.Dockerfile) checked without a container engine (none runs in CI).

Each Dockerfile is parsed with `dockerfile-parse` and must be: multi-stage, with the final stage built from
an earlier one and run as a numeric non-root USER; every base image pinned by an exact tag (never
`latest`, never untagged); every `pip install` (pip or `uv pip`) taking only `-r requirements/*.txt` files
that exist, or the project itself (`.`), always with `--no-deps`, followed by `pip check`; every COPY
source present in the build context. The requirement files pin every line with `==`, the images' files
agree with `requirements/dev.txt` (what `make install` installs for the tests, checked through `make -n`),
the test environment holds exactly those versions, and `tools/pin_requirements.py --check` finds them to
be the closure of pyproject.toml. Finally every image the chart renders by default (`helm template`), the
chart's worker pool and every example WorkerPool name the images the Makefile builds (`make image-names`).

The checks are functions returning problems, run on the real files (no problem allowed) and on broken
samples (each problem must be named), so none of them can pass vacuously.
"""

from __future__ import annotations

import io
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
IMAGES = {"control-plane": ROOT / "images" / "control-plane.Dockerfile", "worker": ROOT / "images" / "worker.Dockerfile"}
REQUIREMENTS = ROOT / "requirements"
HELM = Path(sys.executable).parent / "helm"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)$")
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", "\n"}
PIP_VALUE_OPTIONS = {"-r", "--requirement", "--python", "--only-binary", "-e", "--editable"}
PIP_FLAGS = {"--no-deps", "--no-build-isolation", "-q", "--quiet", "--no-cache-dir"}


# ------------------------------------------------------------------------------------------- checks


def _stages(df: DockerfileParser) -> list[dict]:
    """[{'image': substituted base, 'alias': name or None, 'instructions': [...]}] in order."""
    stages: list[dict] = []
    parents = iter(df.parent_images)  # ARG values substituted by dockerfile-parse
    for ins in df.structure:
        if ins["instruction"] == "FROM":
            words = ins["value"].split()
            alias = words[-1] if len(words) >= 3 and words[-2].upper() == "AS" else None
            stages.append({"image": next(parents), "alias": alias, "instructions": []})
        elif stages:
            stages[-1]["instructions"].append(ins)
    return stages


def base_image_problems(df: DockerfileParser) -> list[str]:
    problems, aliases = [], set()
    for stage in _stages(df):
        image = stage["image"]
        if image in aliases:  # FROM an earlier stage
            pass
        elif "@sha256:" in image:
            pass
        else:
            last = image.rsplit("/", 1)[-1]
            tag = last.split(":", 1)[1] if ":" in last else None
            if tag is None:
                problems.append(f"FROM {image}: untagged base image (pin an exact version tag)")
            elif tag == "latest" or not re.search(r"\d", tag):
                problems.append(f"FROM {image}: tag {tag!r} is not an exact version")
        if stage["alias"]:
            aliases.add(stage["alias"])
    return problems


def stage_problems(df: DockerfileParser) -> list[str]:
    stages = _stages(df)
    if len(stages) < 2:
        return [f"single-stage ({len(stages)} FROM): expected a build stage and a runtime stage"]
    problems = []
    final = stages[-1]["instructions"]
    earlier = {s["alias"] for s in stages[:-1] if s["alias"]}
    copied_from = {m.group(1) for i in final if i["instruction"] == "COPY"
                   for m in [re.search(r"--from=(\S+)", i["value"])] if m}
    if not copied_from & earlier:
        problems.append(f"the final stage copies nothing from an earlier stage ({sorted(earlier)})")
    users = [i["value"].strip() for i in final if i["instruction"] == "USER"]
    if not users:
        problems.append("the final stage sets no USER (it would run as root)")
    else:
        parts = users[-1].split(":")
        if not all(p.isdigit() for p in parts):
            problems.append(f"USER {users[-1]}: expected a numeric uid[:gid] (runAsNonRoot needs a number)")
        elif int(parts[0]) == 0 or (len(parts) > 1 and int(parts[1]) == 0):
            problems.append(f"USER {users[-1]}: root")
    return problems


def commands(shell: str) -> list[list[str]]:
    """A shell line split into simple commands (on &&, ||, ;, |)."""
    lexer = shlex.shlex(shell, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out, current = [], []
    for token in lexer:
        if token in SHELL_OPERATORS:
            if current:
                out.append(current)
            current = []
        elif token != "!":
            current.append(token)
    if current:
        out.append(current)
    return out


def pip_install_args(command: list[str]) -> list[str] | None:
    """The arguments after `pip install` (pip, python -m pip, uv pip), or None for another command."""
    for i, token in enumerate(command[:-1]):
        if (token == "pip" or token.endswith("/pip")) and command[i + 1] == "install":
            return command[i + 2:]
    return None


def pip_problems(args: list[str], where: str) -> list[str]:
    problems, files, targets = [], [], []
    it = iter(args)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name in PIP_VALUE_OPTIONS:
            value = value if eq else next(it, "")
            if name in ("-r", "--requirement"):
                files.append(value)
            elif name in ("-e", "--editable"):
                targets.append(value)
        elif arg.startswith("-r") and len(arg) > 2:
            files.append(arg[2:])
        elif arg in PIP_FLAGS:
            pass
        elif arg.startswith("-"):
            problems.append(f"{where}: pip option {arg!r} is not allowed here")
        else:
            targets.append(arg)
    for f in files:
        if not f.startswith("requirements/") or not (ROOT / f).is_file():
            problems.append(f"{where}: -r {f}: not a file under requirements/")
    for t in targets:
        if t != ".":
            problems.append(f"{where}: installs {t!r} directly (only -r requirements/*.txt or the project '.')")
    if not files and not targets:
        problems.append(f"{where}: pip install with nothing to install")
    if "--no-deps" not in args:
        problems.append(f"{where}: pip install without --no-deps (an unpinned dependency could slip in)")
    return problems


def install_problems(df: DockerfileParser) -> tuple[list[str], list[str]]:
    """(problems, requirement files installed) over every RUN of every stage."""
    problems, files, checked = [], [], False
    for ins in df.structure:
        if ins["instruction"] != "RUN":
            continue
        for cmd in commands(ins["value"]):
            args = pip_install_args(cmd)
            if args is not None:
                where = f"line {ins['startline'] + 1}"
                problems += pip_problems(args, where)
                files += [a for a in args if a.startswith("requirements/")]
            elif len(cmd) >= 2 and cmd[-2:] == ["pip", "check"]:
                checked = True
    if not files:
        problems.append("no pip install from requirements/*.txt")
    if not checked:
        problems.append("no `pip check` after the installs")
    return problems, files


def copy_problems(df: DockerfileParser) -> list[str]:
    problems = []
    for ins in df.structure:
        if ins["instruction"] == "COPY" and "--from=" not in ins["value"]:
            for src in ins["value"].split()[:-1]:
                if not src.startswith("--") and not (ROOT / src).exists():
                    problems.append(f"COPY {src}: not in the build context (the repository root)")
    return problems


def dockerfile_problems(text: str) -> list[str]:
    df = DockerfileParser(fileobj=io.BytesIO(text.encode()))
    installs, _ = install_problems(df)
    return base_image_problems(df) + stage_problems(df) + installs + copy_problems(df)


def pins(path: Path) -> dict[str, tuple[str, str]]:
    """canonical name -> (name, version) of a requirement file; raises naming a line that is not `name==version`."""
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = PIN.match(line)
        if not m:
            raise ValueError(f"{path.relative_to(ROOT)}:{n}: {line!r} is not an exact `name==version` pin")
        out[canonicalize_name(m.group(1))] = (m.group(1), m.group(2))
    return out


def image_names() -> dict[str, str]:
    done = subprocess.run(["make", "-s", "--no-print-directory", "image-names"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return dict(line.split(" ", 1) for line in done.stdout.splitlines())


# ------------------------------------------------------------------------------------ the real files


@pytest.mark.parametrize("image", IMAGES)
def test_dockerfile_has_no_problem(image: str) -> None:
    assert dockerfile_problems(IMAGES[image].read_text()) == []


@pytest.mark.parametrize("image", IMAGES)
def test_each_image_installs_its_own_pinned_file(image: str) -> None:
    _, files = install_problems(DockerfileParser(path=str(IMAGES[image])))
    assert sorted(set(files)) == sorted({"requirements/build.txt", f"requirements/{image}.txt"}), files


def test_control_plane_carries_no_torch() -> None:
    names = set(pins(REQUIREMENTS / "control-plane.txt"))
    heavy = sorted(n for n in names if n in {"torch", "triton", "av", "livekit-agents"} or n.startswith("nvidia-"))
    assert not heavy, f"the control-plane image would install {heavy}"
    assert {"torch", "triton"} <= set(pins(REQUIREMENTS / "worker.txt"))


def test_every_requirement_line_is_an_exact_pin() -> None:
    files = sorted(REQUIREMENTS.glob("*.txt"))
    assert {p.name for p in files} >= {"build.txt", "control-plane.txt", "worker.txt", "dev.txt"}
    for path in files:
        assert pins(path), f"{path} pins nothing"


def test_images_pin_the_versions_the_tests_run() -> None:
    dev = pins(REQUIREMENTS / "dev.txt")
    for name in ("build.txt", "control-plane.txt", "worker.txt"):
        for key, (dist, version) in pins(REQUIREMENTS / name).items():
            if name == "build.txt" and key == "pip":
                continue  # pip itself is not a dependency of anything
            assert key in dev, f"{name}: {dist} is not in requirements/dev.txt (the tests would not run it)"
            assert dev[key][1] == version, f"{name}: {dist}=={version} but requirements/dev.txt has {dev[key][1]}"
    for dist, version in [*dev.values(), *pins(REQUIREMENTS / "build.txt").values()]:
        installed = metadata.version(dist)
        assert installed == version, f"{dist}: the test environment has {installed}, the pins say {version}"


def test_makefile_installs_through_the_same_files() -> None:
    done = subprocess.run(["make", "-n", "-B", "--no-print-directory", ".venv/.installed"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    problems, files, checked = [], [], False
    for line in done.stdout.splitlines():
        for cmd in commands(line):
            args = pip_install_args(cmd)
            if args is not None:
                problems += pip_problems(args, f"Makefile: {line.strip()}")
                files += [a for a in args if a.startswith("requirements/")]
            checked |= cmd[-2:] == ["pip", "check"]
    assert problems == []
    assert files == ["requirements/build.txt", "requirements/dev.txt", "requirements/tools.txt"], files
    assert checked, "make install runs no `pip check`"


def test_pins_are_the_closure_of_pyproject() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "pin_requirements.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_torch_triton_numpy_pins() -> None:
    """torch 2.13.0 (docs/deploy.md), the Triton its wheel requires, numpy below 2.4 (Triton's interpreter)."""
    dev = pins(REQUIREMENTS / "dev.txt")
    assert dev["torch"][1] == "2.13.0"
    from packaging.requirements import Requirement
    from packaging.version import Version

    wanted = [Requirement(r) for r in metadata.requires("torch") or [] if r.startswith("triton")]
    assert wanted and all(r.specifier.contains(dev["triton"][1]) for r in wanted), (dev["triton"], wanted)
    assert Version(dev["numpy"][1]) < Version("2.4")


@pytest.mark.skipif(not HELM.exists(), reason=f"{HELM} missing: run `make install`")
def test_the_chart_and_the_example_name_these_images() -> None:
    names = image_names()
    assert set(names) == set(IMAGES), names

    def rendered(*sets: str) -> list[dict]:
        args = [str(HELM), "template", "rel", str(ROOT / "charts" / "vivant"), "--namespace", "vivant-system"]
        for s in sets:
            args += ["--set", s]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return [d for d in yaml.safe_load_all(done.stdout) if d]

    def container_images(objs: list[dict]) -> set[str]:
        found = set()
        for o in objs:
            pod = (o.get("spec") or {}).get("template", {}).get("spec") or {}
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                found.add(c["image"])
        return found

    default = rendered()
    assert container_images(default) == {names["control-plane"]}, container_images(default)
    with_pool = rendered("workerPool.enabled=true")
    [pool] = [o for o in with_pool if o["kind"] == "WorkerPool"]
    assert pool["spec"]["image"] == names["worker"], pool["spec"]["image"]
    assert container_images(with_pool) == {names["control-plane"]}
    pools = {p.relative_to(ROOT): d for p in sorted((ROOT / "examples").rglob("*.yaml"))
             for d in yaml.safe_load_all(p.read_text()) if d and d.get("kind") == "WorkerPool"}
    assert len(pools) >= 2, f"expected the local and the production example pools, found {list(pools)}"
    for path, pool in pools.items():
        assert pool["spec"]["image"] == names["worker"], f"{path}: {pool['spec']['image']}"


# ---------------------------------------------------------------------------- the checks can fail

GOOD = """\
FROM python:3.11.14-slim-bookworm AS build
COPY requirements/build.txt requirements/
RUN python -m pip install --no-deps -r requirements/build.txt && python -m pip install --no-deps . \\
 && python -m pip check
FROM python:3.11.14-slim-bookworm
COPY --from=build /opt/vivant /opt/vivant
USER 10001:10001
"""


def test_the_good_sample_passes() -> None:
    assert dockerfile_problems(GOOD) == []


@pytest.mark.parametrize(("old", "new", "problem"), [
    ("FROM python:3.11.14-slim-bookworm AS build", "FROM python:latest AS build", "tag 'latest' is not an exact"),
    ("FROM python:3.11.14-slim-bookworm\n", "FROM python\n", "FROM python: untagged"),
    ("FROM python:3.11.14-slim-bookworm\n", "FROM python:slim\n", "tag 'slim' is not an exact"),
    ("USER 10001:10001", "USER vivant", "USER vivant: expected a numeric"),
    ("USER 10001:10001", "USER 0", "USER 0: root"),
    ("USER 10001:10001", "", "sets no USER"),
    ("COPY --from=build /opt/vivant /opt/vivant", "COPY requirements requirements", "copies nothing from an earlier"),
    ("-r requirements/build.txt", "-r requirements/missing.txt", "-r requirements/missing.txt: not a file"),
    ("-r requirements/build.txt", "-r /tmp/reqs.txt", "-r /tmp/reqs.txt: not a file under requirements/"),
    ("--no-deps -r requirements/build.txt", "-r requirements/build.txt", "without --no-deps"),
    ("pip install --no-deps .", "pip install --no-deps torch==2.13.0", "installs 'torch==2.13.0' directly"),
    ("pip install --no-deps .", "pip install --no-deps --index-url http://x .", "option '--index-url'"),
    (" \\\n && python -m pip check", "", "no `pip check`"),
    ("COPY requirements/build.txt", "COPY requirements/nothing.txt", "COPY requirements/nothing.txt: not in"),
])
def test_a_broken_dockerfile_is_named(old: str, new: str, problem: str) -> None:
    assert old in GOOD, old
    problems = dockerfile_problems(GOOD.replace(old, new, 1))
    assert any(problem in p for p in problems), problems


def test_a_single_stage_dockerfile_is_named() -> None:
    single = "FROM python:3.11.14-slim-bookworm\nRUN pip install --no-deps -r requirements/dev.txt && pip check\nUSER 1\n"
    assert any("single-stage" in p for p in dockerfile_problems(single))


def test_a_loose_pin_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    path = tmp_path / "reqs.txt"
    path.write_text("# ok\nredis==8.1.0\nnumpy>=1.26\n")
    with pytest.raises(ValueError, match=r"reqs.txt:3: 'numpy>=1.26' is not an exact"):
        pins(path)
