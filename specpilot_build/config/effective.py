"""What one arm of a setting runs: the composed config reduced to the parts that arm executes.

The engine id depends only on this, so changing a setting's `final` tuning never changes its `ar` or `stock`
engines, and an `ar` engine does not depend on the drafter it does not run."""

from __future__ import annotations

import copy
from typing import Any

from specpilot_build.errors import ConfigError

NO_DRAFTER = {"name": "none", "algorithm": "none"}


def effective_config(config: dict[str, Any]) -> dict[str, Any]:
    cfg = copy.deepcopy(config)
    arm = cfg["arm"]
    cfg.pop("cache", None)  # substituters say where an engine may be fetched from, not what it runs
    declared = (cfg.pop("final", None) or {}).get("mechanisms") or {}
    # final.mechanisms maps each mechanism's name to what it sets, in the order the setting lists them
    mechanisms = [dict(body, name=name) for name, body in declared.items()] if arm["applies_mechanisms"] else []
    if not arm["uses_drafter"]:
        cfg["drafter"] = dict(NO_DRAFTER)
    runtime_options: dict[str, Any] = {}
    launch_args: dict[str, Any] = dict(cfg["runtime"].get("launch_args", {}))
    kernels: list[str] = []
    for mech in mechanisms:
        cfg["model"].update(mech.get("model", {}))
        cfg["drafter"].update(mech.get("drafter", {}))
        kernels += [k for k in mech.get("kernels", []) if k not in kernels]
        runtime_options.update(mech.get("runtime_options", {}))
        launch_args.update(mech.get("launch_args", {}))
    if cfg["drafter"].get("recipe", "absent") is None:  # no recipe drafter: left out, so no engine id moves
        del cfg["drafter"]["recipe"]
    made_for = cfg["drafter"].pop("made_for", None)
    if made_for is not None:
        if not cfg["drafter"].get("recipe"):
            raise ConfigError(f"drafter.made_for {made_for} does nothing without drafter.recipe")
        cfg["drafter"]["made_for"] = made_for
    breadth = cfg["drafter"].pop("tree_breadth", None)
    if breadth is not None:
        if cfg["runtime"]["name"] != "reference" or cfg["drafter"]["algorithm"] != "ngram":
            raise ConfigError(
                f"drafter.tree_breadth {breadth}: only the reference runtime's ngram drafter proposes trees "
                f"(runtime {cfg['runtime']['name']}, drafter.algorithm {cfg['drafter']['algorithm']})"
            )
        if breadth > 1:  # 1 is the chain, as absent: left out, so that engine is the chain's, id and all
            cfg["drafter"]["tree_breadth"] = breadth
    corpus = _corpus(cfg["drafter"], cfg["runtime"]["name"], runtime_options, launch_args)
    _fallback(cfg["drafter"], cfg["runtime"]["name"], corpus)
    if cfg["runtime"].get("flag_check", "absent") is None:  # undeclared: not part of any engine id
        del cfg["runtime"]["flag_check"]
    runtime = cfg["runtime"]["name"]
    cfg["mechanisms"] = [
        {"name": m["name"], "overlay": (m.get("overlay_cuts") or {}).get(runtime, m.get("overlay"))} for m in mechanisms
    ]
    cfg["runtime_options"] = runtime_options
    cfg["kernels"] = kernels
    cfg["runtime"]["launch_args"] = launch_args
    return cfg


# SGLang NGRAM's external corpus (sglang/srt/speculative/cpp_ngram/external_corpus.py): the path is the build's (the
# JSONL it writes into the tree, assemble/corpus.py), the budget the draft-tree nodes its suffix automaton may fill
CORPUS_PATH_FLAG = "speculative-ngram-external-corpus-path"
SAM_BUDGET_FLAG = "speculative-ngram-external-sam-budget"
CORPUS_MAX_TOKENS_FLAG = "speculative-ngram-external-corpus-max-tokens"
SGLANG_NGRAM_DRAFT_TOKENS = 12  # SGLang's --speculative-num-draft-tokens for NGRAM when unset (speculative_hook.py)


def _corpus(
    drafter: dict[str, Any], runtime: str, runtime_options: dict[str, Any], launch_args: dict[str, Any]
) -> bool:
    """Whether `drafter.recipe` names a corpus (recipe (d), docs/drafters.md): tokens that seed the reference runtime's
    shared n-gram cache, or SGLang NGRAM's external corpus; anywhere else it, or an external-corpus flag without it,
    is an error."""
    corpus = is_corpus(drafter)
    if runtime != "reference":
        _sglang_corpus(drafter, launch_args, corpus)
        return corpus
    if not corpus:
        return False
    shared = bool(runtime_options.get("shared_ngram_cache"))
    if drafter["algorithm"] != "ngram" or not shared:
        raise ConfigError(
            f"drafter.recipe {drafter['recipe']}: a corpus seeds the reference runtime's shared n-gram cache; it "
            f"needs drafter.algorithm ngram and runtime_options.shared_ngram_cache true (mechanism "
            f"shared-ngram-cache), not algorithm {drafter['algorithm']}, shared cache {shared}"
        )
    if drafter.get("tree_breadth") or drafter.get("fallback") is not None:
        raise ConfigError(
            f"drafter.recipe {drafter['recipe']}: a corpus seeds the n-gram chain drafter only "
            f"(tree_breadth {drafter.get('tree_breadth')}, fallback {drafter.get('fallback')})"
        )
    return True


def _sglang_corpus(drafter: dict[str, Any], launch_args: dict[str, Any], corpus: bool) -> None:
    """A corpus on SGLang is NGRAM's external corpus, with a SAM budget SGLang accepts (1 to num_draft_tokens - 1;
    0, its default, reserves no node for it: the corpus would do nothing). Its path is set by the build only."""
    if CORPUS_PATH_FLAG in launch_args:
        raise ConfigError(
            f"launch_args.{CORPUS_PATH_FLAG}: set by the build from drafter.recipe (a corpus drafter, written into the "
            "engine tree); name the corpus with drafter.recipe instead"
        )
    if not corpus:
        for flag in (SAM_BUDGET_FLAG, CORPUS_MAX_TOKENS_FLAG):
            if flag in launch_args:
                raise ConfigError(
                    f"launch_args.{flag} {launch_args[flag]} does nothing without an external corpus "
                    "(drafter.recipe: a corpus drafter, e.g. corpus)"
                )
        return
    if drafter["algorithm"] != "NGRAM":
        raise ConfigError(
            f"drafter.recipe {drafter['recipe']}: on SGLang a corpus is NGRAM's external corpus, not a drafter of "
            f"drafter.algorithm {drafter['algorithm']}"
        )
    budget = launch_args.get(SAM_BUDGET_FLAG)
    draft_tokens = drafter.get("num_draft_tokens") or SGLANG_NGRAM_DRAFT_TOKENS
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= draft_tokens - 1:
        shown = "unset (SGLang's default 0)" if budget is None else repr(budget)
        nothing = "; 0 reserves no draft node for it, so the corpus would do nothing" if budget in (0, None) else ""
        raise ConfigError(
            f"drafter.recipe {drafter['recipe']}: launch_args.{SAM_BUDGET_FLAG} is {shown}; SGLang takes 1 to "
            f"num_draft_tokens - 1 ({draft_tokens - 1}) with an external corpus{nothing}"
        )


def is_corpus(drafter: dict[str, Any]) -> bool:
    """Whether an effective config's drafter is a corpus drafter (recipe (d))."""
    return bool(drafter.get("recipe")) and _recipe_kind(drafter["recipe"]) == "corpus"


def _recipe_kind(name: str) -> str | None:
    """The `kind:` of conf/recipe/<name>.yaml (read here: config/ imports no other stage; `make draft` checks the
    whole recipe); None where there is no such file."""
    from omegaconf import DictConfig, OmegaConf

    from specpilot_build.locations import conf_dir

    path = conf_dir() / "recipe" / f"{name}.yaml"
    loaded = OmegaConf.load(path) if path.is_file() else None
    kind = loaded.get("kind") if isinstance(loaded, DictConfig) else None
    return None if kind is None else str(kind)


def _fallback(drafter: dict[str, Any], runtime: str, corpus: bool = False) -> None:
    """`drafter.fallback` (the hybrid drafter) where it does something, else an error; unset, both keys are left out."""
    fallback, k = drafter.pop("fallback", None), drafter.pop("fallback_num_draft_tokens", None)
    if fallback is None:
        if k is not None:
            raise ConfigError(f"drafter.fallback_num_draft_tokens {k} does nothing without drafter.fallback")
        if drafter.get("recipe") and drafter["algorithm"] in ("none", "ngram") and not corpus:
            raise ConfigError(
                f"drafter.recipe {drafter['recipe']} does nothing for drafter.algorithm {drafter['algorithm']} "
                "without drafter.fallback"
            )
        return
    if fallback != "eagle3":
        raise ConfigError(f"drafter.fallback is {fallback!r}; the only fallback is eagle3")
    if runtime != "reference" or drafter["algorithm"] != "ngram" or drafter.get("tree_breadth"):
        raise ConfigError(
            f"drafter.fallback eagle3: only the reference runtime's ngram chain drafter hands steps to a head "
            f"(runtime {runtime}, drafter.algorithm {drafter['algorithm']}, tree_breadth {drafter.get('tree_breadth')})"
        )
    if not drafter.get("recipe"):
        raise ConfigError("drafter.fallback eagle3 needs drafter.recipe, the EAGLE-3 head's recipe (e.g. eagle3-135m)")
    drafter["fallback"] = fallback
    if k is not None:
        drafter["fallback_num_draft_tokens"] = k


# Where overlays come from, in application order: later layers see (and may patch) earlier layers' output.
OVERLAY_SOURCES = ("runtime", "hardware", "model", "drafter", "batching", "mechanisms")


def overlays_in_order(cfg: dict[str, Any]) -> list[str]:
    """The overlays an effective config names, in the one application order (OVERLAY_SOURCES)."""
    names: list[str] = []
    for source in OVERLAY_SOURCES:
        node = cfg.get(source)
        if isinstance(node, dict):
            names += list(node.get("overlays") or [])
        elif isinstance(node, list):
            names += [m["overlay"] for m in node if m.get("overlay")]
    return names


def rule_applies(rule: dict[str, Any], cfg: dict[str, Any]) -> bool:
    """Every `when` key (dotted, into the config) has the value given, or one of the values of a list."""
    return all(
        lookup(cfg, key) in (value if isinstance(value, list) else [value])
        for key, value in (rule.get("when") or {}).items()
    )


def lookup(cfg: dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
