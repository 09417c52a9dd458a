"""One server per device layout, the same gRPC benchmark against each; prints a table per layout.

    python benchmarks/placements.py --model-dir /models/CosyVoice2-0.5B --devices cuda:0,cuda:1,cuda:2,cuda:3
    python benchmarks/placements.py --devices cpu,cpu,cpu          # the tiny demo model on CPU

Layouts: the first device alone; `replicas` on all devices; `disaggregated` on all devices
(LLM on the first, token2wav on the others).
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile

from cosyvoice_cli import bench
from async_cosyvoice.config import Config
from grpc_async.server import ServerThread


def layouts(devices: list[str]) -> list[tuple[str, dict]]:
    return [(f"one device ({devices[0]})", {"devices": [devices[0]]}),
            (f"replicas x{len(devices)}", {"devices": devices, "placement": "replicas"}),
            (f"disaggregated: LLM + {len(devices) - 1} token2wav", {"devices": devices, "placement": "disaggregated"})]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir")
    ap.add_argument("--devices", default="cpu,cpu,cpu")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=60)
    args = ap.parse_args()
    devices = args.devices.split(",")
    levels = bench.parse_int_list(args.concurrency)
    for name, model in layouts(devices):
        with tempfile.TemporaryDirectory() as spk:
            config = Config.model_validate({"model": {"dir": args.model_dir, **model}, "speakers": {"dir": spk},
                                            "server": {"port": 0}})
            with ServerThread(config, ready_timeout=1800) as st:
                results = asyncio.run(bench.bench_grpc(
                    st.target, bench.Workload(tokens=args.tokens), levels, args.requests,
                    speaker=bench.SpeakerSpec(prompt_seconds=3.0)))
        print(f"\n== {name}")
        print(bench.format_table(results["levels"]))


if __name__ == "__main__":
    main()
