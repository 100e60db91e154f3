"""Checkpoints: safetensors in, safetensors out, with checks that name the tensor.

A checkpoint is refused before anything is copied, so a bad file never leaves a half-loaded model
behind (and a worker never goes warm on it) when its names or shapes do not match the model (the
preset), when a tensor holds NaN or Inf, or when its data no longer has the SHA-256 recorded when it
was written (`vivant.sha256` in the safetensors metadata: by `save_weights` and by the training CLI).
Nothing is fetched from a hub.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

CHECKSUM_KEY = "vivant.sha256"


class CheckpointError(ValueError):
    pass


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order: the checksum a checkpoint
    records when it is written and is checked against when it is loaded."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_weights(model: torch.nn.Module, path: str | Path) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata={CHECKSUM_KEY: tensors_digest(tensors)})


def _check_data(loaded: dict[str, torch.Tensor], recorded: str | None) -> list[str]:
    """Problems of the tensor data itself: non-finite values, and the recorded checksum."""
    problems = []
    for key in sorted(loaded):
        t = loaded[key]
        if t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                problems.append(f"tensor {key!r}: {bad} of {t.numel()} values are NaN or Inf")
    if recorded is None:
        problems.append(f"no checksum recorded ({CHECKSUM_KEY} metadata): save it with save_weights or the training "
                        "CLI, which record one")
    elif (actual := tensors_digest(loaded)) != recorded:
        problems.append(f"tensor data does not match the checksum recorded when it was written ({recorded[:16]}... "
                        f"!= {actual[:16]}...): the file is corrupt or was altered")
    return problems


def load_weights(model: torch.nn.Module, path: str | Path, *, strict: bool = True) -> None:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        loaded = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"checkpoint {str(path)!r} is not a readable safetensors file: {exc}") from None
    with safe_open(str(path), "pt") as f:
        recorded = (f.metadata() or {}).get(CHECKSUM_KEY)
    expected = model.state_dict()
    problems = []
    for name, tensor in expected.items():
        if name not in loaded:
            if strict:
                problems.append(f"missing tensor {name!r} (model shape {tuple(tensor.shape)})")
        elif tuple(loaded[name].shape) != tuple(tensor.shape):
            problems.append(f"tensor {name!r}: checkpoint shape {tuple(loaded[name].shape)} != "
                            f"model shape {tuple(tensor.shape)}")
    if strict:
        problems += [f"unexpected tensor {n!r} (shape {tuple(t.shape)})" for n, t in loaded.items() if n not in expected]
    head = f"checkpoint {path.name!r} does not match the model"
    if not problems:
        problems, head = _check_data(loaded, recorded), f"checkpoint {path.name!r} is refused"
    if problems:
        raise CheckpointError(head + ":\n  " + "\n  ".join(problems[:20]) + ("\n  ..." if len(problems) > 20 else ""))
    with torch.no_grad():
        for name, tensor in expected.items():
            if name in loaded:
                tensor.copy_(loaded[name].to(tensor.dtype))
