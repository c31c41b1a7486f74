"""SGLang launch flags and values are checked at build time against the pinned SGLang's own parser."""

from __future__ import annotations

import json

import pytest

from specpilot_build.assemble.builder import build_engine
from specpilot_build.errors import ConfigError
from specpilot_build.locations import data_dir

SETTING = "h100_c1_qwen3-8b_dflash"  # pinned in lockfiles/; final carries the tuned-dflash-block mechanism
MECH = "final.mechanisms.tuned-dflash-block.launch_args"


@pytest.mark.sglang
@pytest.mark.parametrize(
    "override,named",
    [
        (
            f"+{MECH}.speculative-dflash-blok-size=16",
            ["--speculative-dflash-blok-size", "tuned-dflash-block", "did you mean --speculative-dflash-block-size?"],
        ),
        (f"{MECH}.speculative-dflash-block-size=abc", ["--speculative-dflash-block-size", "'abc'", "int"]),
        ("+runtime.launch_args.attention-backend=fa9", ["--attention-backend", "runtime.launch_args", "'fa9'", "fa3"]),
        ("+runtime.launch_args.enable-torch-compile=7", ["--enable-torch-compile", "switch"]),
    ],
)
def test_a_flag_or_value_sglang_would_refuse_fails_the_build_naming_it(override, named):
    with pytest.raises(ConfigError) as error:
        build_engine(SETTING, "final", [override])
    assert all(part in str(error.value) for part in named), str(error.value)


@pytest.mark.sglang
def test_the_flag_table_is_read_once_per_wheel_and_overlays_and_a_damaged_cache_is_read_again():
    build_engine(SETTING, "stock")
    tables = sorted((data_dir() / "cache" / "sglang-flags").glob("*.json"))
    assert tables
    record = json.loads(tables[0].read_text())
    assert "--speculative-dflash-block-size" in record["flags"]
    record["flags"]["--speculative-dflash-blok-size"] = record["flags"]["--speculative-dflash-block-size"]
    for table in tables:  # a forged table (a misspelt flag added, digest not matching) is not trusted
        table.write_text(json.dumps(record))
    with pytest.raises(ConfigError, match="blok-size"):
        build_engine(SETTING, "final", [f"+{MECH}.speculative-dflash-blok-size=16"])
