"""bench and verify: classification of oracle answers, and (once a reference runtime exists) end to end."""
import math

import pytest

from specpilot_build import verify as vf
from specpilot_build.errors import SpecPilotError


def oracle_answer(prompt, emitted, top_per_position):
    """An answer in SGLang's shape: one entry per position from len(prompt)-1; the first predicts the
    last prompt token, entry j+1 the emitted token j."""
    tops = [[[-0.5, prompt[-1], None], [-2.0, 0, None]]] + top_per_position
    token_lps = [[-0.5, prompt[-1], None]] + [
        [next((lp for lp, tid, _ in top if tid == e), -9.0), e, None] for e, top in zip(emitted, top_per_position)]
    return {"meta_info": {"input_top_logprobs": tops, "input_token_logprobs": token_lps}}


REQUEST = {"dataset": "gsm8k", "item_id": "12", "prompt_ids": [1, 2, 3], "output_ids": [5, 6, 7, 8]}


def test_all_top1_is_verified():
    tops = [[[-0.1, 5, None], [-3, 9, None]], [[-0.2, 6, None], [-2, 9, None]],
            [[-0.3, 7, None], [-1, 9, None]], [[-0.1, 8, None], [-4, 9, None]]]
    check = vf.check_request(REQUEST, oracle_answer([1, 2, 3], [5, 6, 7, 8], tops), tolerance=0.25)
    assert (check["verified"], check["tokens"], check["first_mismatch"], check["near_ties"]) == (4, 4, None, [])


def test_near_tie_within_tolerance_and_real_mismatch_beyond():
    tops = [[[-0.1, 5, None], [-3, 9, None]],
            [[-0.60, 9, None], [-0.75, 6, None]],  # emitted 6 is top-2, 0.15 below: a near tie at bf16
            [[-0.1, 9, None], [-3.0, 7, None]],  # emitted 7, 2.9 below: a real mismatch
            [[-0.1, 9, None], [-3.0, 8, None]]]  # after the first real mismatch: reported, not verified
    check = vf.check_request(REQUEST, oracle_answer([1, 2, 3], [5, 6, 7, 8], tops), tolerance=0.25)
    assert [(n["position"], n["emitted_id"], n["oracle_id"]) for n in check["near_ties"]] == [(1, 6, 9)]
    assert math.isclose(check["near_ties"][0]["margin"], 0.15)
    first = check["first_mismatch"]
    assert (first["position"], first["emitted_id"], first["oracle_id"]) == (2, 7, 9)
    assert math.isclose(first["margin"], 2.9)
    assert (check["verified"], check["mismatches_after"]) == (2, 1)
    # The same near tie is real under float32's much tighter tolerance.
    strict = vf.check_request(REQUEST, oracle_answer([1, 2, 3], [5, 6, 7, 8], tops),
                              tolerance=vf.dtype_tolerance("float32"))
    assert strict["first_mismatch"]["position"] == 1 and strict["verified"] == 1


def test_emitted_token_outside_top2_uses_its_forced_logprob():
    tops = [[[-0.1, 9, None], [-0.2, 4, None]], [[-0.1, 6, None], [-3, 9, None]],
            [[-0.1, 7, None], [-3, 9, None]], [[-0.1, 8, None], [-3, 9, None]]]
    answer = oracle_answer([1, 2, 3], [5, 6, 7, 8], tops)
    answer["meta_info"]["input_token_logprobs"][1][0] = -0.3  # emitted 5 ranks third, 0.2 below top-1
    check = vf.check_request(REQUEST, answer, tolerance=0.25)
    assert check["first_mismatch"] is None and check["near_ties"][0]["margin"] == pytest.approx(0.2)


def test_tolerances_follow_the_dtype_rounding_step():
    assert vf.dtype_tolerance("bfloat16") == 0.25
    assert vf.dtype_tolerance("float16") == 2.0 ** -5
    assert vf.dtype_tolerance("float32") == 2.0 ** -18
    assert vf.dtype_tolerance("float32", "bfloat16") == 0.25  # the coarser engine decides


def test_an_answer_without_forcing_logprobs_is_refused():
    with pytest.raises(SpecPilotError, match="gsm8k item 12, expected 5"):
        vf.check_request(REQUEST, {"meta_info": {"input_top_logprobs": [[]]}}, tolerance=0.25)
