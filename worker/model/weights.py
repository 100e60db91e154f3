"""Checkpoints: safetensors in, safetensors out, with shape checks that name the tensor.

A checkpoint whose names or shapes do not match the model (the preset) is refused before anything
is copied, so a bad file never leaves a half-loaded model behind. Nothing is fetched from a hub.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


class CheckpointError(ValueError):
    pass


def save_weights(model: torch.nn.Module, path: str | Path) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(path))


def load_weights(model: torch.nn.Module, path: str | Path, *, strict: bool = True) -> None:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        loaded = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"checkpoint {str(path)!r} is not a readable safetensors file: {exc}") from None
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
    if problems:
        head = f"checkpoint {path.name!r} does not match the model"
        raise CheckpointError(head + ":\n  " + "\n  ".join(problems[:20]) + ("\n  ..." if len(problems) > 20 else ""))
    with torch.no_grad():
        for name, tensor in expected.items():
            if name in loaded:
                tensor.copy_(loaded[name].to(tensor.dtype))
