"""Recipe key `train.device` (cpu | cuda): checked like every recipe key, refused in one line where CUDA is absent,
left out of a drafter's id and of the data set's key when it is the default `cpu` (so no recipe's part of an id
moved), named in both when `cuda`; drafter.json records the platform that made the drafter."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

SETTING = "cpu_c1_stories260k_ngram"
SMALL = ["data.limit=2", "data.max_new_tokens=16", "train.steps=3", "train.batch_size=4"]

# sha256 of the canonical JSON of every recipe as load_recipe returned it before `train.device` existed (commit
# 808ef90): the recipe material of an id made before the key, which the key's default must leave as it was
BEFORE_DEVICE = {
    "eagle3-135m": "7cc3a2a2c1856d8e8ffc7413354466acdcb815e58a569f2f91a9a03fb5f15ec5",
    "eagle3-135m-long": "ed8103cc88c17c29faf21f711b78121a46548c0b7e1b9d9154c68aa866a23fcb",
    "standalone": "8d097acec5d45c35140ad4b43ccb267c336fbf8c94d3741fb18e6c6b220762b3",
    "standalone-135m": "6c6e9b25afa65588963f09c0d9e5ef585cba62f37bbbdbe55b205b030a3488a3",
    "truncated": "89c75847ebc4d090fbe729c5b6d3b5b123256d5304238d1d48a4429ad9367423",
    "truncated-135m": "66fc28acbe0a43ada659440f9d382aaf4ad1023a63f4f10212d4c938295228d8",
}


@pytest.fixture(autouse=True)
def scratch(drafter_scratch):
    return drafter_scratch


def _canonical(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@pytest.mark.parametrize("name", sorted(BEFORE_DEVICE))
def test_the_default_cpu_leaves_every_existing_recipes_id_material_as_it_was(name):
    from specpilot_build.draft.recipe import id_material, load_recipe

    recipe = load_recipe(name)
    assert recipe["train"] is None or recipe["train"]["device"] == "cpu"
    assert _canonical(id_material(recipe)) == BEFORE_DEVICE[name]
    assert (
        _canonical(id_material(load_recipe(name, ["train.device=cpu"] if recipe["train"] else [])))
        == (BEFORE_DEVICE[name])
    )


def test_cuda_is_part_of_the_id_material_and_of_the_data_key(stories_dir):
    from specpilot_build.draft.data import key_of
    from specpilot_build.draft.recipe import id_material, load_recipe
    from specpilot_build.draft.target import setting_target

    cuda = id_material(load_recipe("eagle3-135m-long", ["train.device=cuda"]))
    assert cuda["train"]["device"] == "cuda" and _canonical(cuda) != BEFORE_DEVICE["eagle3-135m-long"]
    target, spec = setting_target(SETTING), load_recipe("standalone")["data"]
    assert "device" not in key_of(target, spec, 1, "cpu")
    assert key_of(target, spec, 1, "cuda:0") == {**key_of(target, spec, 1, "cpu"), "device": "cuda"}


def test_an_unknown_device_is_one_line_naming_the_file_and_key(capsys, tmp_path, monkeypatch, repo):
    from specpilot_build.cli.main import main

    conf = tmp_path / "conf"
    shutil.copytree(repo / "conf", conf)
    text = (conf / "recipe" / "standalone.yaml").read_text().replace("  threads: 1\n", "  threads: 1\n  device: tpu\n")
    (conf / "recipe" / "standalone.yaml").write_text(text)
    monkeypatch.setenv("SPECPILOT_CONF", str(conf))
    assert main(["draft", "--setting", SETTING, "--recipe", "standalone"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "recipe/standalone.yaml" in err and "train.device 'tpu' is not one of cpu, cuda" in err
    assert not (tmp_path / "data" / "drafters").exists()


def test_cuda_where_torch_sees_no_gpu_is_one_line_and_writes_nothing(capsys, scratch, tmp_path, monkeypatch):
    import torch

    from specpilot_build.cli.main import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this VM; forced where a GPU is present
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # restored after the test
    assert main(["draft", "--setting", SETTING, "--recipe", "standalone", "train.device=cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "recipe/standalone.yaml: train.device cuda, but torch" in err and "sees no CUDA device here" in err
    assert not (tmp_path / "data" / "drafters").exists() and not (tmp_path / "data" / "draft-data").exists()
    assert not (scratch / "drafters.toml").exists()


def test_the_default_and_an_explicit_cpu_make_the_same_drafter_and_record_the_platform():
    import torch

    from specpilot_build.draft.make import make_drafter

    made = make_drafter(SETTING, "standalone", SMALL)
    again = make_drafter(SETTING, "standalone", [*SMALL, "train.device=cpu"])
    assert (again.id, again.built) == (made.id, False)
    record = json.loads((made.directory / "drafter.json").read_text())
    assert "device" not in record["recipe"]["train"]
    assert record["platform"]["device"] == "cpu" and record["platform"]["torch"] == torch.__version__
