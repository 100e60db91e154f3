"""A frame sink for tests: keeps every published frame (the tests compare pixels and audio) and whether the
playout closed it."""

from __future__ import annotations


class CollectingSink:
    def __init__(self) -> None:
        self.frames = []
        self.closed = False

    def write(self, frame) -> None:
        self.frames.append(frame)

    def close(self) -> None:
        self.closed = True
