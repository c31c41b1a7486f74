"""Scoring: reference answers and canonical solutions score 100%, wrong and hostile ones score 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpilot_build.errors import SpecPilotError
from specpilot_build.measure import sandbox, score
from specpilot_build.measure.datasets import all_items, load_split


def _request(dataset: str, item_id: str, text: str, finish: str = "stop", tokens: int = 10) -> dict:
    return {
        "dataset": dataset,
        "item_id": item_id,
        "prompt_ids": [1, 2, 3],
        "output_ids": list(range(tokens)),
        "output_text": text,
        "completion_tokens": tokens,
        "max_new_tokens": 64,
        "finish_reason": finish,
    }


def _write_run(path: Path, requests: list[dict]) -> Path:
    path.write_text(
        json.dumps(
            {
                "schema": "specpilot.results/1",
                "name": path.stem,
                "engine_id": "e" * 64,
                "setting": "test",
                "arm": "final",
                "max_new_tokens": 64,
                "requests": requests,
            }
        )
    )
    return path


def _fenced(code: str) -> str:
    return f"Here is my solution.\n\n```python\n{code}```\n\nIt passes the examples."


@pytest.fixture(scope="module")
def canonical(tmp_path_factory, shared):
    """A results file whose answers are the upstream canonical solutions of every HumanEval problem and
    every MBPP test-split problem; one in ten restated as a fenced markdown answer, the way chat models write."""
    requests = []
    for index, item in enumerate(all_items("humaneval")):
        solution = item.record["canonical_solution"]
        if index % 10 == 0:
            solution = _fenced(item.record["prompt"] + solution)
        requests.append(_request("humaneval", item.id, solution))
    for index, item in enumerate(all_items("mbpp")):
        solution = item.record["code"].replace("\r\n", "\n")
        if index % 10 == 0:
            solution = _fenced(solution + "\n")
        requests.append(_request("mbpp", item.id, solution))
    path = _write_run(tmp_path_factory.mktemp("runs") / "canonical.json", requests)
    return path, score.score_run(path)


@pytest.mark.slow
def test_every_canonical_code_solution_passes_in_the_sandbox(canonical):
    _, result = canonical
    failures = [(g["item_id"], g["detail"]) for g in result["items"] if not g["correct"]]
    assert failures == []
    assert result["datasets"]["humaneval"] == {
        "n": 164,
        "scored": True,
        "correct": 164,
        "accuracy": 1.0,
        "truncated": 0,
    }
    assert result["datasets"]["mbpp"]["n"] == 500 and result["datasets"]["mbpp"]["accuracy"] == 1.0


def test_sanitized_mbpp_records_with_test_imports_pass(tmp_path, shared):
    """The sanitized MBPP split keeps its imports in `test_imports` (e.g. `import math` for isclose)."""
    rows = json.loads((shared / "datasets" / "mbpp" / "sanitized-mbpp.json").read_text())
    with_imports = [row for row in rows if row["test_imports"]]
    assert len(with_imports) == 13
    results = score.grade("mbpp", [row["code"] for row in with_imports], with_imports)
    assert [r["detail"] for r in results if not r["correct"]] == []
    # an answer without the import its test needs passes only thanks to test_imports
    answer = "def volume_sphere(r):\n    return 4 / 3 * 3.141592653589793 * r ** 3\n"
    record = next(row for row in with_imports if "volume_sphere" in row["code"])
    assert score.grade("mbpp", [answer], [record])[0]["correct"]
    assert not score.grade("mbpp", [answer], [{**record, "test_imports": []}])[0]["correct"]


@pytest.mark.slow
def test_score_json_is_written_next_to_the_run(canonical):
    path, result = canonical
    written = json.loads((path.parent / "canonical.score.json").read_text())
    assert written["schema"] == "specpilot.score/1" and written["results"] == "canonical.json"
    assert written["datasets"] == result["datasets"]
    assert len(written["items"]) == 164 + 500


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, shared):
    gsm8k = load_split("gsm8k", 6)
    math500 = load_split("math500", 6)
    humaneval = {item.id: item.record for item in all_items("humaneval")}
    mbpp = load_split("mbpp", 3)
    mt_bench = load_split("mt-bench", 2)
    requests = [
        # gsm8k: the reference solution text is right; the neighbour's final number is wrong
        *[_request("gsm8k", it.id, it.record["answer"]) for it in gsm8k[:4]],
        _request("gsm8k", gsm8k[4].id, gsm8k[5].record["answer"]),
        _request("gsm8k", gsm8k[5].id, "I could not finish the", finish="length", tokens=64),
        # math500: reference solution texts are right; a swapped one is wrong
        *[_request("math500", it.id, it.record["solution"]) for it in math500[:4]],
        _request("math500", math500[4].id, "The answer is $\\boxed{\\frac{7}{13}}$ for sure."),
        _request("math500", math500[5].id, math500[5].record["solution"], finish="length", tokens=64),
        # code: right, wrong, hostile, truncated mid-fence
        _request("humaneval", "HumanEval/0", humaneval["HumanEval/0"]["canonical_solution"]),
        _request("humaneval", "HumanEval/2", "    return 0.5\n"),
        _request("humaneval", "HumanEval/4", "    while True:\n        pass\n"),
        _request(
            "humaneval",
            "HumanEval/7",
            "```python\nfrom typing import List\ndef filter_by_substring(",
            finish="length",
            tokens=64,
        ),
        _request("mbpp", mbpp[0].id, mbpp[0].record["code"]),
        _request("mbpp", mbpp[1].id, _fenced("import sys\nsys.exit(0)  # skip the tests\n")),
        _request("mbpp", mbpp[2].id, "I am not sure how to do this."),
        *[
            _request("mt-bench", it.id, "A thoughtful essay.", finish=f, tokens=n)
            for it, f, n in zip(mt_bench, ("stop", "length"), (10, 64))
        ],
    ]
    path = _write_run(tmp_path_factory.mktemp("runs") / "mixed.json", requests)
    return score.score_run(path, workers=2, limits=sandbox.Limits(wall_s=30.0, cpu_s=2))


@pytest.mark.slow
def test_mixed_run_counts_correct_and_truncated_answers(mixed, shared):
    datasets = mixed["datasets"]
    assert (datasets["gsm8k"]["correct"], datasets["gsm8k"]["n"], datasets["gsm8k"]["truncated"]) == (4, 6, 1)
    assert (datasets["math500"]["correct"], datasets["math500"]["truncated"]) == (5, 1)  # truncation is not failure
    assert (datasets["humaneval"]["correct"], datasets["humaneval"]["truncated"]) == (1, 1)
    assert datasets["mbpp"]["correct"] == 1
    assert datasets["mt-bench"] == {"n": 2, "scored": False, "correct": None, "accuracy": None, "truncated": 1}
    details = {g["item_id"]: g.get("detail") for g in mixed["items"]}
    assert details["HumanEval/4"] == "timed out" or "CPU" in (details["HumanEval/4"] or "") or details["HumanEval/4"]
    assert details[load_split("mbpp", 3)[1].id] == "exited before its tests finished"


def test_cli_prints_the_table_and_writes_the_score(tmp_path, capsys, shared):
    from specpilot_build.cli.main import main

    item = load_split("gsm8k", 1)[0]
    path = _write_run(
        tmp_path / "tiny.json",
        [_request("gsm8k", item.id, item.record["answer"]), _request("mt-bench", "81", "Hello.")],
    )
    assert main(["score", str(path)]) == 0
    out = capsys.readouterr().out
    assert "gsm8k" in out and "100.0%" in out and "not auto-scored" in out
    assert (tmp_path / "tiny.score.json").is_file()


def test_unknown_item_is_a_user_error(tmp_path, shared):
    path = _write_run(tmp_path / "bad.json", [_request("humaneval", "HumanEval/999", "pass")])
    with pytest.raises(SpecPilotError, match="HumanEval/999"):
        score.score_run(path)


def test_missing_run_exits_with_a_one_line_error(tmp_path, capsys):
    from specpilot_build.cli.main import main

    assert main(["score", str(tmp_path / "nothing.json")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


# --- answer extraction -------------------------------------------------------------------------------


def test_gsm8k_final_number_from_every_reference_solution(shared):
    wrong = []
    for item in all_items("gsm8k"):
        answer = item.record["answer"]
        reference = score.gsm8k_reference(answer)
        body, final = answer.split("####")
        final = final.strip()
        for text in (
            answer,
            f"{body}The answer is {final}.",
            f"{body}So the total is $\\boxed{{{final}}}$.",
            f"{body}{final}",
        ):
            if score.extract_final_number(text) != reference:
                wrong.append((item.id, text[-40:]))
    assert wrong == []


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She pays $1,250.50 in total.\n#### 1,250.50", "2501/2"),
        ("so \\boxed{\\$18} dollars", "18"),
        ("The answer is: -7 degrees", "-7"),
        ("\\boxed{\\frac{3}{4}} of the cake", "3/4"),
        ("First 12, then 30, finally 42 apples.", "42"),
        ("12 eggs \\boxed{36}. Later we note 5 other things.", "36"),
        ("no digits here", None),
    ],
)
def test_gsm8k_extraction_cases(text, expected):
    value = score.extract_final_number(text)
    assert (None if value is None else str(value)) == expected


def test_gsm8k_reference_numbers():
    assert score.gsm8k_reference("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == 72
    assert score.gsm8k_reference("#### 1,000") == 1000


EQUIVALENT_FORMS = [
    ("so $\\boxed{0.5}$", "\\frac{1}{2}", True),
    ("thus \\boxed{\\dfrac{1}{2}}", "\\frac12", True),
    ("x = \\boxed{3}", "3", True),
    ("I give up", "3", False),
]


@pytest.fixture(scope="module")
def math500_grades(shared):
    """One math-verify worker for all cases: 40 reference solutions against their own answers, then against
    their neighbour's answers, then hand-written equivalent forms."""
    items = load_split("math500", 40)
    solutions = [item.record["solution"] for item in items]
    answers = [item.record["answer"] for item in items]
    shifted = answers[1:] + answers[:1]
    completions = solutions + solutions + [text for text, _, _ in EQUIVALENT_FORMS]
    references = answers + shifted + [answer for _, answer, _ in EQUIVALENT_FORMS]
    grades = [r["correct"] for r in score.grade_math500(completions, references)]
    return answers, shifted, grades[:40], grades[40:80], grades[80:]


@pytest.mark.slow
def test_math500_reference_solutions_match_their_answers(math500_grades):
    _, _, own, _, _ = math500_grades
    assert own == [True] * 40


@pytest.mark.slow
def test_math500_other_answers_do_not_match(math500_grades):
    answers, shifted, _, others, _ = math500_grades
    distinct = [i for i in range(40) if shifted[i] != answers[i]]
    assert len(distinct) > 30
    assert [others[i] for i in distinct] == [False] * len(distinct)


@pytest.mark.slow
def test_math500_equivalent_forms(math500_grades):
    assert math500_grades[4] == [expected for _, _, expected in EQUIVALENT_FORMS]


def test_last_boxed_balances_braces():
    assert score.last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert score.last_boxed("\\boxed{unclosed") is None


def test_code_extraction_prefers_the_block_defining_the_function():
    text = (
        "Example use:\n```python\nprint(add(1, 2))\n```\nThe function:\n```py\ndef add(a, b):\n    return a + b\n```\n"
    )
    assert score.extract_code(text, "add") == "def add(a, b):\n    return a + b\n"
    assert score.extract_code("def add(a, b): return a + b", "add") == "def add(a, b): return a + b"
    assert score.extract_code("```python\ndef add(a, b):\n    return a", "add") == "def add(a, b):\n    return a"


# --- forged passes: no completion passes without passing the tests -------------------------------------

# Module-level code a completion can carry: it collects every 32-hex-digit string (the shape of the secret
# marker the grader used to append) from one place it can read, prints them, and exits 0 before the tests.
STEAL = {
    "own-source": "found = set(re.findall(r'[0-9a-f]{32}', open(__file__).read()))\n",
    "code-objects": (
        "import gc, types\n"
        "found = set()\n"
        "def consts(code, depth=0):\n"
        "    for c in code.co_consts:\n"
        "        if isinstance(c, str):\n"
        "            found.update(re.findall(r'[0-9a-f]{32}', c))\n"
        "        elif isinstance(c, types.CodeType) and depth < 5:\n"
        "            consts(c, depth + 1)\n"
        "for holder in [*gc.get_objects(), *[vars(m) for m in list(sys.modules.values())]]:\n"
        "    values = holder.values() if isinstance(holder, dict) else [holder]\n"
        "    for value in list(values):\n"
        "        code = getattr(value, '__code__', value)\n"
        "        if isinstance(code, types.CodeType):\n"
        "            consts(code)\n"
    ),
    "frames": (
        "import inspect\n"
        "found = set()\n"
        "for info in inspect.stack():\n"
        "    frame = info.frame\n"
        "    for value in [*frame.f_locals.values(), *frame.f_globals.values(), *frame.f_code.co_consts]:\n"
        "        if hasattr(value, 'co_consts'):\n"
        "            value = repr(value.co_consts)\n"
        "        found.update(re.findall(r'[0-9a-f]{32}', str(value)))\n"
    ),
    "own-memory": (
        "import ctypes\n"
        "ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: its /proc/self/mem becomes its own\n"
        "found = set()\n"
        "with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:\n"
        "    for line in maps:\n"
        "        span, perms = line.split()[:2]\n"
        "        low, high = (int(x, 16) for x in span.split('-'))\n"
        "        if perms.startswith('r') and high - low < 1 << 26:\n"
        "            try:\n"
        "                mem.seek(low)\n"
        "                found.update(m.decode() for m in re.findall(rb'[0-9a-f]{32}', mem.read(high - low)))\n"
        "            except (OSError, ValueError, OverflowError):\n"
        "                pass\n"
    ),
    "proc-cmdline-environ": (
        "found = set()\n"
        "for pid in ['self'] + [p for p in os.listdir('/proc') if p.isdigit()]:\n"
        "    for name in ('cmdline', 'environ'):\n"
        "        try:\n"
        "            found.update(re.findall(r'[0-9a-f]{32}', open(f'/proc/{pid}/{name}', 'rb').read()"
        ".decode('latin-1')))\n"
        "        except OSError:\n"
        "            pass\n"
    ),
}


def _thief(function: str, vector: str) -> str:
    return _fenced(
        f"import os, re, sys\n{function}\n{STEAL[vector]}print('\\n'.join(sorted(found)), flush=True)\nos._exit(0)\n"
    )


@pytest.mark.parametrize("vector", sorted(STEAL))
def test_a_completion_that_prints_what_it_can_read_and_exits_0_fails(vector, shared):
    humaneval = {item.id: item.record for item in all_items("humaneval")}["HumanEval/0"]
    mbpp = load_split("mbpp", 1)[0].record
    mbpp_name = score._called_function(mbpp["test_list"])
    wrong_humaneval = "def has_close_elements(numbers, threshold):\n    return None\n"
    wrong_mbpp = f"def {mbpp_name}(*args):\n    return None\n"
    results = score.grade("humaneval", [_thief(wrong_humaneval, vector)], [humaneval])
    results += score.grade("mbpp", [_thief(wrong_mbpp, vector)], [mbpp])
    assert [r["correct"] for r in results] == [False, False], results
    assert [r["detail"] for r in results] == ["exited before its tests finished"] * 2


@pytest.mark.parametrize(
    "exit_code",
    [
        "import sys\nsys.exit(0)",
        "import os\nos._exit(0)",
        "exit(0)",
        "raise SystemExit",
        "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)",
    ],
)
def test_exiting_early_with_status_0_fails(exit_code, shared):
    humaneval = {item.id: item.record for item in all_items("humaneval")}["HumanEval/0"]
    at_module_level = _fenced(f"def has_close_elements(numbers, threshold):\n    return None\n{exit_code}\n")
    in_the_function = _fenced(
        "def has_close_elements(numbers, threshold):\n" + "".join(f"    {line}\n" for line in exit_code.splitlines())
    )
    results = score.grade("humaneval", [at_module_level, in_the_function], [humaneval, humaneval])
    assert [r["correct"] for r in results] == [False, False], results


def test_an_answer_equal_to_everything_fails(shared):
    records = {item.id: item.record for item in all_items("humaneval")}
    always_equal = (
        "class Anything(list):\n    def __eq__(self, other):\n        return True\n"
        "    def __ne__(self, other):\n        return False\n    __bool__ = lambda self: True\n"
        "    __hash__ = object.__hash__\n"
    )
    completions = [
        _fenced(f"{always_equal}def has_close_elements(numbers, threshold):\n    return Anything()\n"),
        _fenced(f"{always_equal}def separate_paren_groups(paren_string):\n    return Anything()\n"),
    ]
    results = score.grade("humaneval", completions, [records["HumanEval/0"], records["HumanEval/1"]])
    assert [r["correct"] for r in results] == [False, False], results


def test_correct_answers_that_need_helpers_and_setup_code_pass(shared):
    """HumanEval/32's tests call the prompt's poly(); MBPP 367's setup builds trees of the answer's Node."""
    humaneval = {item.id: item.record for item in all_items("humaneval")}
    mbpp = {item.id: item.record for item in all_items("mbpp")}
    h32, m367 = humaneval["HumanEval/32"], mbpp["367"]
    assert "poly(" in h32["test"] and "Node(" in m367["test_setup_code"]
    assert score.grade("humaneval", [_fenced(h32["prompt"] + h32["canonical_solution"])], [h32])[0]["correct"]
    assert not score.grade("humaneval", ["    return 0.0\n"], [h32])[0]["correct"]
    assert score.grade("mbpp", [_fenced(m367["code"].replace("\r\n", "\n") + "\n")], [m367])[0]["correct"]
    wrong = (
        "class Node:\n    def __init__(self, data):\n        self.data, self.left, self.right = data, None, None\n"
        "def is_tree_balanced(root):\n    return root.data == 1\n"
    )
    assert not score.grade("mbpp", [wrong], [m367])[0]["correct"]
