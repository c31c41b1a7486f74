"""Grade a bench run: `specpilot score RUN` reads a results JSON and writes <run>.score.json beside it.

- gsm8k: the completion's final number (last \\boxed{}, else a '####' line, else "the answer is", else the
  last number in the text) compared numerically with the reference's '#### N'.
- math500: the completion's answer and the reference answer parsed and compared by math-verify, in a
  separate worker process (its timeouts use SIGALRM, which needs a main thread we may not own).
- humaneval: the candidate program is prompt + code; the tests are the prompt (its helpers), the
  problem's tests and check(entry_point).
- mbpp: the candidate program is the test imports + code + the problem's setup code; the tests are the
  imports, the setup code and the asserts, calling every name the asserts use and do not define. A setup
  that needs the candidate's own definitions (task 367 builds trees of the answer's Node) runs on the
  candidate's side only, and the asserts get what it built as opaque handles (arguments, never values).
  Code is the fenced block (```python ... ```) that defines the function under test, else all fenced
  blocks, else the completion as is (an unterminated fence counts to the end: truncated answers).
  Both run with sandbox.run_tested: the candidate in one sandbox, the tests in another that reaches the
  candidate's functions only through a pipe and decides the verdict (its exit status) without ever running
  candidate code — no marker, nothing in the candidate's reach to copy (see sandbox.py for the argument).
- mt-bench: counted, not auto-scored.
Truncated answers (finish reason "length", or as many tokens as the run allowed) are counted per dataset;
they are graded like the others.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
import signal
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

from specpilot_build.errors import SpecPilotError
from specpilot_build.measure import sandbox
from specpilot_build.measure.results import load_results, write_json

SCHEMA = "specpilot.score/1"
AUTO_SCORED = ("gsm8k", "math500", "humaneval", "mbpp")


def score_run(results_path: str | Path, workers: int | None = None, limits: sandbox.Limits = sandbox.Limits()) -> dict:
    """Grade every request of a results JSON; write and return the score record."""
    path, run = load_results(results_path)
    requests = run.get("requests") or []
    for index, request in enumerate(requests):
        missing = [key for key in ("dataset", "item_id") if key not in request]
        if missing:
            raise SpecPilotError(f"{path}: requests[{index}] lacks {', '.join(missing)}")
    records = _reference_records({request["dataset"] for request in requests})
    graded: list[dict | None] = [None] * len(requests)

    by_dataset: dict[str, list[int]] = {}
    for index, request in enumerate(requests):
        by_dataset.setdefault(request["dataset"], []).append(index)

    for dataset, indices in by_dataset.items():
        rows = [_record_for(records, dataset, requests[i]["item_id"], path) for i in indices]
        outputs = [requests[i].get("output_text") or "" for i in indices]
        for i, result in zip(indices, grade(dataset, outputs, rows, limits, workers)):
            graded[i] = {
                "dataset": dataset,
                "item_id": requests[i]["item_id"],
                "truncated": is_truncated(requests[i], run.get("max_new_tokens")),
                **result,
            }

    score = {
        "schema": SCHEMA,
        "results": path.name,
        **{key: run.get(key) for key in ("name", "engine_id", "setting", "arm", "max_new_tokens")},
        "sandbox": sandbox.isolation().describe() if {"humaneval", "mbpp"} & by_dataset.keys() else None,
        "datasets": {
            dataset: _summary(dataset, [g for i in indices if (g := graded[i]) is not None])
            for dataset, indices in sorted(by_dataset.items())
        },
        "items": graded,
    }
    out = score_path(path)
    write_json(out, score)
    return {**score, "path": str(out)}


def grade(
    dataset: str,
    outputs: list[str],
    records: list[dict],
    limits: sandbox.Limits = sandbox.Limits(),
    workers: int | None = None,
) -> list[dict]:
    """One {"correct": bool | None, ...} per completion of one dataset (None: not auto-scored)."""
    if dataset == "gsm8k":
        return [grade_gsm8k(text, record) for text, record in zip(outputs, records)]
    if dataset == "math500":
        return grade_math500(outputs, [record["answer"] for record in records])
    if dataset in ("humaneval", "mbpp"):
        build = humaneval_task if dataset == "humaneval" else mbpp_task
        # The verdict is the exit status of a tests process that never runs candidate code (sandbox.py):
        # an answer that exits early, prints anything or fakes equality does not pass.
        outcomes = sandbox.run_many([build(text, record) for text, record in zip(outputs, records)], limits, workers)
        return [{"correct": o.passed, "detail": _failure_detail(o)} for o in outcomes]
    return [{"correct": None} for _ in outputs]


def score_path(results_path: Path) -> Path:
    name = results_path.name.removesuffix(".json")
    return results_path.with_name(f"{name}.score.json")


def is_truncated(request: dict, run_max_new_tokens: int | None) -> bool:
    """Stopped by the token budget: finish reason "length", or as many tokens as the request allowed."""
    finish = request.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind == "length":
        return True
    budget = request.get("max_new_tokens") or run_max_new_tokens
    tokens = request.get("completion_tokens")
    return bool(budget) and tokens is not None and tokens >= budget


def _summary(dataset: str, graded: list[dict]) -> dict:
    scored = dataset in AUTO_SCORED
    correct = sum(1 for g in graded if g["correct"]) if scored else None
    return {
        "n": len(graded),
        "scored": scored,
        "correct": correct,
        "accuracy": correct / len(graded) if correct is not None and graded else None,
        "truncated": sum(1 for g in graded if g["truncated"]),
    }


# --- gsm8k -------------------------------------------------------------------------------------------

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+"


def grade_gsm8k(completion: str, record: dict) -> dict:
    reference = gsm8k_reference(record["answer"])
    predicted = extract_final_number(completion)
    return {
        "correct": predicted is not None and predicted == reference,
        "predicted": None if predicted is None else str(predicted),
        "reference": str(reference),
    }


def gsm8k_reference(answer: str) -> Fraction:
    """The number after '####' in a GSM8K reference answer."""
    value = _to_number(answer.split("####")[-1])
    if value is None:
        raise SpecPilotError(f"gsm8k reference answer has no number after '####': {answer[-80:]!r}")
    return value


def extract_final_number(text: str) -> Fraction | None:
    """The final numeric answer of a completion: last \\boxed{}, '####' line, 'the answer is', last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        value = _to_number(boxed)
        if value is not None:
            return value
    for pattern in (r"####\s*([^\n]*)", r"answer is[:\s]*([^\n]*)"):
        matches = re.findall(pattern, text, flags=re.IGNORECASE)
        if matches:
            value = _first_number(matches[-1])
            if value is not None:
                return value
    numbers = re.findall(_NUMBER, text)
    return _to_number(numbers[-1]) if numbers else None


def _first_number(text: str) -> Fraction | None:
    match = re.search(_NUMBER, text)
    return _to_number(match.group()) if match else None


def _to_number(text: str) -> Fraction | None:
    cleaned = re.sub(r"\\text\{[^}]*\}|\\[,!; %$]|[\s$,%]", "", text)
    fraction = re.search(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", cleaned)
    if fraction and int(fraction.group(2)):
        return Fraction(int(fraction.group(1)), int(fraction.group(2)))
    match = re.search(r"-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+", cleaned)
    try:
        return Fraction(match.group()) if match else None
    except (ValueError, ZeroDivisionError):
        return None


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} (or \\fbox{...}), braces balanced."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for position in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[start:position]
    return None


# --- math500 -----------------------------------------------------------------------------------------


def grade_math500(completions: list[str], answers: list[str], timeout_s: float = 60.0) -> list[dict]:
    """math-verify equivalence of each completion's answer with the reference answer.

    Runs in a child interpreter: math-verify guards sympy with signal.alarm, which works only in a main
    thread, and a pathological expression must not hang the caller. If the child does not finish within
    timeout_s + 5 s per item it is killed and the items count as wrong."""
    if not completions:
        return []
    worker = "from specpilot_build.measure.score import _math_verify_stdio; _math_verify_stdio()"
    try:
        done = subprocess.run(
            [sys.executable, "-c", worker],
            capture_output=True,
            text=True,
            input=json.dumps({"completions": completions, "answers": answers}),
            timeout=timeout_s + 5 * len(completions),
        )
    except subprocess.TimeoutExpired:
        return [{"correct": False, "detail": "math-verify did not finish"} for _ in completions]
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise SpecPilotError(f"math-verify worker failed: {tail[0]}")
    return json.loads(done.stdout)


def _math_verify_stdio() -> None:
    request = json.load(sys.stdin)
    json.dump(_math_verify_batch(request["completions"], request["answers"]), sys.stdout)


def _math_verify_batch(completions: list[str], answers: list[str]) -> list[dict]:
    from math_verify import parse, verify

    results = []
    for completion, answer in zip(completions, answers):
        gold = parse(f"${answer}$")
        predicted = parse(completion)
        correct = bool(gold) and bool(predicted) and verify(gold, predicted)
        results.append(
            {"correct": bool(correct), "predicted": str(predicted[-1]) if predicted else None, "reference": answer}
        )
    return results


# --- code ------------------------------------------------------------------------------------------


def humaneval_task(completion: str, record: dict) -> sandbox.Tested:
    # The prompt's function (signature + docstring) is valid on its own: a completion that continues it
    # and one that restates the whole function both run. The tests side runs the prompt too, for the
    # helpers its tests use (e.g. poly, encode_cyclic); the entry point there is the remote one.
    code = extract_code(completion, record["entry_point"])
    entry = record["entry_point"]
    return sandbox.Tested(
        candidate=f"{record['prompt']}{code}\n",
        tests=f"{record['prompt']}\n\n{record['test']}\n",
        call=f"check({entry})\n",
        remote=(entry,),
    )


def mbpp_task(completion: str, record: dict) -> sandbox.Tested:
    tests = record["test_list"]
    name = _called_function(tests)
    imports = "\n".join(record.get("test_imports") or [])  # the sanitized split keeps its imports here
    setup = record.get("test_setup_code") or ""
    code = extract_code(completion, name)
    asserts = "\n".join(tests) + "\n"
    candidate = f"{imports}\n{code}\n\n{setup}\n"
    if not _free_names(f"{imports}\n{setup}\n"):
        # the setup code runs on both sides: its classes (e.g. a tree's Node) build the arguments
        tests_side = f"{imports}\n{setup}\n"
        return sandbox.Tested(
            candidate=candidate, tests=tests_side, call=asserts, remote=_remote_names(tests_side, asserts, name)
        )
    # a setup that uses the candidate's own definitions (e.g. its Node class) runs on the candidate's side
    # only; what the asserts take from it crosses as opaque handles, good as arguments and equal only to
    # themselves, so that the candidate cannot supply an expected value
    refs = tuple(sorted(_defined_names(setup) & _free_names(asserts)))
    remote = tuple(n for n in _remote_names(imports, asserts, name) if n not in refs)
    return sandbox.Tested(candidate=candidate, tests=f"{imports}\n", call=asserts, remote=remote, refs=refs)


def _remote_names(setup: str, asserts: str, called: str | None) -> tuple[str, ...]:
    """Names the asserts read that neither they nor the setup define, and that are not builtins (the
    function under test is remote even when it shadows a builtin)."""
    remote = _free_names(asserts) - _defined_names(setup)
    if called:
        remote.add(called)
    return tuple(sorted(remote))


def _defined_names(code: str) -> set[str]:
    return _names(code)[0]


def _free_names(code: str) -> set[str]:
    """Names the code reads and does not define, builtins left out."""
    defined, loaded = _names(code)
    return {name for name in loaded - defined if not hasattr(builtins, name)}


def _names(code: str) -> tuple[set[str], set[str]]:
    defined: set[str] = set()
    loaded: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    return defined, loaded


def extract_code(text: str, function: str | None = None) -> str:
    """The fenced block that defines `function`, else all fenced blocks, else the text itself."""
    blocks = re.findall(r"```[^\n`]*\n(.*?)(?:```|\Z)", text, flags=re.DOTALL)
    if not blocks:
        return text
    if function:
        defining = [b for b in blocks if re.search(rf"^\s*def\s+{re.escape(function)}\s*\(", b, re.MULTILINE)]
        if defining:
            return defining[0]
    return "\n\n".join(blocks)


def _called_function(tests: list[str]) -> str | None:
    for test in tests:
        match = re.search(r"assert\s+(?:not\s+)?\(?\s*(?:math\.isclose\(\s*|set\(\s*)?([A-Za-z_]\w*)\s*\(", test)
        if match:
            return match.group(1)
    return None


def _failure_detail(outcome: sandbox.Outcome) -> str | None:
    if outcome.passed:
        return None
    if outcome.timed_out:
        return "timed out"
    candidate = outcome.candidate
    if candidate is not None and candidate.returncode is not None and candidate.returncode < 0:
        try:
            name = signal.Signals(-candidate.returncode).name
        except ValueError:
            name = str(-candidate.returncode)
        return f"the candidate was killed by {name}" + (" (CPU limit)" if name == "SIGXCPU" else "")
    lines = outcome.stderr.strip().splitlines()
    if lines and lines[-1].startswith("the candidate exited before its tests finished"):
        return "exited before its tests finished"
    return lines[-1][:200] if lines else f"exit status {outcome.returncode}"


# --- inputs --------------------------------------------------------------------------------------------


def _reference_records(datasets: set[str]) -> dict[str, dict[str, dict]]:
    from specpilot_build.measure.datasets import all_items

    return {dataset: {item.id: item.record for item in all_items(dataset)} for dataset in datasets}


def _record_for(records: dict, dataset: str, item_id: str, path: Path) -> dict:
    try:
        return records[dataset][str(item_id)]
    except KeyError:
        raise SpecPilotError(f"{path}: {dataset} item {item_id!r} is not in the pinned {dataset} split") from None


# --- table -----------------------------------------------------------------------------------------------


def print_table(score: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    title = f"score: {score.get('name') or score['results']}"
    if score.get("arm"):
        title += f"  (arm {score['arm']}, engine {str(score.get('engine_id'))[:16]})"
    table = Table(title=title, caption=f"sandbox: {score['sandbox']}" if score.get("sandbox") else None)
    for column in ("dataset", "n", "correct", "accuracy", "truncated"):
        table.add_column(column, justify="left" if column == "dataset" else "right")
    for dataset, summary in score["datasets"].items():
        if summary["scored"]:
            table.add_row(
                dataset,
                str(summary["n"]),
                str(summary["correct"]),
                f"{summary['accuracy']:.1%}",
                str(summary["truncated"]),
            )
        else:
            table.add_row(dataset, str(summary["n"]), "-", "not auto-scored", str(summary["truncated"]))
    Console().print(table)
