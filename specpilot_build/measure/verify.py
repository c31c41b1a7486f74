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
"""
from __future__ import annotations

import math
import time

from specpilot_build.run import client
from specpilot_build.run.serve import serve, stop
from specpilot_build.defaults import ORACLE_PORT
from specpilot_build.errors import SpecPilotError
from specpilot_build.store.engines import Engine, resolve_engine
from specpilot_build.measure.results import load_results, write_json

MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23, "fp8": 3}
LOGIT_SCALE = 32.0


def dtype_tolerance(*dtypes: str | None) -> float:
    bits = [MANTISSA_BITS.get(str(d).replace("torch.", ""), 7) for d in dtypes if d]
    return LOGIT_SCALE * 2.0 ** -min(bits or [7])


def verify(run: str, oracle: Engine | str, port: int = ORACLE_PORT, host: str = "127.0.0.1",
           tolerance: float | None = None, concurrency: int | None = None, progress: bool = True,
           console=None) -> dict:
    """Verify a bench run against an oracle engine; writes <run>.verify.json and returns the report."""
    path, data = load_results(run)
    oracle_engine = resolve_engine(oracle) if isinstance(oracle, str) else oracle
    if dict(oracle_engine.model_pin) != dict(data["target_pin"]):
        raise SpecPilotError(
            f"{path} was benched on target {_pin(data['target_pin'])}, oracle engine {oracle_engine.id[:12]} "
            f"serves {_pin(oracle_engine.model_pin)}: verify needs an oracle of the same target model")
    url = f"http://{host}:{port}"
    oracle_dtype = oracle_engine.config["model"].get("dtype")
    tolerance = dtype_tolerance(oracle_dtype, (data.get("model") or {}).get("dtype")) \
        if tolerance is None else tolerance
    concurrency = concurrency or int(oracle_engine.config["batching"]["concurrency"])
    with _oracle_server(oracle_engine, url, port):
        report = force_tokens(data, url, tolerance, concurrency, progress)
    report.update({"run": str(path), "checked_engine_id": data["engine_id"], "oracle_engine_id": oracle_engine.id,
                   "oracle_dtype": oracle_dtype, "bench_wall_s": data.get("wall_s")})
    if data.get("wall_s"):
        report["verify_to_bench_time"] = report["wall_s"] / data["wall_s"]
    out = path.with_name(path.name.removesuffix(".json") + ".verify.json")
    report["json"] = str(out)
    write_json(out, report)
    print_summary(report, console)
    return report


def force_tokens(data: dict, url: str, tolerance: float, concurrency: int, progress: bool = True) -> dict:
    """Token-force every request of a results dict through the server at url; the report without file names."""
    requests = [r for r in data["requests"] if r["output_ids"]]
    bodies = [forcing_body(r["prompt_ids"], r["output_ids"]) for r in requests]
    started = time.perf_counter()
    with client.progress_bar(progress, len(bodies), label="verify",
                             tokens_of=lambda index, answer: len(requests[index]["output_ids"])) as advance:
        done = client.post_all(url, bodies, concurrency, on_answer=advance)
    checks = [check_request(r, a.body, tolerance) for r, a in zip(requests, done.answers)]
    checks += [{"dataset": r["dataset"], "item_id": r["item_id"], "tokens": 0, "verified": 0, "near_ties": [],
                "first_mismatch": None, "mismatches_after": 0} for r in data["requests"] if not r["output_ids"]]
    totals = {}
    for c in checks:
        t = totals.setdefault(c["dataset"], {"requests": 0, "tokens": 0, "verified": 0, "near_ties": 0,
                                             "real_mismatches": 0})
        t["requests"] += 1
        t["tokens"] += c["tokens"]
        t["verified"] += c["verified"]
        t["near_ties"] += len(c["near_ties"])
        t["real_mismatches"] += c["first_mismatch"] is not None
    real = sum(t["real_mismatches"] for t in totals.values())
    return {"schema": "specpilot.verify/1", "verdict": "lossless" if real == 0 else "not lossless",
            "real_mismatches": real, "near_ties": sum(t["near_ties"] for t in totals.values()),
            "tokens": sum(t["tokens"] for t in totals.values()),
            "verified": sum(t["verified"] for t in totals.values()),
            "tolerance": tolerance, "method": __doc__.strip().split("\n\n")[2].replace("\n", " "),
            "concurrency": concurrency, "wall_s": time.perf_counter() - started, "totals": totals,
            "requests": checks}


def forcing_body(prompt_ids: list[int], output_ids: list[int]) -> dict:
    return {"input_ids": list(prompt_ids) + list(output_ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": len(prompt_ids) - 1, "top_logprobs_num": 2}


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
            f"{request['dataset']} item {request['item_id']}, expected {expected}: does it support token forcing?")
    near, first, after, verified = [], None, 0, 0
    for j, emitted_id in enumerate(emitted):
        candidates = sorted((c for c in tops[j + 1] or [] if c[0] is not None), key=lambda c: -c[0])
        if not candidates:
            raise SpecPilotError(f"oracle gave no top log-probs at {request['dataset']} item {request['item_id']} "
                                 f"position {j}")
        top_lp, top_id = candidates[0][0], candidates[0][1]
        if top_id == emitted_id:
            verified += first is None
            continue
        margin = top_lp - _emitted_logprob(emitted_id, candidates, token_lps, j + 1)
        finding = {"position": j, "emitted_id": emitted_id, "oracle_id": top_id,
                   "margin": margin if math.isfinite(margin) else None}
        if first is not None:
            after += 1
        elif margin <= tolerance:
            near.append(finding)
            verified += 1
        else:
            first = finding
    return {"dataset": request["dataset"], "item_id": request["item_id"], "tokens": len(emitted), "verified": verified,
            "near_ties": near, "first_mismatch": first, "mismatches_after": after}


def _emitted_logprob(emitted_id, candidates, token_lps, index) -> float:
    if isinstance(token_lps, list) and index < len(token_lps) and token_lps[index] \
            and token_lps[index][0] is not None and token_lps[index][1] == emitted_id:
        return token_lps[index][0]
    for lp, token_id, *_ in candidates:
        if token_id == emitted_id:
            return lp
    return -math.inf


def print_summary(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"verify {report['checked_engine_id'][:12]} against oracle "
                        f"{report['oracle_engine_id'][:12]} (tolerance {report['tolerance']:.3g})")
    for column in ("dataset", "requests", "tokens", "verified", "near ties", "real mismatches"):
        table.add_column(column, justify="left" if column == "dataset" else "right")
    for dataset, t in report["totals"].items():
        table.add_row(dataset, str(t["requests"]), str(t["tokens"]), str(t["verified"]), str(t["near_ties"]),
                      str(t["real_mismatches"]))
    console.print(table)
    for c in report["requests"]:
        if c["first_mismatch"]:
            m = c["first_mismatch"]
            console.print(f"real mismatch: {c['dataset']} item {c['item_id']} position {m['position']}: emitted "
                          f"{m['emitted_id']}, oracle {m['oracle_id']}, margin {m['margin']}")
    ratio = report.get("verify_to_bench_time")
    console.print(f"verdict: {report['verdict']} ({report['verified']}/{report['tokens']} tokens verified, "
                  f"{report['near_ties']} near ties; verify {report['wall_s']:.1f} s"
                  + (f" = {ratio:.2f}× the bench time)" if ratio else ")"))


def exit_status(report: dict) -> int:
    return 0 if report["real_mismatches"] == 0 else 1


class _oracle_server:
    """Use a server already serving the oracle on the port, else serve it for the duration and stop it."""

    def __init__(self, engine, url: str, port: int):
        self.engine, self.url, self.port, self.started = engine, url, port, False

    def __enter__(self):
        try:
            served = client.served_engine_id(client.server_info(self.url, timeout=3))
        except SpecPilotError:
            served = None
            serve(self.engine.id, self.port)
            self.started = True
            served = client.served_engine_id(client.server_info(self.url))
        if served != self.engine.id:
            raise SpecPilotError(f"port {self.port} serves engine {served or '(unnamed)'}, not the oracle "
                                 f"{self.engine.id[:12]}; stop it or pass another PORT")
        return self

    def __exit__(self, *exc):
        if self.started:
            stop(self.port)
        return False


def _pin(pin: dict) -> str:
    return f"{pin.get('repo')}@{str(pin.get('revision'))[:12]}"
