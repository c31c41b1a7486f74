"""Test helpers for the reference runtime: an engine config.json in a temp dir, and a real server process.

Functions only: the model directory (conftest's `stories_dir` fixture) is passed in, so importing this module needs
nothing from ../shared."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def engine_config(
    arm: str = "final",
    *,
    algorithm: str | None = None,
    k: int = 8,
    max_n: int = 6,
    min_n: int = 1,
    runtime_options: dict | None = None,
    max_running: int = 1,
    dtype: str = "float32",
) -> dict:
    """A resolved config as the builder writes it (the keys the reference runtime reads)."""
    if algorithm is None:
        algorithm = "none" if arm == "ar" else "ngram"
    if runtime_options is None:
        runtime_options = {"shared_ngram_cache": True} if arm == "final" else {}
    return {
        "setting": "cpu_c1_stories260k_ngram" if max_running == 1 else "cpu_c16_stories260k_ngram",
        "arm": {"name": arm},
        "model": {"name": "stories260K", "dtype": dtype, "quantization": None},
        "hardware": {"device": "cpu"},
        "drafter": {"algorithm": algorithm, "num_draft_tokens": k, "ngram_max_n": max_n, "ngram_min_n": min_n},
        "runtime_options": runtime_options,
        "batching": {"concurrency": max_running, "max_running_requests": max_running},
    }


def write_engine(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def three_free_ports() -> int:
    """A base port with the two after it free too (demo and tune serve ar, stock, final on PORT..PORT+2)."""
    for _ in range(50):
        base = free_port()
        if base > 65000:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base + 1))
                b.bind(("127.0.0.1", base + 2))
            return base
        except OSError:
            continue
    raise RuntimeError("no three consecutive free ports")


def launch(engine_dir: Path, engine_id: str, port: int, model_dir: Path, extra: list[str] = ()) -> subprocess.Popen:
    """Start the server exactly as `make serve` does (the launch contract), from the installed specpilot_runtime."""
    argv = [
        sys.executable,
        "-m",
        "specpilot_runtime.server",
        "--engine",
        str(engine_dir),
        "--engine-id",
        engine_id,
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 600) -> str:
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server on port {port} not healthy after {timeout}s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers' own generate (an independent reference)."""
    import torch

    model = hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=2, pad_token_id=2
        )
    return out[0, len(prompt_ids) :].tolist()


_HF = {}


def hf_model(model_dir: Path):
    if model_dir not in _HF:
        from transformers import AutoModelForCausalLM

        _HF[model_dir] = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    return _HF[model_dir]


STORY_PROMPTS = [
    "Once upon a time",
    "One day, a little boy",
    "Lily and Tom went to the park",
    "The sun was shining",
    "There was a big dog",
    "Tim had a red ball",
    "Sue liked to paint",
    "A little bird sat on a tree",
    "Mom said, \"Let's go",
    "The cat was hungry",
    "Ben found a box",
    "Anna wanted to fly",
    "In a small house lived",
    "The rain fell all day",
    "Max saw a frog",
    "Sara had a new doll",
    "Once there was a kind king",
    "The boy and his dad",
    "A fish swam in the pond",
    "It was a cold night",
]


EAGLE3_SMALL = [  # recipe eagle3-135m cut to seconds for stories260K (tests/conftest.py's eagle3_head)
    "data.limit=3",
    "data.max_new_tokens=24",
    "draft_vocab=64",
    "eagle3.aux_layers=[0,2,4]",
    "train.steps=6",
    "train.checkpoint_every=3",
    "train.batch_size=4",
]
