"""`yb profile`: fit the conductor's cost model on this machine's real runner.

    yb profile [--quick] [--out FILE] [--model SOURCE] [--threads N] [--network-gbps X]
               [--device auto|cpu|cuda|cuda:N] [--dtype auto|float32|bfloat16|float16]

Writes the versioned cost-model file the conductor loads (`conductor.cost_model =
FILE`, or `YB_CONDUCTOR__COST_MODEL=FILE`). `--quick` measures a small grid in well
under two minutes; without it the grid is larger and the fit tighter.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from yb_core.config import YbConfig


def add_parser(sub: Any) -> None:
    """Register `yb profile`."""
    from yb_tools.cli import add_device_arguments

    p = sub.add_parser("profile", help="fit the conductor's cost model on this machine")
    p.add_argument("--quick", action="store_true", help="a small grid (under two minutes)")
    p.add_argument("--out", help="cost model file (default: <data dir>/cost_model.json)")
    p.add_argument("--model", help="'default', 'tiny-random' or a local HF model directory")
    p.add_argument("--data-dir", help="where the model cache and the output live")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    add_device_arguments(p)
    p.add_argument(
        "--network-gbps",
        type=float,
        default=None,
        help="bandwidth between hosts, GB/s (not measurable from one host)",
    )


def run(cfg: YbConfig, args: argparse.Namespace) -> int:
    """`yb profile`."""
    from yb_conductor.cost_model import DEFAULT, save_cost_model
    from yb_engine.models import DeviceUnavailable
    from yb_tools.profiling import profile_engine

    started = time.monotonic()
    try:
        model = profile_engine(
            cfg,
            quick=args.quick,
            threads=args.threads,
            network_gbps=args.network_gbps or DEFAULT.transfer.dram_remote_gbps,
            progress=lambda m: print(f"[yb profile] {m}", flush=True),
        )
    except DeviceUnavailable as exc:
        print(f"yb profile: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else cfg.resolved_data_dir() / "cost_model.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    save_cost_model(model, out)
    p, d = model.prefill, model.decode
    print(
        f"prefill_s = {p.base_s:.4g} + {p.per_token_s:.4g}*new"
        f" + {p.per_pair_s:.4g}*new*(cached+new/2)"
        f"   (mean error {model.fit.prefill_mean_rel_error:.1%})"
    )
    print(
        f"tbt_s     = {d.base_s:.4g} + {d.per_seq_s:.4g}*batch"
        f" + {d.per_context_token_s:.4g}*context"
        f"   (mean error {model.fit.decode_mean_rel_error:.1%})"
    )
    print(f"wrote {out} in {time.monotonic() - started:.0f}s")
    print(f"use it with: YB_CONDUCTOR__COST_MODEL={out}")
    return 0
