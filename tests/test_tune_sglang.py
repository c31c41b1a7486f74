"""`make tune` spaces for SGLang settings (conf/tune/sglang_*.yaml): each composes into its settings, every launch
flag and value checked against the pinned SGLang's own flag table (read from the real wheel), a misspelt flag or a
refused choice is a one-line error naming the space file and key; and a tune of a GPU setting on a machine without
that GPU is refused in one line before anything is written."""

from __future__ import annotations

import pytest

from specpilot_build.cli.main import main
from specpilot_build.errors import ConfigError

EAGLE = "h100_c1_qwen3-8b_eagle3"  # SGLang 0.5.23


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize(
    "space,setting,replaced",
    [
        ("sglang_ngram", "h200_c1_stories260k-padded_ngram", ["tuned-ngram", "cuda-graph-bs"]),  # SGLang 0.5.17
        ("sglang_ngram", "h200_c1_stories260k-padded-bf16_ngram", ["tuned-ngram", "w12-weights", "cuda-graph-bs"]),
        ("sglang_ngram_c1", "h100_c1_stories260k-padded-bf16_ngram", ["tuned-ngram", "w12-weights", "cuda-graph-bs"]),
        ("sglang_ngram_corpus", "h200_c1_stories260k-padded_ngram", ["tuned-ngram", "cuda-graph-bs"]),
        ("sglang_eagle", EAGLE, ["tuned-eagle-steps", "cuda-graph-bs", "w12-weights"]),
        ("sglang_dflash", "h100_c1_qwen3-8b_dflash", ["tuned-dflash-block", "cuda-graph-bs", "w12-weights"]),
        ("sglang_dflash", "h200_c1_qwen3-tiny_dflash", ["tuned-dflash-block", "cuda-graph-bs"]),
    ],
)
def test_each_shipped_sglang_space_composes_and_its_flags_pass_the_pinned_sglangs_table(space, setting, replaced):
    from specpilot_build.tune.space import check_space, load_space

    assert check_space(load_space(space), setting) == replaced


def _refused(conf, name: str, text: str) -> str:
    from specpilot_build.tune.space import check_space, load_space

    (conf / "tune" / f"{name}.yaml").write_text(text)
    with pytest.raises(ConfigError) as caught:
        check_space(load_space(name), EAGLE)
    message = str(caught.value)
    assert "\n" not in message and f"{name}.yaml" in message
    return message


@pytest.mark.sglang
@pytest.mark.slow
def test_a_misspelt_flag_a_refused_choice_or_type_is_one_line_naming_file_and_key(conf):
    typo = _refused(conf, "typo", "params:\n  launch_args:\n    speculative-num-stepz: [2, 3]\n")
    assert "params.launch_args.speculative-num-stepz" in typo and "not a flag of SGLang 0.5.23" in typo
    assert "did you mean --speculative-num-steps?" in typo
    choice = _refused(conf, "choice", "params:\n  launch_args:\n    attention-backend: [triton, fa9]\n")
    assert "params.launch_args.attention-backend = 'fa9'" in choice and "not one of SGLang 0.5.23's choices" in choice
    kind = _refused(conf, "kind", "params:\n  launch_args:\n    speculative-eagle-topk: [1, many]\n")
    assert "params.launch_args.speculative-eagle-topk = 'many'" in kind and "int" in kind
    switch = _refused(conf, "switch", "params:\n  launch_args:\n    disable-overlap-schedule: [1]\n")
    assert "params.launch_args.disable-overlap-schedule = 1" in switch and "is a switch" in switch


def test_a_gpu_setting_is_not_tuned_without_its_gpu_in_one_line_and_nothing_is_written(
    conf, tmp_path, monkeypatch, capsys
):
    from specpilot_build.tune.study import storage_path

    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no nvidia-smi: no GPU is visible, whatever this machine has
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))  # where the study would be: empty
    before = {str(p): p.read_bytes() for p in conf.rglob("*") if p.is_file()}
    assert main(["tune", "--setting", EAGLE, "--space", "sglang_eagle", "--trials", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: make tune SETTING=h100_c1_qwen3-8b_eagle3: ") and "\n" not in err, err
    assert "NVIDIA H100" in err and "no CUDA GPU 0 is visible" in err and "LAUNCHER=" in err
    assert not storage_path().exists()  # no study was opened
    assert {str(p): p.read_bytes() for p in conf.rglob("*") if p.is_file()} == before
