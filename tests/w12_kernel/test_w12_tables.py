"""W12's tables per GPU model (kernels/w12/gemm.py TABLE_GPU / TABLES): which files a process loads, forced by
W12_TABLES or chosen from the CUDA device; every table in the package passes the promote check."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specpilot_lab.w12_bench import run_gpu
from specpilot_lab.w12_promote import check_table
from w12 import gemm

PACKAGE = Path(gemm.__file__).parent


def tables_in(env_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "W12_TABLES"}
    if env_value is not None:
        env["W12_TABLES"] = env_value
    code = "import json, w12.gemm as g; print(json.dumps([g.TABLES, sorted(map(list, g.TUNED))]))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("gpu", sorted(set(gemm.TABLE_GPUS.values())))
def test_w12_tables_loads_that_gpus_files(gpu):
    done = tables_in(gpu)
    assert done.returncode == 0, done.stderr
    tables, tuned = json.loads(done.stdout)
    assert tables == {"gpu": gpu, "tuned": f"tuned_{gpu}.json", "fallback": f"fallback_{gpu}.json"}
    on_disk = json.loads((PACKAGE / f"tuned_{gpu}.json").read_text())
    assert sorted(list(gemm.tuned_key(k)) for k in on_disk if not k.startswith("_")) == tuned


def test_an_unknown_w12_tables_value_is_refused_by_name():
    done = tables_in("a100")
    assert done.returncode != 0 and "W12_TABLES='a100': tables exist for h100, h200" in done.stderr


def test_every_gpu_named_has_its_tables_and_they_pass_the_promote_check():
    for gpu in set(gemm.TABLE_GPUS.values()):
        for kind in ("tuned", "fallback"):
            check_table(PACKAGE / f"{kind}_{gpu}.json")


def test_a_runs_gpu_comes_from_its_device_line():
    assert run_gpu({"device": "device NVIDIA H100 80GB HBM3, 132 SMs"}) == "h100"
    assert run_gpu({"device": "NVIDIA H200, 132 SMs"}) == "h200"
    with pytest.raises(ValueError, match="no table name"):
        run_gpu({"device": "NVIDIA A100-SXM4-80GB"})
