"""`make w12-promote`: the one way a measured table enters the kernel package, checked as the package reads it."""

import json
from pathlib import Path

import pytest

import w12
from specpilot_lab.w12_promote import check_table, main, promote
from w12 import gemm


def test_a_measured_table_is_promoted_whole(tmp_path):
    package = tmp_path / "w12"
    package.mkdir()
    table = {
        "_comment": "picked on an H100",
        "5120,10240,8": vars(gemm.Config()),
        "5120,10240,16,heavy": dict(vars(gemm.Config()), block_n=64),
    }
    candidate = tmp_path / "tuned_h100.json"
    candidate.write_text(json.dumps(table))
    target = promote(candidate, package)
    assert target == package / "tuned_h100.json" and json.loads(target.read_text()) == table
    assert sorted(p.name for p in package.iterdir()) == ["tuned_h100.json"]  # no temporary left


@pytest.mark.parametrize(
    ("name", "table", "named"),
    [
        ("tuned_h100.json", {"1,2,8,light": {}}, "'1,2,8,light'"),
        ("tuned_h100.json", {"1,2,8": {"block_n": 64, "no_such_field": 1}}, "'1,2,8'"),
        ("fallback_h100.json", {"1,2,8": {"M": 8}}, "'1,2,8'"),
        ("layouts_h100.json", {"5120,10240": "columns"}, "'5120,10240'"),
        ("tuned-h100.json", {"1,2,8": {}}, "<kind>_<gpu>.json"),
        ("tuned_h100.json", {"_comment": "nothing else"}, "at least one entry"),
    ],
)
def test_a_table_the_package_could_not_read_is_refused_naming_file_and_key(tmp_path, capsys, name, table, named):
    candidate = tmp_path / name
    candidate.write_text(json.dumps(table))
    with pytest.raises(ValueError, match=f"^{candidate}: .*"):
        check_table(candidate)
    package = Path(w12.__file__).resolve().parent
    before = {p.name: p.read_bytes() for p in package.iterdir() if p.is_file()}
    assert main([str(candidate)]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in package.iterdir() if p.is_file()} == before
