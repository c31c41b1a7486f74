"""The structured-config schema: one dataclass per config group, registered in Hydra's ConfigStore.

Every group is validated at compose time: an unknown key or a wrong type fails naming the key."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class Hardware:
    name: str = MISSING
    device: str = MISSING  # "cpu" | "cuda"
    gpu: Optional[str] = None  # the CUDA device name, e.g. "NVIDIA H100 80GB HBM3"
    compute_capability: Optional[str] = None  # "9.0"
    arch: Optional[str] = None  # "sm_90", "sm_120a"
    memory_gib: int = 0


@dataclass
class Model:
    name: str = MISSING
    repo: str = MISSING  # Hugging Face repo id; its revision comes from lockfiles/checkpoints.toml
    files: List[str] = field(default_factory=list)  # paths inside the repo; empty = the whole snapshot
    source_format: str = "hf"  # "hf" | "llama2c"
    architecture: str = MISSING  # HF architectures[0], e.g. "Qwen3ForCausalLM"
    dtype: str = "bfloat16"
    quantization: Optional[str] = None  # None | "fp8" | "w12"
    context_length: int = MISSING
    params_b: float = MISSING  # parameters, billions


@dataclass
class Drafter:
    name: str = MISSING
    algorithm: str = MISSING  # none | ngram | draft_model (reference); NGRAM | EAGLE3 | DFLASH | DSPARK (SGLang)
    repo: Optional[str] = None  # draft checkpoint; None for model-free drafters
    files: List[str] = field(default_factory=list)
    num_draft_tokens: Optional[int] = None
    ngram_max_n: Optional[int] = None
    ngram_min_n: Optional[int] = None
    block_size: Optional[int] = None  # DFlash block size / DSpark gamma
    num_steps: Optional[int] = None
    eagle_topk: Optional[int] = None


@dataclass
class Batching:
    name: str = MISSING
    concurrency: int = MISSING
    max_running_requests: int = MISSING
    cuda_graph_bs: List[int] = field(default_factory=list)


@dataclass
class Arm:
    name: str = MISSING  # ar | stock | final
    uses_drafter: bool = MISSING
    applies_mechanisms: bool = MISSING


@dataclass
class Runtime:
    name: str = MISSING  # "reference" | "sglang"
    launch_args: Dict[str, Any] = field(default_factory=dict)  # SGLang args every arm of this runtime gets
    prune: Optional[Dict[str, Any]] = None  # wheel pruning rules (prune.py); None keeps every member


@dataclass
class Mechanism:
    """One named speed-up of a setting's `final` arm: an overlay and/or tuned arguments."""

    name: str = MISSING
    overlay: Optional[str] = None
    launch_args: Dict[str, Any] = field(default_factory=dict)  # SGLang server arguments
    model: Dict[str, Any] = field(default_factory=dict)  # overrides of model fields (e.g. quantization)
    drafter: Dict[str, Any] = field(default_factory=dict)  # overrides of drafter fields
    kernels: List[str] = field(default_factory=list)  # kernels/<name>/ copied into the engine tree
    runtime_options: Dict[str, Any] = field(default_factory=dict)  # reference runtime options


@dataclass
class Final:
    mechanisms: List[Mechanism] = field(default_factory=list)


@dataclass
class SpecPilotConfig:
    setting: str = MISSING
    description: str = MISSING
    hardware: Hardware = MISSING
    model: Model = MISSING
    drafter: Drafter = MISSING
    batching: Batching = MISSING
    arm: Arm = MISSING
    runtime: Runtime = MISSING
    final: Final = field(default_factory=Final)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="specpilot_schema", node=SpecPilotConfig)
    for group, node in (("hardware", Hardware), ("model", Model), ("drafter", Drafter),
                        ("batching", Batching), ("arm", Arm), ("runtime", Runtime)):
        cs.store(group=group, name=f"{group}_schema", node=node)
