"""Which implementation a kernel call runs: the Triton kernel or its torch reference twin.

Why: the same public functions serve the GPU worker (Triton, compiled), CPU CI (Triton under
``TRITON_INTERPRET=1``, only when a test asks for it explicitly) and CPU runs of the model (torch).
``backend`` is one of:

  * ``"auto"``   — Triton when the tensors are on CUDA and Triton imports; otherwise torch, logging
                   the reason once per (kernel, reason).
  * ``"triton"`` — Triton or a clear error (Triton missing, or CPU tensors without TRITON_INTERPRET=1).
  * ``"torch"``  — the float32 reference.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "torch")

_logged: set[tuple[str, str]] = set()


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    """True when Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _log_once(kernel: str, reason: str) -> None:
    if (kernel, reason) not in _logged:
        _logged.add((kernel, reason))
        log.info("%s: using the torch reference, not Triton: %s", kernel, reason)


def use_triton(kernel: str, backend: str, device: torch.device) -> bool:
    """Decide whether ``kernel`` runs Triton for tensors on ``device`` under ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"{kernel}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    has_triton = triton_available()
    on_cuda = device.type == "cuda"
    if backend == "triton":
        if not has_triton:
            raise RuntimeError(f"{kernel}: backend='triton' but the triton package is not installed")
        if not on_cuda and not interpreter_enabled():
            raise RuntimeError(
                f"{kernel}: backend='triton' with tensors on {device.type} needs CUDA tensors or TRITON_INTERPRET=1"
            )
        if on_cuda and interpreter_enabled():
            raise RuntimeError(f"{kernel}: backend='triton' with CUDA tensors but TRITON_INTERPRET=1 is set")
        return True
    # auto
    if not on_cuda:
        _log_once(kernel, f"tensors are on {device.type}, not CUDA")
        return False
    if not has_triton:
        _log_once(kernel, "the triton package is not installed")
        return False
    if interpreter_enabled():
        _log_once(kernel, "TRITON_INTERPRET=1 is set and the tensors are on CUDA")
        return False
    return True


def pdl_launch(pdl: bool, device: torch.device) -> bool:
    """Whether a Triton launch on `device` uses programmatic dependent launch (PDL, Hopper and newer).

    With PDL the kernel is launched with CUDA's programmatic-stream-serialization attribute: its programs may be
    scheduled while the kernel before it in the stream (or CUDA graph) drains, and each program's first
    instruction, `griddepcontrol.wait`, blocks until that kernel has completed and its writes are visible. So
    the launch latency and block scheduling overlap the predecessor's tail, and every memory access still
    comes after it. A kernel compiled for PDL must wait before its first load or store (the kernels here do,
    under a `PDL` constexpr). Off on CPU, under the interpreter, and below compute capability 9.0."""
    if not pdl or device.type != "cuda" or interpreter_enabled():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9
