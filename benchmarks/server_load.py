"""Load benchmark: 16 concurrent valid greedy requests while the fuzzer runs, against a real reference-runtime
server (stories260K, the `final` arm, 16 running requests, default limits: 8 MiB bodies).

    python benchmarks/server_load.py [--seconds 60] [--big 4]

1. Start the server; send each of the 16 valid requests alone and keep its answer (the solo answers).
2. Warm up (every path once: 16 concurrent requests, one body at the limit, one fuzz batch), record the
   server's RSS (pre-storm), then start the storm: 16 threads sending those requests over and over,
   a /health prober every 50 ms, the fuzzer of benchmarks/server_fuzz.py (schemathesis + raw hypothesis, batches
   of fresh seeds) for --seconds, and --big bodies at the size limit (8 MiB of text: the largest allowed
   request, tokenized in full and refused for its length) plus one just over it (413).
3. Pass when every storm answer equals its solo answer, /health p99 < 250 ms with no failed probe, no 5xx, and
   the server's RSS, a few seconds after the storm, is within 10% of the pre-storm value.
Results go in benchmarks/server_load.md (machine and date with them).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil
from server_fuzz import Server, Storm, Tally, fuzz_raw, fuzz_schema, report, storm_requests

MAX_BODY = 8 * 1024 * 1024  # the server's default --max-body-bytes
HEALTH_P99_S = 0.25
RSS_TOLERANCE = 0.10


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def big_bodies(url: str, count: int, tally: Tally, times: list[float]) -> None:
    """`count` bodies at the limit (tokenized in full, then refused: too long for the context), one over it."""
    text = "Once upon a time there was a little dog. "
    body = json.dumps({"text": text * ((MAX_BODY - 64) // len(text))}).encode()
    with httpx.Client(timeout=300) as client:
        for _ in range(count):
            start = time.perf_counter()
            r = client.post(url + "/generate", content=body, headers={"content-type": "application/json"})
            times.append(time.perf_counter() - start)
            tally.record("big", "POST", "/generate", r.status_code, r.content, body[:64])
        over = body + b" " * (MAX_BODY - len(body) + 1)
        r = client.post(url + "/v1/completions", content=over, headers={"content-type": "application/json"})
        tally.record("big", "POST", "/v1/completions", r.status_code, r.content, over[:64])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the fuzzer runs")
    parser.add_argument("--big", type=int, default=2, help="8 MiB bodies sent during the storm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=100, help="fuzz examples per strategy per batch")
    parser.add_argument(
        "--arm",
        choices=["final", "ar"],
        default="final",
        help="final: the n-gram cache shared across requests (it keeps what it indexed, up to "
        "1M tokens); ar: no drafter, no state kept across requests",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="server_load_") as tmp:
        server = Server(Path(tmp), arm=args.arm).wait_healthy()
        try:
            return run(server, args)
        finally:
            server.stop()


def run(server: Server, args) -> int:
    url, pid = server.url, server.proc.pid
    requests = storm_requests(16)
    storm = Storm(url, requests, workers=16)  # computes the solo answers first, one request at a time
    # Warm-up, so that one-time allocations (worker threads and their malloc arenas, the tokenizer's thread
    # pool, the shared n-gram table, torch's buffers for each batch size) count as the server's size, not as
    # growth: every path once, briefly, with its own seeds. Then the pre-storm RSS.
    warm = Storm(url, requests, workers=16)
    warm.start()
    warm_tally = Tally()
    big_bodies(url, 1, warm_tally, [])
    with httpx.Client(timeout=180) as client:
        fuzz_raw(url, warm_tally, args.batch, 10_000 + args.seed, client)
        fuzz_schema(url, warm_tally, args.batch, 10_000 + args.seed, client)
    warm.stop()
    time.sleep(5)
    rss_before = rss_mb(pid)
    tally, big_times = Tally(), []
    load_start = psutil.getloadavg()[0]
    started = time.monotonic()
    storm.start()
    big = threading.Thread(target=big_bodies, args=(url, args.big, tally, big_times))
    big.start()
    batches = 0
    try:
        with httpx.Client(timeout=180) as client:
            while time.monotonic() - started < args.seconds:
                fuzz_raw(url, tally, args.batch, args.seed + batches, client)
                fuzz_schema(url, tally, args.batch, args.seed + batches, client)
                batches += 1
        big.join()
    finally:
        storm.stop()
    wall = time.monotonic() - started
    rss_end = rss_mb(pid)
    time.sleep(5)
    rss_after = rss_mb(pid)
    p99 = storm.health_percentile(0.99)
    ok_outputs = not storm.mismatches
    ok_health = p99 < HEALTH_P99_S and not storm.health_failures
    ok_rss = abs(rss_after - rss_before) <= RSS_TOLERANCE * rss_before
    ok_fuzz = not tally.failures and server.proc.poll() is None
    print(report(tally, storm))
    print(
        f"\n| date (UTC) | {datetime.now(UTC):%Y-%m-%d %H:%M} |\n|---|---|\n"
        f"| server | stories260K, arm {args.arm}, 16 running requests, --max-body-bytes 8 MiB |\n"
        f"| machine | {platform.machine()}, {psutil.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, "
        f"1-min load average {load_start:.1f} at the start, {psutil.getloadavg()[0]:.1f} at the end |\n"
        f"| storm | {wall:.0f} s, fuzz batches {batches} x ({args.batch} raw + {args.batch} schemathesis), "
        f"{args.big} bodies of 8 MiB + 1 over the limit |\n"
        f"| fuzz requests | {tally.total}: "
        + ", ".join(f"{k} {v}" for k, v in sorted(tally.by_source.items()))
        + " |\n| status codes | "
        + ", ".join(f"{c}: {n}" for c, n in sorted(tally.statuses.items()))
        + " |\n"
        f"| valid requests (16 concurrent) | {storm.sent}, differing from solo: {len(storm.mismatches)} |\n"
        f"| /health | {len(storm.health)} probes, p50 {storm.health_percentile(0.5) * 1000:.1f} ms, "
        f"p99 {p99 * 1000:.1f} ms, max {max(storm.health) * 1000:.1f} ms, failed {len(storm.health_failures)} |\n"
        f"| 8 MiB bodies | " + ", ".join(f"{t:.1f} s" for t in big_times) + " each (400: context length) |\n"
        f"| server RSS | before {rss_before:.0f} MiB, at the storm's end {rss_end:.0f} MiB, 5 s later "
        f"{rss_after:.0f} MiB ({(rss_after / rss_before - 1) * 100:+.1f}%) |\n"
        f"| verdict | outputs {'ok' if ok_outputs else 'FAIL'}, "
        f"/health p99 < 250 ms {'ok' if ok_health else 'FAIL'}, "
        f"RSS within 10% {'ok' if ok_rss else 'FAIL'}, no 5xx {'ok' if ok_fuzz else 'FAIL'} |"
    )
    for line in storm.mismatches[:5] + storm.health_failures[:5]:
        print("  ", line)
    return 0 if ok_outputs and ok_health and ok_rss and ok_fuzz else 1


if __name__ == "__main__":
    sys.exit(main())
