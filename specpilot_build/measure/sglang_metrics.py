"""Where an SGLang engine's time goes, per request, from SGLang's own Prometheus counters.

SGLang's `/generate` carries no per-part timing (the reference runtime's `meta_info.timing_s`), but an engine
launched with `--enable-metrics` and `SGLANG_ENABLE_METRICS_DEVICE_TIMER=1` (every SGLang launch spec carries both,
assemble/launch.py) counts, in `/metrics`:

- `sglang:forward_execution_seconds_total{category}`: device time of every forward, of the target runner and
  of the draft runners, labelled by forward kind (CATEGORY_PARTS maps each kind to a part);
- `sglang:queue_time_seconds` and `sglang:e2e_request_latency_seconds` (histograms: their `_sum` is seconds);
- `sglang:generation_tokens_total`, `sglang:num_requests_total`.

A c1 bench reads `/metrics` before the first request and after each answer (client.post_all's probe), and
stores the difference per request (`sglang_metrics`); at one request in flight that difference is the request's
own. `timing` turns it into the parts gaps models. The device timer reports a forward once its end event has
completed, at the next forward of the same runner: a request's last forward or two may land in the next
request's difference, so one request's split is approximate while a dataset's sum is not (but for the last one).
"""

from __future__ import annotations

import httpx

from specpilot_build.errors import SpecPilotError

FORWARD = "sglang:forward_execution_seconds_total"
QUEUE = "sglang:queue_time_seconds_sum"
E2E = "sglang:e2e_request_latency_seconds_sum"
GENERATED = "sglang:generation_tokens_total"
REQUESTS = "sglang:num_requests_total"
REQUIRED = (FORWARD, QUEUE, E2E, GENERATED, REQUESTS)
# Forward kinds as the device timer labels them (literal categories of device_timer_ctx, and ForwardMode names in
# lower case where the decode CUDA-graph runner passes the mode's name) -> the part of a request they are.
CATEGORY_PARTS = {
    "decode": "target",
    "target_verify": "target",
    "extend": "prefill",
    "mixed": "prefill",
    "split_prefill": "prefill",
    "dllm_extend": "prefill",
    "prebuilt": "prefill",
    "eagle_draft": "draft",
    "eagle_draft_extend": "draft",
    "draft_extend_v2": "draft",
    "frozen_kv_draft": "draft",
    "idle": "idle",
}
HOW_TO_ENABLE = "serve an SGLang engine whose launch spec has --enable-metrics and SGLANG_ENABLE_METRICS_DEVICE_TIMER=1"


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    """The counters gaps needs from `url`/metrics, summed over every label but the forward's category:
    `sglang:forward_execution_seconds_total{category=...}` per category, the rest by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(f"{url}/metrics", timeout=timeout)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise SpecPilotError(f"{url}/metrics: not readable ({exc}); {HOW_TO_ENABLE}") from None
    found: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(response.text))
    except ValueError as exc:
        raise SpecPilotError(f"{url}/metrics: not Prometheus text ({exc})") from None
    for family in families:
        for sample in family.samples:
            if sample.name == FORWARD:
                key = f"{FORWARD}{{category={sample.labels.get('category')}}}"
            elif sample.name in REQUIRED:
                key = sample.name
            else:
                continue
            found[key] = found.get(key, 0.0) + float(sample.value)
    missing = [name for name in REQUIRED if not any(k == name or k.startswith(name + "{") for k in found)]
    if missing:
        raise SpecPilotError(f"{url}/metrics has no {missing[0]}; {HOW_TO_ENABLE}")
    return found


def difference(before: dict[str, float], after: dict[str, float], where: str) -> dict[str, float]:
    """after - before per counter; a counter that went backwards or vanished means the server restarted."""
    for key in before:
        if key not in after:
            raise SpecPilotError(f"{where}: counter {key} vanished between two reads of /metrics (server restarted?)")
        if after[key] < before[key]:
            raise SpecPilotError(
                f"{where}: counter {key} went backwards ({before[key]:g} -> {after[key]:g}): the server restarted "
                "during the bench; bench again"
            )
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def timing(delta: dict[str, float], where: str) -> dict[str, float]:
    """The parts of one request (the keys of the reference runtime's timing_s) from its counters' difference:
    target, draft, prefill (device seconds by forward kind), queue, engine (SGLang's end-to-end latency) and
    idle (idle forwards)."""
    parts = {"target": 0.0, "draft": 0.0, "prefill": 0.0, "idle": 0.0}
    prefix = FORWARD + "{category="
    for key, value in delta.items():
        if not key.startswith(prefix):
            continue
        category = key[len(prefix) : -1]
        if category not in CATEGORY_PARTS:
            raise SpecPilotError(
                f"{where}: forward category {category!r} of {FORWARD} is not one gaps knows "
                f"({', '.join(sorted(CATEGORY_PARTS))}); map it in measure/sglang_metrics.py"
            )
        parts[CATEGORY_PARTS[category]] += value
    missing = [name for name in (QUEUE, E2E) if name not in delta]
    if missing:
        raise SpecPilotError(f"{where}: no {missing[0]} difference recorded; {HOW_TO_ENABLE}")
    return {**parts, "queue": delta[QUEUE], "engine": delta[E2E]}


def check_one_request(delta: dict[str, float], completion_tokens: int, where: str) -> None:
    """The difference is this request's alone: one request finished, and it generated what the answer says."""
    if delta.get(REQUESTS) != 1 or delta.get(GENERATED) != completion_tokens:
        raise SpecPilotError(
            f"{where}: /metrics counted {delta.get(REQUESTS, 0):g} requests and {delta.get(GENERATED, 0):g} tokens "
            f"for one request of {completion_tokens} tokens; another client used the server during the bench"
        )
