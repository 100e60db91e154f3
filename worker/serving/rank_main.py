"""A spawned rank's entry point (`child_main`), for ranks 1 … N of `vivant worker --tensor-parallel N`.

It dies with its parent (PR_SET_PDEATHSIG, so a killed worker leaves no rank behind), sets the no-multicast
environment, joins the world, builds its part (a DiT shard, vivant.worker.serving.ranks.DitFollower, or the decoder
rank, vivant.worker.serving.decoder_rank), reports `ready` on the status queue and serves until SHUTDOWN (SIGINT and
SIGTERM are rank 0's to handle: a group signal must not kill a rank mid-session). An exception is reported on the
status queue (rank 0's supervisor turns it into the session's end reason) and ends the process with a non-zero status.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

import torch.distributed as dist
from vivant.worker.serving.decoder_rank import DecoderRank
from vivant.worker.serving.layout import RankRole
from vivant.worker.serving.ranks import DitFollower, RankSpec, join, set_device

log = logging.getLogger(__name__)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (rank 0, the worker) dies, so a killed worker leaves no
    rank behind; elsewhere nothing (the ranks then end at their next collective's timeout)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG = 1
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def child_main(rank: int, spec: RankSpec, status) -> None:  # noqa: ANN001 (a multiprocessing queue)
    """A spawned rank (module docstring). It ignores SIGINT and SIGTERM: a terminal's Ctrl-C or a process-group
    SIGTERM reaches every rank, and stopping is rank 0's decision (SHUTDOWN after the session in progress)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    layout = spec.layout
    try:
        set_device(spec, rank)
        groups = join(spec, rank)
        if layout.role(rank) is RankRole.DIT:
            worker = DitFollower(spec, rank, groups)
        else:
            worker = DecoderRank(spec, rank, groups, status)
        status.put(("ready", rank, os.getpid()))
        worker.serve()
    except BaseException as exc:
        status.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        log.exception("%s failed", layout.describe(rank))
        raise
    dist.destroy_process_group()
