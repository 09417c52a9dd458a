"""Write a randomly initialised CosyVoice2 or CosyVoice3 model directory in exactly the official format.

    python -m async_cosyvoice.tools.make_random_model --preset tiny --out DIR --seed 0
    python -m async_cosyvoice.tools.make_random_model --preset cosyvoice3-0.5b --out DIR   # full-size CosyVoice3

The generator itself is `async_cosyvoice.random_model` (its docstring describes the files and presets).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from async_cosyvoice.random_model import PRESETS, make_random_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m async_cosyvoice.tools.make_random_model",
                                 description="Write a randomly initialised CosyVoice2 or CosyVoice3 model directory "
                                             "in the official format.")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", required=True, type=Path, help="directory to create")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    args = ap.parse_args(argv)
    try:
        path = make_random_model(args.preset, args.out, args.seed, overwrite=args.overwrite)
    except (FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
