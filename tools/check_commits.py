"""Commit-subject check (docs/CONTRIBUTING.md, "Commits"): every commit after a base ref has a one-line subject of
at most 72 characters, with any body after a blank line.

Usage: `python tools/check_commits.py BASE [HEAD]` checks the commits in BASE..HEAD (HEAD defaults to HEAD), so a
branch is checked against where it forked (`make check-commits BASE=main`) and history before BASE is left alone.
For each commit it checks:
  * the subject (the message's first line) is not empty and at most `MAX_SUBJECT` (72) characters;
  * when the message has a body, a blank line separates it from the subject (otherwise git joins them into one
    subject in `git log --oneline` and every tool that reads subjects).
Merge commits are skipped (their subjects are git's). Exits 1 naming each offending commit (short hash, the
problem, the subject's start), 0 when every commit passes, 2 when git cannot list the range (a ref that does not
exist).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

MAX_SUBJECT = 72
SEPARATOR = "\x1e"  # between commits in `git log` output (ASCII record separator: never in a message)


def messages(base: str, head: str = "HEAD", cwd: Path | None = None) -> list[tuple[str, str]]:
    """(full hash, raw message) of each non-merge commit in base..head, oldest first. CalledProcessError when git
    cannot list the range."""
    out = subprocess.run(["git", "log", "--no-merges", "--reverse", f"--format=%H%n%B{SEPARATOR}", f"{base}..{head}"],
                         cwd=cwd, capture_output=True, text=True, check=True).stdout
    found = []
    for record in out.split(SEPARATOR):
        record = record.lstrip("\n")
        if not record:
            continue
        commit, _, message = record.partition("\n")
        found.append((commit, message))
    return found


def problems(message: str) -> list[str]:
    """What is wrong with one commit message (empty: nothing)."""
    lines = message.rstrip("\n").split("\n")
    subject = lines[0]
    found = []
    if not subject.strip():
        found.append("empty subject")
    elif len(subject) > MAX_SUBJECT:
        found.append(f"subject is {len(subject)} characters; expected at most {MAX_SUBJECT} (the why goes in the body)")
    if len(lines) > 1 and lines[1].strip():
        found.append("no blank line between the subject and the body")
    return found


def check(base: str, head: str = "HEAD", cwd: Path | None = None) -> list[str]:
    """One line per problem of each commit in base..head: `<short hash>: <problem>: <subject's first 60 chars>`."""
    report = []
    for commit, message in messages(base, head, cwd):
        subject = message.split("\n", 1)[0]
        shown = subject if len(subject) <= 60 else subject[:57] + "..."
        report.extend(f"{commit[:10]}: {problem}: {shown!r}" for problem in problems(message))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the ref the checked commits follow (e.g. main, or the commit a branch forked at)")
    parser.add_argument("head", nargs="?", default="HEAD", help="the last commit checked (default HEAD)")
    args = parser.parse_args(argv)
    try:
        report = check(args.base, args.head)
    except subprocess.CalledProcessError as exc:
        print(f"git cannot list {args.base}..{args.head}: {exc.stderr.strip()}", file=sys.stderr)
        return 2
    for line in report:
        print(line)
    if not report:
        print(f"commit subjects {args.base}..{args.head}: ok")
    return 1 if report else 0


if __name__ == "__main__":
    sys.exit(main())
