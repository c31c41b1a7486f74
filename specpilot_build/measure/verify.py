"""Verify: token forcing. Every emitted token of a bench run must be the target's own greedy choice.

Per bench request, one prefill-style /generate request to an oracle engine of the same target (default: the
setting's `ar` arm): input_ids = prompt + emitted ids, max_new_tokens 0, return_logprob, logprob_start_len at
the last prompt position, top_logprobs_num 2. At each emitted position the oracle's top-1 id must equal the
emitted id. The same requests work against SGLang servers and the reference runtime.

Classification of a position whose emitted id is not the oracle's top-1: margin = top-1 log-prob minus the
emitted token's log-prob (log-softmax shifts every logit equally, so this is the logit gap). A margin within
the tolerance is a *near tie*, anything else a *real mismatch*. The default tolerance is one rounding step
(ulp) of the coarser of the two engines' dtypes at a logit magnitude of 32, i.e. 32 * 2^-mantissa_bits:
bfloat16 2^-2 = 0.25, float16 2^-5, float32 2^-18 (about 3.8e-6); `tolerance=` overrides it. Positions after a
request's first real mismatch are reported but not counted as verified.

Before forcing, the record itself is checked field by field (`check_record`): the run's engine id is the one
its server reported and the digest of the recorded manifest; the oracle's recorded id is the digest of its
recorded manifest; every prompt digest is recomputed from `prompt_ids`, and `prompt_ids` from re-rendering the
pinned dataset item with the engine's tokenizer and chat template; `completion_tokens` is the number of
`output_ids`, which stay within the request's budget and below the context length; `finish_reason` agrees with
the ids (length: the budget is used up; stop: the last id is an end-of-sequence token, and none comes earlier);
`output_text` is the tokenizer's decoding of `output_ids`. Each failure names the request and the field or
position. A request the oracle cannot score (its ids reach the context limit, or the oracle refuses it) is a
failure of that request; the others are still forced. The verdict is `lossless` only when no field fails and
no emitted token is a real mismatch; it is written with an in-toto statement binding it to the files (attest.py).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from specpilot_build import __version__
from specpilot_build.defaults import ORACLE_PORT
from specpilot_build.errors import SpecPilotError
from specpilot_build.measure import attest
from specpilot_build.measure.prompts import prompt_digest, prompts_digest
from specpilot_build.measure.results import load_results, require_current, write_json
from specpilot_build.serve import client
from specpilot_build.serve.process import serve, stop
from specpilot_build.store.engines import Engine, resolve_engine
from specpilot_build.store.manifest import engine_id as engine_id_of

MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23, "fp8": 3}
LOGIT_SCALE = 32.0


def dtype_tolerance(*dtypes: str | None) -> float:
    bits = [MANTISSA_BITS.get(str(d).replace("torch.", ""), 7) for d in dtypes if d]
    return LOGIT_SCALE * 2.0 ** -min(bits or [7])


def verify(
    run: str,
    oracle: Engine | str,
    port: int = ORACLE_PORT,
    host: str = "127.0.0.1",
    tolerance: float | None = None,
    concurrency: int | None = None,
    progress: bool = True,
    console=None,
    renderer=None,
) -> dict:
    """Verify a bench run against an oracle engine; writes <run>.verify.json and its in-toto statement
    <run>.verify.intoto.json, and returns the report. `renderer`: a PromptRenderer of the run's target (default:
    loaded from the model directory of the run's recorded engine manifest)."""
    path, data = load_results(run)
    require_current(path, data)
    oracle_engine = resolve_engine(oracle) if isinstance(oracle, str) else oracle
    if dict(oracle_engine.model_pin) != dict(data["target_pin"]):
        raise SpecPilotError(
            f"{path} was benched on target {_pin(data['target_pin'])}, oracle engine {oracle_engine.id[:12]} "
            f"serves {_pin(oracle_engine.model_pin)}: verify needs an oracle of the same target model"
        )
    url = f"http://{host}:{port}"
    oracle_dtype = oracle_engine.config["model"].get("dtype")
    tolerance = (
        dtype_tolerance(oracle_dtype, (data.get("model") or {}).get("dtype")) if tolerance is None else tolerance
    )
    concurrency = concurrency or int(oracle_engine.config["batching"]["concurrency"])
    renderer = renderer or record_renderer(data)
    failures = check_record(data, renderer)
    with _oracle_server(oracle_engine, url, port) as server:
        context = _min_known(data.get("context_length"), server.info.get("context_length"))
        report = force_tokens(data, url, tolerance, concurrency, progress, context=context)
    report["failures"] = failures + report["failures"]
    report["verdict"] = _verdict(report)
    report.update(
        {
            "run": str(path),
            "checked_engine_id": data["engine_id"],
            "oracle_engine_id": oracle_engine.id,
            "recorded_oracle_engine_id": data.get("oracle_engine_id"),
            "oracle_is_recorded": oracle_engine.id == data.get("oracle_engine_id"),
            "oracle_dtype": oracle_dtype,
            "bench_wall_s": data.get("wall_s"),
        }
    )
    if data.get("wall_s"):
        report["verify_to_bench_time"] = report["wall_s"] / data["wall_s"]
    out = path.with_name(path.name.removesuffix(".json") + ".verify.json")
    report["json"] = str(out)
    report["statement"] = str(attest.statement_path(out))
    write_json(out, report)
    attest.write_statement(
        out, [path, out], attest.PREDICATE_VERIFY, verify_predicate(report, data, oracle_engine, server.info)
    )
    print_summary(report, console)
    return report


def verify_predicate(report: dict, data: dict, oracle: Engine, oracle_info: dict) -> dict:
    return {
        "verdict": report["verdict"],
        "engine_id": data["engine_id"],
        "arm": data.get("arm"),
        "setting": data.get("setting"),
        "manifest_digest": data.get("manifest_digest"),
        "oracle_engine_id": oracle.id,
        "recorded_oracle_engine_id": data.get("oracle_engine_id"),
        "target_pin": data.get("target_pin"),
        "hardware": {"run": data.get("hardware"), "oracle": oracle.config.get("hardware")},
        "versions": {
            "run": data.get("versions"),
            "run_server": data.get("served"),
            "oracle_server": {"runtime": oracle_info.get("runtime"), "version": oracle_info.get("version")},
            "specpilot": __version__,
            "python": sys.version.split()[0],
        },
        "tokens": report["tokens"],
        "verified": report["verified"],
        "near_ties": report["near_ties"],
        "real_mismatches": report["real_mismatches"],
        "failures": len(report["failures"]),
        "tolerance": report["tolerance"],
    }


def _verdict(report: dict) -> str:
    if report["real_mismatches"]:
        return "not lossless"
    return "not verified" if report["failures"] else "lossless"


def _min_known(*values):
    known = [v for v in values if isinstance(v, int) and v > 0]
    return min(known) if known else None


def force_tokens(
    data: dict, url: str, tolerance: float, concurrency: int, progress: bool = True, context: int | None = None
) -> dict:
    """Token-force every request of a results dict through the server at url; the report without file names.

    A request whose ids reach `context` (the oracle could not take them) is not sent; one the oracle refuses
    or answers without logprobs is a failure of that request alone."""
    failures, unforced, requests = [], [], []
    for r in data["requests"]:
        length = len(r["prompt_ids"]) + len(r["output_ids"])
        if not r["output_ids"]:
            unforced.append(r)
        elif context is not None and length >= context:
            position = max(0, context - 1 - len(r["prompt_ids"]))
            failures.append(
                _failure(
                    r,
                    "output_ids",
                    f"prompt + output = {length} tokens reach the context of "
                    f"{context} (the first token at or past the limit is "
                    f"position {position}): not forced",
                    position,
                )
            )
            unforced.append(r)
        else:
            requests.append(r)
    bodies = [forcing_body(r["prompt_ids"], r["output_ids"]) for r in requests]
    started = time.perf_counter()
    with client.progress_bar(
        progress, len(bodies), label="verify", tokens_of=lambda index, answer: len(requests[index]["output_ids"])
    ) as advance:
        answers = _post_each(url, bodies, concurrency, advance)
    checks = []
    for r, answer in zip(requests, answers):
        try:
            if isinstance(answer, str):
                raise SpecPilotError(answer)
            checks.append(check_request(r, answer, tolerance))
        except SpecPilotError as exc:
            failures.append(_failure(r, "oracle", f"not forced: {exc}"))
            unforced.append(r)
    checks += [
        {
            "dataset": r["dataset"],
            "item_id": r["item_id"],
            "tokens": len(r["output_ids"]),
            "verified": 0,
            "near_ties": [],
            "first_mismatch": None,
            "mismatches_after": 0,
        }
        for r in unforced
    ]
    totals: dict[str, dict[str, int]] = {}
    for c in checks:
        t = totals.setdefault(
            c["dataset"], {"requests": 0, "tokens": 0, "verified": 0, "near_ties": 0, "real_mismatches": 0}
        )
        t["requests"] += 1
        t["tokens"] += c["tokens"]
        t["verified"] += c["verified"]
        t["near_ties"] += len(c["near_ties"])
        t["real_mismatches"] += c["first_mismatch"] is not None
    real = sum(t["real_mismatches"] for t in totals.values())
    report = {
        "schema": "specpilot.verify/2",
        "verdict": None,
        "real_mismatches": real,
        "near_ties": sum(t["near_ties"] for t in totals.values()),
        "tokens": sum(t["tokens"] for t in totals.values()),
        "verified": sum(t["verified"] for t in totals.values()),
        "tolerance": tolerance,
        "method": __doc__.strip().split("\n\n")[2].replace("\n", " "),
        "concurrency": concurrency,
        "wall_s": time.perf_counter() - started,
        "totals": totals,
        "requests": checks,
        "failures": failures,
    }
    report["verdict"] = _verdict(report)
    return report


def _post_each(url: str, bodies: list[dict], concurrency: int, advance) -> list:
    """The oracle's answers in order; a request it refuses becomes that request's error message (a string)."""
    try:
        return [a.body for a in client.post_all(url, bodies, concurrency, on_answer=advance).answers]
    except SpecPilotError:
        pass  # one request was refused: send them one at a time to learn which
    answers: list[dict | str] = []
    for body in bodies:
        try:
            answers.append(client.post_all(url, [body], 1).answers[0].body)
        except SpecPilotError as exc:
            answers.append(str(exc))
    return answers


def _failure(request: dict | None, field: str, message: str, position: int | None = None) -> dict:
    return {
        "dataset": request and request.get("dataset"),
        "item_id": request and request.get("item_id"),
        "field": field,
        "position": position,
        "message": message,
    }


def _where(failure: dict) -> str:
    if failure["dataset"] is None:
        return "run"
    return f"{failure['dataset']} item {failure['item_id']}"


# --- the record, field by field -------------------------------------------------------------------------------


def record_renderer(data: dict):
    """The PromptRenderer of the run's engine: the tokenizer and chat template of its recorded manifest."""
    from specpilot_build.measure.prompts import PromptRenderer
    from specpilot_build.models.checkpoints import model_dirs

    manifest = data["engine_manifest"]
    config = manifest["config"]
    model_dir = model_dirs({"model": manifest["inputs"]["checkpoints"]["model"]}, config)["model"]
    return PromptRenderer(model_dir, config["model"].get("chat_template"))


def eos_ids(renderer) -> tuple[set[int], set[int]]:
    """(ids a server stops on: generation_config's and the tokenizer's EOS; those plus config.json's)."""
    tokenizer, model_dir = renderer.tokenizer, Path(renderer.tokenizer.name_or_path)
    stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    extra: set[int] = set()
    for name, into in (("generation_config.json", stop), ("config.json", extra)):
        try:
            value = json.loads((model_dir / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        into |= set(value if isinstance(value, list) else [] if value is None else [value])
    return stop, stop | extra


def check_record(data: dict, renderer) -> list[dict]:
    """Every field of a results dict that can be recomputed, recomputed; one failure per field that differs."""
    failures = _check_identity(data)
    context = data.get("context_length")
    model_config = (data.get("engine_manifest") or {}).get("config", {}).get("model", {})
    expected_context = model_config.get("context_length") or renderer.context_length
    if context != expected_context:
        failures.append(
            _failure(None, "context_length", f"recorded {context}, the engine's model has {expected_context}")
        )
        context = expected_context
    items = _rendered_items(data, renderer, failures)
    stop, any_eos = eos_ids(renderer)
    run_budget = data.get("max_new_tokens")
    runtime = (data.get("engine_manifest") or {}).get("config", {}).get("runtime", {}).get("name", "")
    for r in data["requests"]:
        failures += check_request_fields(
            r,
            renderer,
            items.get((r["dataset"], r["item_id"])),
            run_budget,
            context,
            stop,
            any_eos,
            detokenizer_context(runtime),
        )
    recorded = data.get("prompts_digest")
    recomputed = prompts_digest(
        [
            {"dataset": r["dataset"], "item_id": r["item_id"], "prompt_digest": prompt_digest(r["prompt_ids"])}
            for r in data["requests"]
        ]
    )
    if recorded != recomputed:
        failures.append(
            _failure(
                None,
                "prompts_digest",
                f"recorded {str(recorded)[:16]}…, recomputed from the requests' prompt_ids {recomputed[:16]}…",
            )
        )
    return failures


def _check_identity(data: dict) -> list[dict]:
    failures = []
    engine_id = data.get("engine_id")
    served = client.served_engine_id(data.get("server_info") or {})
    if served != engine_id:
        failures.append(
            _failure(
                None, "engine_id", f"the run records engine {engine_id}, its server reported {served} in server_info"
            )
        )
    if (data.get("served") or {}).get("engine_id") != served:
        failures.append(
            _failure(
                None, "served.engine_id", f"{(data.get('served') or {}).get('engine_id')} is not server_info's {served}"
            )
        )
    if data.get("manifest_digest") != f"blake3:{engine_id}":
        failures.append(
            _failure(None, "manifest_digest", f"{data.get('manifest_digest')} is not the engine id {engine_id}")
        )
    manifest = data.get("engine_manifest")
    if not isinstance(manifest, dict) or engine_id_of(manifest) != engine_id:
        failures.append(
            _failure(None, "engine_manifest", f"the recorded manifest does not hash to the engine id {engine_id}")
        )
    else:
        pin = manifest["inputs"]["checkpoints"]["model"]
        for field, want in (
            ("arm", manifest.get("arm")),
            ("setting", manifest.get("setting")),
            ("target_pin", {"repo": pin["repo"], "revision": pin["revision"]}),
        ):
            if data.get(field) != want:
                failures.append(_failure(None, field, f"recorded {data.get(field)}, the engine's manifest says {want}"))
    oracle = data.get("oracle") or {}
    oracle_id = data.get("oracle_engine_id")
    if (
        not oracle_id
        or oracle.get("engine_id") != oracle_id
        or oracle.get("manifest_digest") != f"blake3:{oracle_id}"
        or not isinstance(oracle.get("manifest"), dict)
        or engine_id_of(oracle["manifest"]) != oracle_id
    ):
        failures.append(
            _failure(None, "oracle_engine_id", f"{oracle_id} is not the digest of the recorded oracle manifest")
        )
    return failures


def _rendered_items(data: dict, renderer, failures: list) -> dict:
    """(dataset, item id) -> the prompt ids re-rendered from the pinned dataset item."""
    from specpilot_build.measure.datasets import all_items, dataset_pin

    rendered = {}
    for dataset in sorted({r["dataset"] for r in data["requests"]}):
        recorded = ((data.get("datasets") or {}).get(dataset) or {}).get("sha256")
        pinned = dataset_pin(dataset)["sha256"]
        if recorded != pinned:
            failures.append(_failure(None, f"datasets.{dataset}.sha256", f"recorded {recorded}, pinned {pinned}"))
        wanted = {r["item_id"] for r in data["requests"] if r["dataset"] == dataset}
        for item in all_items(dataset):
            if item.id in wanted:
                rendered[(dataset, item.id)] = renderer.render(item.prompt)
    return rendered


def detokenizer_context(runtime: str) -> int:
    """How many prompt ids a runtime's output_text is decoded after. SGLang's detokenizer decodes the output
    incrementally behind the last 5 prompt ids (INIT_INCREMENTAL_DETOKENIZATION_OFFSET in managers/schedule_batch.py,
    0.5.17 and 0.5.23), so a leading space that a SentencePiece tokenizer drops at the start of a text stays;
    the reference runtime decodes the output ids alone."""
    return 5 if runtime.split("-", 1)[0] == "sglang" else 0


def output_text(tokenizer, prompt: list[int], output: list[int], context: int) -> str:
    """The text a server reports for `output` after `prompt`, decoded behind its last `context` prompt ids."""
    surround = prompt[len(prompt) - context :] if context else []
    if not surround:
        return tokenizer.decode(output, skip_special_tokens=True)
    head = tokenizer.decode(surround, skip_special_tokens=True)
    return tokenizer.decode(surround + output, skip_special_tokens=True)[len(head) :]


def check_request_fields(
    r: dict,
    renderer,
    rendered: list[int] | None,
    run_budget: int | None,
    context: int | None,
    stop: set[int],
    any_eos: set[int],
    text_context: int = 0,
) -> list[dict]:
    """The fields of one request that can be recomputed from its ids, the dataset, the budget and the context;
    output_text as the runtime decodes it (`text_context`: detokenizer_context)."""
    out = []
    prompt, output = list(r.get("prompt_ids") or []), list(r.get("output_ids") or [])
    if r.get("prompt_digest") != prompt_digest(prompt):
        out.append(
            _failure(
                r,
                "prompt_digest",
                f"recorded {str(r.get('prompt_digest'))[:16]}…, sha256 of prompt_ids is {prompt_digest(prompt)[:16]}…",
            )
        )
    if rendered is None:
        out.append(_failure(r, "item_id", "no such item in the pinned dataset"))
    elif rendered != prompt:
        at = _first_difference(rendered, prompt)
        out.append(
            _failure(
                r,
                "prompt_ids",
                f"differ from the dataset item rendered with the engine's tokenizer "
                f"and chat template at prompt position {at}",
                at,
            )
        )
    if r.get("prompt_tokens") is not None and r["prompt_tokens"] != len(prompt):
        out.append(_failure(r, "prompt_tokens", f"recorded {r['prompt_tokens']}, prompt_ids hold {len(prompt)}"))
    budget = r.get("max_new_tokens")
    expected_budget = (
        run_budget if context is None or run_budget is None else min(run_budget, context - 1 - len(prompt))
    )
    if budget != expected_budget:
        out.append(
            _failure(
                r,
                "max_new_tokens",
                f"recorded budget {budget}, the run's {run_budget} cut to the context gives {expected_budget}",
            )
        )
    budget = expected_budget if isinstance(expected_budget, int) else budget
    if r.get("completion_tokens") != len(output):
        out.append(
            _failure(
                r,
                "completion_tokens",
                f"recorded {r.get('completion_tokens')}, output_ids hold {len(output)}",
                min(len(output), r.get("completion_tokens") or 0),
            )
        )
    if isinstance(budget, int) and len(output) > budget:
        out.append(
            _failure(
                r,
                "output_ids",
                f"{len(output)} tokens exceed the budget of {budget}: position "
                f"{budget} onwards cannot have been generated",
                budget,
            )
        )
    if context is not None and len(prompt) + len(output) >= context:
        at = max(0, context - len(prompt) - 1)
        out.append(_failure(r, "output_ids", f"prompt + output reach the context of {context} at position {at}", at))
    early = next((i for i, t in enumerate(output[:-1]) if t in stop), None)
    if early is not None:
        out.append(
            _failure(
                r,
                "output_ids",
                f"end-of-sequence id {output[early]} at position {early} is followed by more tokens",
                early,
            )
        )
    reason = r.get("finish_reason")
    if reason == "length":
        if len(output) != budget:
            out.append(
                _failure(
                    r, "finish_reason", f"'length' but {len(output)} output ids for a budget of {budget}", len(output)
                )
            )
    elif reason == "stop":
        if not output or output[-1] not in any_eos:
            out.append(
                _failure(
                    r,
                    "finish_reason",
                    "'stop' but the last output id is not an end-of-sequence id",
                    len(output) - 1 if output else 0,
                )
            )
    else:
        out.append(_failure(r, "finish_reason", f"{reason!r}: neither 'length' nor 'stop'"))
    text = output_text(renderer.tokenizer, prompt, output, text_context)
    if r.get("output_text") != text:
        at = _first_difference(text, r.get("output_text") or "")
        out.append(
            _failure(r, "output_text", f"is not the decoding of output_ids (first difference at character {at})", at)
        )
    return out


def _first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def forcing_body(prompt_ids: list[int], output_ids: list[int]) -> dict:
    return {
        "input_ids": list(prompt_ids) + list(output_ids),
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": len(prompt_ids) - 1,
        "top_logprobs_num": 2,
    }


def check_request(request: dict, answer: dict, tolerance: float) -> dict:
    """Compare each emitted id with the oracle's top-1 at its position."""
    prompt, emitted = request["prompt_ids"], request["output_ids"]
    meta = answer.get("meta_info", {})
    tops, token_lps = meta.get("input_top_logprobs"), meta.get("input_token_logprobs")
    start = len(prompt) - 1
    expected = len(prompt) + len(emitted) - start
    if not isinstance(tops, list) or len(tops) != expected:
        raise SpecPilotError(
            f"oracle answered {len(tops) if isinstance(tops, list) else 'no'} input_top_logprobs entries for "
            f"{request['dataset']} item {request['item_id']}, expected {expected}: does it support token forcing?"
        )
    near, first, after, verified = [], None, 0, 0
    for j, emitted_id in enumerate(emitted):
        candidates = sorted((c for c in tops[j + 1] or [] if c[0] is not None), key=lambda c: -c[0])
        if not candidates:
            raise SpecPilotError(
                f"oracle gave no top log-probs at {request['dataset']} item {request['item_id']} position {j}"
            )
        top_lp, top_id = candidates[0][0], candidates[0][1]
        if top_id == emitted_id:
            verified += first is None
            continue
        margin = top_lp - _emitted_logprob(emitted_id, candidates, token_lps, j + 1)
        finding = {
            "position": j,
            "emitted_id": emitted_id,
            "oracle_id": top_id,
            "margin": margin if math.isfinite(margin) else None,
        }
        if first is not None:
            after += 1
        elif margin <= tolerance:
            near.append(finding)
            verified += 1
        else:
            first = finding
    return {
        "dataset": request["dataset"],
        "item_id": request["item_id"],
        "tokens": len(emitted),
        "verified": verified,
        "near_ties": near,
        "first_mismatch": first,
        "mismatches_after": after,
    }


def _emitted_logprob(emitted_id, candidates, token_lps, index) -> float:
    if (
        isinstance(token_lps, list)
        and index < len(token_lps)
        and token_lps[index]
        and token_lps[index][0] is not None
        and token_lps[index][1] == emitted_id
    ):
        return token_lps[index][0]
    for lp, token_id, *_ in candidates:
        if token_id == emitted_id:
            return lp
    return -math.inf


def print_summary(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(
        title=f"verify {report['checked_engine_id'][:12]} against oracle "
        f"{report['oracle_engine_id'][:12]} (tolerance {report['tolerance']:.3g})"
    )
    for column in ("dataset", "requests", "tokens", "verified", "near ties", "real mismatches"):
        table.add_column(column, justify="left" if column == "dataset" else "right")
    for dataset, t in report["totals"].items():
        table.add_row(
            dataset,
            str(t["requests"]),
            str(t["tokens"]),
            str(t["verified"]),
            str(t["near_ties"]),
            str(t["real_mismatches"]),
        )
    console.print(table)
    for f in report.get("failures", []):
        position = f" position {f['position']}" if f.get("position") is not None else ""
        console.print(f"failed: {_where(f)}: {f['field']}{position}: {f['message']}", markup=False, soft_wrap=True)
    for c in report["requests"]:
        if c["first_mismatch"]:
            m = c["first_mismatch"]
            console.print(
                f"real mismatch: {c['dataset']} item {c['item_id']} position {m['position']}: emitted "
                f"{m['emitted_id']}, oracle {m['oracle_id']}, margin {m['margin']}",
                soft_wrap=True,
            )
    ratio = report.get("verify_to_bench_time")
    console.print(
        f"verdict: {report['verdict']} ({report['verified']}/{report['tokens']} tokens verified, "
        f"{report['near_ties']} near ties, {len(report.get('failures', []))} failed fields; verify "
        f"{report['wall_s']:.1f} s" + (f" = {ratio:.2f}× the bench time)" if ratio else ")")
    )
    if not report.get("oracle_is_recorded", True):
        console.print(
            f"note: oracle {report['oracle_engine_id'][:12]} is not the recorded oracle "
            f"{str(report.get('recorded_oracle_engine_id'))[:12]}"
        )
    if report.get("statement"):
        console.print(f"wrote {report['json']} and {report['statement']}", markup=False, soft_wrap=True)


def exit_status(report: dict) -> int:
    return 0 if report["verdict"] == "lossless" else 1


class _oracle_server:
    """Use a server already serving the oracle on the port, else serve it for the duration and stop it."""

    def __init__(self, engine, url: str, port: int):
        self.engine, self.url, self.port, self.started = engine, url, port, False
        self.info: dict[str, Any] = {}

    def __enter__(self):
        try:
            self.info = client.server_info(self.url, timeout=3)
        except SpecPilotError:
            serve(self.engine.id, self.port)
            self.started = True
            self.info = client.server_info(self.url)
        served = client.served_engine_id(self.info)
        if served != self.engine.id:
            raise SpecPilotError(
                f"port {self.port} serves engine {served or '(unnamed)'}, not the oracle "
                f"{self.engine.id[:12]}; stop it or pass another PORT"
            )
        return self

    def __exit__(self, *exc):
        if self.started:
            stop(self.port)
        return False


def _pin(pin: dict) -> str:
    return f"{pin.get('repo')}@{str(pin.get('revision'))[:12]}"
