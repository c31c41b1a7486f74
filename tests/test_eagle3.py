"""Recipe (c), an EAGLE-3 head, on the stories260K target: the saved directory is what SGLang 0.5.17's
LlamaForCausalLMEagle3 loads (its real llama_eagle3.py, read out of the pinned wheel, runs its load_weights on our
file), the reference runtime's Eagle3Drafter keeps the target's exact tokens, its forward agrees with the training
module's, and a head made for another target is refused in one line."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch
from reference_runtime_helpers import EAGLE3_SMALL as SMALL
from safetensors.torch import load_file

SETTING = "cpu_c1_stories260k_ngram"
# (c) cut to seconds for stories260K (5 layers): 3 prompts per dataset, 24 new tokens, 6 steps unrolled twice
EAGLE3_PY = "sglang/srt/models/llama_eagle3.py"
LLAMA_PY = "sglang/srt/models/llama.py"


@pytest.fixture(scope="module")
def head(eagle3_head):
    """The small head made once for the session (tests/conftest.py)."""
    return eagle3_head


@pytest.fixture(scope="module")
def sglang_0517(repo, session_data) -> Path:
    """The pinned SGLang 0.5.17 wheel (lockfiles/runtimes.toml), as the builder obtains it, hash-checked."""
    from specpilot_build.pins.lockfile import load_lock
    from specpilot_build.pins.wheels import wheel_file

    return wheel_file(load_lock(repo / "lockfiles").runtimes["sglang-0.5.17"])


# --- SGLang's loader, run for real -------------------------------------------------------------------------------


class _Param(torch.nn.Parameter):
    pass


def _sglang_stubs(config, loads: list) -> dict[str, types.ModuleType]:
    """Just enough of sglang's layers for llama_eagle3.py to build its module tree on CPU: each layer holds the
    weight of the shape SGLang's would (tp 1), and each weight loader records what it was given and checks the
    shape of the slice it fills. Attributes nobody stubbed resolve to an inert class (so imports of either
    version resolve); the base classes follow llama.py's attribute names (the test checks them in the file)."""
    nn = torch.nn

    class Inert:
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, *args, **kwargs):
            return Inert()

        def __getattr__(self, name):
            return Inert()

    def loader(param, loaded, shard=None):
        lo, hi = getattr(param, "shards", {})[shard] if shard is not None else (0, param.shape[0])
        assert tuple(loaded.shape) == (hi - lo, *param.shape[1:]), (shard, tuple(param.shape), tuple(loaded.shape))
        param.data[lo:hi] = loaded
        loads.append(shard)

    def weight(label, *shape, shards=None):
        param = nn.Parameter(torch.full(shape, float("nan")))
        param.shards, param.weight_loader = shards or {}, loader
        return param

    class Linear(nn.Module):
        def __init__(self, name, rows, cols, shards=None):
            super().__init__()
            self.weight = weight(name, rows, cols, shards=shards)

    class QKVParallelLinear(Linear):
        def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads=None, bias=False, **kw):
            q, kv = total_num_heads * head_size, (total_num_kv_heads or total_num_heads) * head_size
            shards = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
            super().__init__("qkv_proj", q + 2 * kv, hidden_size, shards)

    class RMSNorm(nn.Module):
        def __init__(self, hidden_size, eps=1e-6, **kw):
            super().__init__()
            self.weight = weight("norm", hidden_size)

    class Embedding(nn.Module):
        def __init__(self, num_embeddings, embedding_dim, *args, **kw):
            super().__init__()
            self.weight = weight("embedding", num_embeddings, embedding_dim)

    class LlamaMLP(nn.Module):
        def __init__(self, hidden_size, intermediate_size, hidden_act, quant_config=None, prefix="", **kw):
            super().__init__()
            i = intermediate_size
            self.gate_up_proj = Linear("gate_up_proj", 2 * i, hidden_size, {0: (0, i), 1: (i, 2 * i)})
            self.down_proj = Linear("down_proj", hidden_size, i)

    class LlamaAttention(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.hidden_size = c.hidden_size
            self.total_num_heads, self.total_num_kv_heads = c.num_attention_heads, c.num_key_value_heads
            self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            self.o_proj = Linear("o_proj", c.hidden_size, self.total_num_heads * self.head_dim)
            self.attn = Inert()

    class LlamaDecoderLayer(nn.Module):
        def __init__(self, config, layer_id=0, quant_config=None, prefix="", **kw):
            super().__init__()
            self.hidden_size = config.hidden_size
            self.self_attn = LlamaAttention(config)
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, "silu")
            self.input_layernorm = RMSNorm(config.hidden_size)
            self.post_attention_layernorm = RMSNorm(config.hidden_size)

    def default_weight_loader(param, loaded):
        loader(param, loaded)

    known = {
        "sglang.srt.layers.linear": {"QKVParallelLinear": QKVParallelLinear},
        "sglang.srt.layers.layernorm": {"RMSNorm": RMSNorm},
        "sglang.srt.layers.vocab_parallel_embedding": {
            "ParallelLMHead": Embedding,
            "VocabParallelEmbedding": Embedding,
        },
        "sglang.srt.models.llama": {
            "LlamaDecoderLayer": LlamaDecoderLayer,
            "LlamaMLP": LlamaMLP,
            "LlamaForCausalLM": nn.Module,
        },
        "sglang.srt.model_loader.weight_utils": {"default_weight_loader": default_weight_loader},
        "sglang.srt.layers.logits_processor": {"LogitsProcessor": lambda *a, **k: nn.Identity()},
        "sglang.srt.utils": {"add_prefix": lambda name, prefix: f"{prefix}.{name}" if prefix else name},
        "sglang.srt.layers.layer_boundary": {"layer_stack": contextlib.nullcontext},
        "sglang.srt.runtime_context": {
            "get_spec": lambda: types.SimpleNamespace(speculative_draft_window_size=None),
            "get_parallel": lambda: types.SimpleNamespace(pp_group=Inert()),
        },
        "sglang.srt.distributed": {"get_pp_group": lambda: Inert()},
    }
    for name in (
        "sglang.srt.configs.draft_parallel",
        "sglang.srt.layers.quantization.base_config",
        "sglang.srt.model_executor.forward_batch_info",
    ):
        known[name] = {}
    modules = {}
    for name, attrs in known.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        modules[name] = types.ModuleType(name)
        modules[name].__dict__.update(attrs)
    for module in modules.values():
        module.__getattr__ = lambda attr: Inert  # an import of either version resolves
        module.__path__ = []
    return modules


def test_the_saved_head_is_what_sglang_0517_loads(head, sglang_0517, monkeypatch):
    """SGLang 0.5.17's own llama_eagle3.py (read from the pinned wheel, not a copy of its names) builds
    LlamaForCausalLMEagle3 from our config.json and runs its load_weights over our model.safetensors: every
    tensor lands in a parameter of the right shape, every parameter but the embedding (the target's, set_embed)
    is filled, the head is the reduced one, and d2t gives back our draft vocabulary."""
    from transformers import LlamaConfig

    with zipfile.ZipFile(sglang_0517) as wheel:
        source = wheel.read(EAGLE3_PY).decode()
        llama = wheel.read(LLAMA_PY).decode()
    # the base classes stubbed above carry llama.py's own attribute names
    for attribute in (
        "self.o_proj = RowParallelLinear(",
        "self.gate_up_proj = MergedColumnParallelLinear(",
        "self.down_proj = RowParallelLinear(",
        "self.input_layernorm = RMSNorm(",
        "self.post_attention_layernorm = RMSNorm(",
        "self.total_num_kv_heads",
        "self.head_dim",
    ):
        assert attribute in llama, attribute
    config = json.loads((head.directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    loads: list = []
    for name, module in _sglang_stubs(config, loads).items():
        monkeypatch.setitem(sys.modules, name, module)
    namespace: dict = {"__name__": "sglang.srt.models.llama_eagle3"}
    exec(compile(source, EAGLE3_PY, "exec"), namespace)  # noqa: S102  (the wheel's own file)
    model = namespace["LlamaForCausalLMEagle3"](LlamaConfig(**config))
    tensors = load_file(head.directory / "model.safetensors")
    model.load_weights(iter(tensors.items()))

    weights = {n: t for n, t in tensors.items() if n not in ("d2t", "t2d")}
    assert len(loads) == len(weights)  # none dropped: the loader skips names it does not know, silently
    params = dict(model.named_parameters())
    unfilled = [n for n, p in params.items() if torch.isnan(p).any() and n != "model.embed_tokens.weight"]
    assert unfilled == []
    assert model.load_lm_head_from_target is False  # our lm_head is used, not the target's
    assert tuple(params["lm_head.weight"].shape) == (config["draft_vocab_size"], config["hidden_size"])
    assert model.model.fc.in_features == 3 * config["target_hidden_size"]
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape[1] == 2 * config["hidden_size"]  # attention input: [embedding ; feature]
    q_rows = tensors["midlayer.self_attn.q_proj.weight"].shape[0]
    assert torch.equal(qkv[:q_rows], tensors["midlayer.self_attn.q_proj.weight"])
    vocab = tensors["t2d"].nonzero().flatten()
    assert torch.equal(model.hot_token_id, vocab) and len(vocab) == config["draft_vocab_size"]
    # the config key SGLang's model runner reads for the target's capture, in the wheel
    with zipfile.ZipFile(sglang_0517) as wheel:
        runner = [n for n in wheel.namelist() if n.endswith("spec_aux_hidden_state.py")]
        assert runner and '"eagle_aux_hidden_state_layer_ids"' in wheel.read(runner[0]).decode()
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    assert re.search(r"self\.model\.layers_to_capture = \[val \+ 1 for val in layer_ids\]", llama)


# --- the reference runtime ----------------------------------------------------------------------------------------


def test_eagle3_drafter_serves_the_targets_exact_tokens(head, stories_dir, golden, tmp_path):
    """An engine drafting with the head (k 3) gives llama2.c's greedy golden token for token, its proposals
    come from the head (drafted and some accepted), and the target keeps the three layers' features only then."""
    from reference_runtime_helpers import engine_config, write_engine

    from specpilot_runtime.runtime import load_runtime

    engine_dir = write_engine(tmp_path / "eng", engine_config("stock", algorithm="eagle3", k=3))
    runtime = load_runtime(str(engine_dir), "id", str(stories_dir), str(head.directory), None)
    assert runtime.engine.model.capture == (0, 2, 4)
    prompt = golden["prompt_ids"]
    result = runtime.engine.generate(prompt, len(golden["sequence_ids"]) - len(prompt), timeout=60)
    assert prompt + result["output_ids"] == golden["sequence_ids"]
    info = runtime.server_info()
    # k proposals on every step but the last ones (where fewer tokens are left than k + 1)
    assert info["spec_draft_token_num"] >= 3 * (info["spec_verify_ct"] - 3)
    assert info["spec_accept_token_num"] > 0


def test_the_runtime_head_computes_what_training_computed(head, stories_dir):
    """Step 0 of the runtime's head over a sequence's features gives, row for row, the draft token the training
    module's forward scores best (both from the saved files; the feature from the target's LeanLlama)."""
    from specpilot_build.draft import eagle3
    from specpilot_runtime.eagle3 import Eagle3Head
    from specpilot_runtime.model import LeanLlama, load_hf_model

    target = LeanLlama(load_hf_model(stories_dir, "float32", "cpu"), 1, 1, "cpu")
    runtime_head = Eagle3Head(head.directory, target, 1)
    target.capture = runtime_head.aux_layers
    ids = [1, 403, 407, 261, 378, 270, 263, 365, 269, 300, 291, 367, 400]
    with torch.inference_mode():
        target.forward(torch.tensor([ids]), [0], [0])
        aux = target.last_aux[0]
        config = json.loads((head.directory / "config.json").read_text())
        trained = eagle3.Eagle3Head(config)
        tensors = load_file(head.directory / "model.safetensors")
        trained.load_state_dict({k: v for k, v in tensors.items() if k not in ("d2t", "t2d")})
        logits = trained.unroll(aux[None, :-1], target.embed[torch.tensor(ids[1:])][None], 1)[0][0]
        want = (logits.argmax(-1) + tensors["d2t"][logits.argmax(-1)]).tolist()
        got = [runtime_head.step(0, 0, ids[1 : t + 2], aux[: t + 1], from_target=True)[0] for t in range(len(ids) - 1)]
    assert got == want


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("hidden_size", 576, "hidden_size 576 differs from the target's 64"),
        ("vocab_size", 49152, "vocab_size 49152 differs from the target's 512"),
        ("target_hidden_size", 576, "target_hidden_size 576 differs from the target's 64"),
    ],
)
def test_a_head_for_another_target_is_refused_in_one_line(head, stories_dir, tmp_path, key, value, words):
    from reference_runtime_helpers import engine_config, write_engine

    from specpilot_runtime.config import RuntimeConfigError
    from specpilot_runtime.runtime import load_runtime

    other = tmp_path / "other-head"
    shutil.copytree(head.directory, other)
    config = json.loads((other / "config.json").read_text())
    config[key] = value
    (other / "config.json").write_text(json.dumps(config))
    engine_dir = write_engine(tmp_path / "eng", engine_config("stock", algorithm="eagle3", k=3))
    with pytest.raises(RuntimeConfigError) as exc:
        load_runtime(str(engine_dir), "id", str(stories_dir), str(other), None)
    assert words in str(exc.value) and str(other) in str(exc.value) and "\n" not in str(exc.value)


def test_the_output_only_loss_reads_the_output_rows_and_chains_starting_there(stories_dir):
    """eagle3.output_only: the target's distribution on a prompt row moves the loss only where a chain from an
    output row reaches it (never: the chains run forward); on an output row it moves it; without the key the
    prompt's rows count too. Step j's rows are those j after a chain start, inside the sequence."""
    from specpilot_build.draft import eagle3

    config = eagle3.head_config(stories_dir, [0, 2, 4], 16)
    head = eagle3.Eagle3Head(config)
    generator = torch.Generator().manual_seed(0)
    hidden = config["hidden_size"]

    def record(length: int, first: int) -> dict[str, torch.Tensor]:
        logp = torch.log_softmax(torch.randn(length, 16, generator=generator), -1).half()
        aux = torch.randn(length, 3 * hidden, generator=generator)
        return {
            "aux": aux,
            "next": torch.randint(0, 512, (length,), generator=generator),
            "logp": logp,
            "first": torch.tensor(first),
        }

    cached = [record(9, 4), record(6, 2)]  # padded to 9 in one batch of 2

    def loss(records, output_only: bool) -> float:
        aux, nxt, logp, valid, starts = eagle3._batch(records, 0, 0, 2, output_only)
        rows = eagle3._step_rows(starts, valid, 3)
        embeds = torch.randn(*nxt.shape, hidden, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            return eagle3._loss(head.unroll(aux, embeds, 3, rows), logp, rows).item()

    aux, nxt, logp, valid, starts = eagle3._batch(cached, 0, 0, 2, True)
    rows = eagle3._step_rows(starts, valid, 3)
    b = [int(c["first"]) for c in cached].index(4)  # the batch's order is the seeded permutation's
    assert rows[0][b].nonzero().flatten().tolist() == [4, 5, 6, 7, 8]
    assert rows[2][b].nonzero().flatten().tolist() == [6, 7, 8]
    assert rows[2][1 - b].nonzero().flatten().tolist() == [4, 5]

    def changed(row: int) -> list[dict[str, torch.Tensor]]:
        other = [dict(c) for c in cached]
        other[0]["logp"] = other[0]["logp"].clone()
        other[0]["logp"][row] = torch.log_softmax(torch.randn(16, generator=generator), -1).half()
        return other

    assert loss(changed(2), True) == loss(cached, True)  # a prompt row (the sequence's first output row is 4)
    assert loss(changed(6), True) != loss(cached, True)
    assert loss(changed(2), False) != loss(cached, False)


# --- the recipe and the build ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["eagle3.aux_layers=[1,2]"], "eagle3.aux_layers must be 3 target layer indices"),
        (["num_layers=2"], "num_layers 2: an EAGLE-3 head has 1 decoder layer"),
        (["eagle3.ttt_step=2"], "unknown key 'eagle3.ttt_step'"),
        (["eagle3.ttt_steps=0"], "eagle3.ttt_steps must be >= 1"),
        (["eagle3.output_only=maybe"], "eagle3.output_only"),
    ],
)
def test_a_bad_eagle3_recipe_is_one_line_naming_the_key(overrides, words):
    from specpilot_build.draft.recipe import load_recipe
    from specpilot_build.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        load_recipe("eagle3-135m", overrides)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_the_eagle3_section_does_nothing_for_other_kinds_and_is_refused():
    from specpilot_build.draft.recipe import load_recipe
    from specpilot_build.errors import ConfigError

    with pytest.raises(ConfigError, match="key 'eagle3' does nothing for kind standalone"):
        load_recipe("standalone", ["eagle3.ttt_steps=2"])


@pytest.mark.slow
def test_made_twice_or_resumed_after_an_interruption_the_head_has_the_same_id_and_bytes(
    head, tmp_path, monkeypatch, repo
):
    """A second make in a fresh store and data dir (features computed again) gives the same id and every file's
    bytes; so does one interrupted after its checkpoint and run again (it resumes)."""
    from specpilot_build.draft.make import make_drafter
    from specpilot_build.models.proof import sha256_of

    def hashes(directory: Path) -> dict[str, str]:
        return {p.name: sha256_of(p) for p in sorted(directory.iterdir())}

    shutil.copytree(repo / "lockfiles", tmp_path / "lockfiles")
    monkeypatch.setenv("SPECPILOT_LOCKFILES", str(tmp_path / "lockfiles"))
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))

    def interrupt(step: int, loss: float) -> None:
        if step == 4:  # after the checkpoint at step 3
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        make_drafter(SETTING, "eagle3-135m", SMALL, on_step=interrupt)
    resumed = make_drafter(SETTING, "eagle3-135m", SMALL)
    assert resumed.id == head.id
    assert hashes(resumed.directory) == hashes(head.directory)
