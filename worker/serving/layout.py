"""Which process does what in one worker: `tp` tensor-parallel DiT ranks and one decoder rank (docs/multi_gpu.md).

World (size tp + 1), by global rank:

    rank 0          DiT rank 0 + the session's owner: the WorkerService (Redis lease, heartbeats, inbox, flags),
                    the audio input, the per-chunk control; the `vivant worker` process itself
    rank 1 … tp−1   DiT ranks: 1/tp of the heads and of the SwiGLU width each (worker/model/tp.py)
    rank tp         the decoder rank: the causal VAE decoder, the pacer, the outgoing sinks (MP4, LiveKit)

Devices: on CPU every rank uses the CPU (gloo). On CUDA DiT rank r uses cuda:r; the decoder rank uses cuda:tp
(`decoder_device = own`: tp + 1 GPUs) or cuda:0 (`shared`: tp GPUs, the decoder beside DiT rank 0). Process
groups: the world (gloo on CPU; gloo for CPU tensors + NCCL for CUDA tensors on GPUs), the TP group (ranks
0 … tp−1: the all-reduces and rank 0's control broadcast) and the link (ranks 0 and tp: headers, latents, PCM,
the decoder's acknowledgements) — NCCL when the decoder has its own GPU, gloo (CPU tensors) when it shares
rank 0's GPU, since one NCCL communicator cannot hold two ranks on one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
from vivant.worker.model.config import ConfigError, ModelConfig

# In-switch (NVLink multicast) reduction must stay off on the machines vivant runs on; every rank sets these
# before its process group exists.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class DecoderDevice(StrEnum):
    OWN = "own"
    SHARED = "shared"


class RankRole(StrEnum):
    DIT = "dit"
    DECODER = "decoder"


@dataclass(frozen=True)
class RankLayout:
    """tp DiT ranks + one decoder rank on one host (module docstring). device: "cpu" or "cuda"."""

    tp: int = 1
    device: str = "cpu"
    decoder_device: DecoderDevice = DecoderDevice.OWN

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError(f"tensor_parallel = {self.tp!r}; expected a positive integer (DiT ranks)")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device = {self.device!r}; expected 'cpu' or 'cuda' (each rank picks its own index)")
        try:
            object.__setattr__(self, "decoder_device", DecoderDevice(self.decoder_device))
        except ValueError:
            raise ConfigError(f"decoder_device = {self.decoder_device!r}; expected one of "
                              f"{', '.join(d.value for d in DecoderDevice)}") from None

    @property
    def world_size(self) -> int:
        return self.tp + 1

    @property
    def decoder_rank(self) -> int:
        return self.tp

    @property
    def dit_ranks(self) -> list[int]:
        return list(range(self.tp))

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def gpus_needed(self) -> int:
        return 0 if not self.cuda else self.tp + (1 if self.decoder_device is DecoderDevice.OWN else 0)

    @property
    def backend(self) -> str:
        """The world's backend string for torch.distributed.init_process_group."""
        return "cpu:gloo,cuda:nccl" if self.cuda else "gloo"

    @property
    def link_backend(self) -> str:
        return "nccl" if self.cuda and self.decoder_device is DecoderDevice.OWN else "gloo"

    def role(self, rank: int) -> RankRole:
        self._check_rank(rank)
        return RankRole.DECODER if rank == self.decoder_rank else RankRole.DIT

    def device_of(self, rank: int) -> torch.device:
        self._check_rank(rank)
        if not self.cuda:
            return torch.device("cpu")
        if rank == self.decoder_rank:
            return torch.device("cuda", self.tp if self.decoder_device is DecoderDevice.OWN else 0)
        return torch.device("cuda", rank)

    def link_device_of(self, rank: int) -> torch.device:
        """The link's tensors on this end: the rank's own GPU for an NCCL link, else the CPU."""
        return self.device_of(rank) if self.link_backend == "nccl" else torch.device("cpu")

    def describe(self, rank: int) -> str:
        return f"rank {rank} ({self.role(rank).value}, {self.device_of(rank)})"

    def check(self, cfg: ModelConfig) -> None:
        """Before anything is spawned: tp divides the model's heads and SwiGLU width, and the GPUs exist."""
        cfg.shard_heads(self.tp)  # ConfigError naming n_heads or d_ff
        if self.cuda:
            have = torch.cuda.device_count()
            if have < self.gpus_needed:
                raise ConfigError(f"tensor_parallel = {self.tp} with decoder_device = {self.decoder_device.value} "
                                  f"needs {self.gpus_needed} GPUs; this host has {have}")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank = {rank}; expected 0 ≤ rank < world_size = {self.world_size}")
