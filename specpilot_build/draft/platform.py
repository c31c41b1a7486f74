"""Where a drafter is made (recipe key `train.device`): checked before anything runs, made deterministic, and
described for drafter.json.

`cpu`: torch's deterministic algorithms and the recipe's thread count (train.py). `cuda`: one GPU (cuda:0) with
torch's deterministic algorithms and cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8, which cuBLAS reads
when CUDA initialises, so it is set before anything touches the GPU). The same id on the same GPU model and
software gives the same bytes; another GPU model (or CUDA/cuBLAS version) may pick other kernels and round
differently, so the bytes (never the id) may differ there: the pin's file digests prove the files."""

from __future__ import annotations

import os
from typing import Any

from specpilot_build.errors import ConfigError

CUBLAS_WORKSPACE = ":4096:8"


def prepare(device: str, where: str) -> str:
    """The torch device to run on, after checking it exists here and making it deterministic; one line if not."""
    import torch

    if device == "cpu":
        return "cpu"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if os.environ["CUBLAS_WORKSPACE_CONFIG"] not in (CUBLAS_WORKSPACE, ":16:8"):
        raise ConfigError(
            f"{where}: train.device cuda needs CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} (deterministic cuBLAS), "
            f"the environment has {os.environ['CUBLAS_WORKSPACE_CONFIG']}"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            f"{where}: train.device cuda, but torch {torch.__version__} sees no CUDA device here; "
            f"use train.device=cpu or make it on a GPU host (benchmarks/draft_gpu.sh)"
        )
    torch.use_deterministic_algorithms(True)
    return "cuda:0"


def describe(device: str) -> dict[str, Any]:
    """What drafter.json records of the platform that made it (not part of the id)."""
    import platform

    import torch

    record: dict[str, Any] = {"device": device, "torch": torch.__version__, "machine": platform.machine()}
    if device != "cpu":
        record.update(cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(torch.device(device)))
    return record
