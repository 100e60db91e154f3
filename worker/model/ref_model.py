"""Where the trained `ref` character lives (demo, eval, service); its decoder loads with
`vivant.worker.stream.vae.load_ref_decoder`.

The weights ship in the repository under `weights/ref/` (written by `vivant train ref`, see
docs/reference_model.md): `ref_dit.safetensors` (the VideoDiT of the `ref` preset), `ref_vae.safetensors`
(the causal VAE decoder, taking unit-scale latents) and `ref_vae_encoder.safetensors` (training/eval only).
"""

from __future__ import annotations

from pathlib import Path

DIT_FILE, VAE_FILE, ENCODER_FILE = "ref_dit.safetensors", "ref_vae.safetensors", "ref_vae_encoder.safetensors"


def default_weights_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "weights" / "ref"


def ref_weights_present(weights_dir: str | Path | None = None) -> bool:
    d = Path(weights_dir) if weights_dir else default_weights_dir()
    return (d / DIT_FILE).is_file() and (d / VAE_FILE).is_file()


def ref_paths(weights_dir: str | Path | None = None) -> tuple[Path, Path]:
    """(DiT, VAE decoder) checkpoint paths; a ValueError names the missing file."""
    d = Path(weights_dir) if weights_dir else default_weights_dir()
    for name in (DIT_FILE, VAE_FILE):
        if not (d / name).is_file():
            raise ValueError(f"--weights {str(d)!r}: {name} is missing; expected the output of `vivant train ref`")
    return d / DIT_FILE, d / VAE_FILE
