"""Serve engines and check the golden greedy continuation of stories260K through /generate.

    python benchmarks/golden_check.py --settings h200_c1_stories260k_ngram --arms ar,final [--gpu 0]

For each setting × arm: build (or find) the engine, serve it, send golden_greedy.json's prompt ids, compare the
continuation with llama2.c's own greedy output, time a 256-token decode, stop. Prints a markdown table."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time

import httpx

from specpilot_build.assemble.builder import build_engine
from specpilot_build.locations import mirror_dir
from specpilot_build.serve.process import serve, stop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--settings", default="cpu_c1_stories260k_ngram")
    parser.add_argument("--arms", default="ar,final")
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--port", type=int, default=30300)
    parser.add_argument("--ignore-hardware", action="store_true")
    args = parser.parse_args()
    golden = json.loads((mirror_dir() / "models/stories260K/golden_greedy.json").read_text())
    prompt, expected = golden["prompt_ids"], golden["sequence_ids"]
    rows = []
    for setting in args.settings.split(","):
        first_arm_output = None
        for arm in args.arms.split(","):
            engine = build_engine(setting, arm).engine
            serve(engine, args.port, args.gpu, ignore_hardware=args.ignore_hardware, quiet=True)
            try:
                url = f"http://127.0.0.1:{args.port}"
                out = httpx.post(
                    f"{url}/generate",
                    timeout=120,
                    json={
                        "input_ids": prompt,
                        "sampling_params": {"max_new_tokens": len(expected) - len(prompt), "temperature": 0},
                    },
                ).json()
                got = prompt + out["output_ids"]
                golden_ok = got == expected[: len(got)] and len(got) > len(prompt)
                started = time.perf_counter()
                timed = httpx.post(
                    f"{url}/generate",
                    timeout=120,
                    json={
                        "input_ids": prompt,
                        "sampling_params": {"max_new_tokens": 256, "temperature": 0, "ignore_eos": True},
                    },
                ).json()
                seconds = time.perf_counter() - started
                info = httpx.get(f"{url}/server_info").json()
            finally:
                stop(args.port)
            first_arm_output = first_arm_output or out["output_ids"]
            golden = (
                ("exact" if golden_ok else "DIFFERS")
                if engine.config["model"]["dtype"] == "float32"
                else "n/a (not the fp32 model)"
            )
            rows.append(
                (
                    setting,
                    arm,
                    engine.id[:12],
                    info.get("device"),
                    golden,
                    out["output_ids"] == first_arm_output,
                    len(out["output_ids"]),
                    timed["meta_info"]["completion_tokens"] / seconds,
                    info.get("avg_spec_accept_length"),
                    info.get("quantization"),
                )
            )
    print(f"\n{platform.node()}, {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC\n")
    print(
        "| setting | arm | engine | device | quantization | golden (llama2.c run.c) | same tokens as first arm "
        "| tokens | tok/s (256, one request) | accept length |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        accept = f"{r[8]:.2f}" if isinstance(r[8], (int, float)) else "-"
        print(
            f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[9] or '-'} | {r[4]} | {'yes' if r[5] else 'NO'} | {r[6]} | "
            f"{r[7]:.0f} | {accept} |"
        )


if __name__ == "__main__":
    main()
