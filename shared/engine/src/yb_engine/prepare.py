"""`python -m yb_engine.prepare [--config FILE]`: convert and cache the configured model once.

The entry point for an image that has the engine but not the `yb` tool (the compose
`model-init` service runs it before any service starts). `yb prepare` runs the same
`prepare_model`. Configuration comes from `--config`, `$YB_CONFIG` and `YB_*` variables,
as for every service; the model goes to `YbConfig.model_cache_dir()`.

It also checks that the model can be cut as configured: each role's tensor-parallel
degree (`prefill.tensor_parallel`, `decode.tensor_parallel`, else
`model.tensor_parallel`) must divide its heads as `yb_engine.tensor_parallel` requires,
on a device that runs it.

Exit status: 0 once the model is ready, 2 on a configuration error, a model no
registered family computes (the message names the family and what is missing) or a
degree it cannot take (the message says why), 1 when the model cannot be prepared (the
message says why).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from yb_core.config import ConfigError, YbConfig, load_config
from yb_core.model_files import TINY_RANDOM
from yb_engine.models import resolve_model_dir

if TYPE_CHECKING:
    from yb_engine.architecture import ArchConfig


def prepare_model(cfg: YbConfig, say: Callable[[str], None]) -> Path | None:
    """Convert the configured model into its cache directory unless it is there already,
    and return the directory engines load; None for the tiny random model, which each
    engine builds in memory. Safe to run concurrently with other preparers (the
    conversion takes a file lock and publishes by rename)."""
    if cfg.model.source == TINY_RANDOM:
        from yb_engine.loader import tiny_random_model

        check_degrees(cfg, tiny_random_model().config)
        say("the tiny random model is built in memory by each engine: nothing to prepare")
        return None
    started = time.monotonic()
    path = resolve_model_dir(cfg.model, cfg.model_cache_dir(), say)
    if path is not None:
        from yb_engine.loader import check_supported

        arch = check_supported(path)
        check_degrees(cfg, arch)
        say(f"family {arch.family} ({arch.model_type}), KV per token: {_kv_words(arch)}")
    say(f"model {cfg.model.name} ready at {path} ({time.monotonic() - started:.1f}s)")
    return path


class UnsupportedDegree(ValueError):
    """A role's tensor-parallel degree is one the model (or the device) cannot take."""


def check_degrees(cfg: YbConfig, arch: ArchConfig) -> None:
    """Raise `UnsupportedDegree` unless each role's degree can cut `arch`."""
    import torch

    from yb_engine.tensor_parallel import check_degree
    from yb_engine.tp_instance import check_device

    device = torch.device("cuda" if cfg.model.cuda_expected() else "cpu")
    for role, section in (("prefill", cfg.prefill), ("decode", cfg.decode)):
        n = cfg.tensor_parallel_of(section)
        why = check_degree(arch, n) or check_device(device, n)
        if why is not None:
            raise UnsupportedDegree(f"{role} at tensor_parallel {n}: {why}")


def _kv_words(arch: ArchConfig) -> str:
    parts, heads, dim = arch.kv_parts
    return f"{' and '.join(parts)} of {heads} x {dim} numbers in each of {arch.num_layers} layers"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m yb_engine.prepare`."""
    parser = argparse.ArgumentParser(
        prog="python -m yb_engine.prepare",
        description="Convert and cache the configured model once (YB_MODEL__* variables).",
    )
    parser.add_argument("--config", help="config file (TOML, YAML or JSON); default $YB_CONFIG")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"prepare: {exc}", file=sys.stderr)
        return 2
    from yb_engine.architecture import UnsupportedModelError

    try:
        prepare_model(cfg, lambda line: print(f"[prepare] {line}", flush=True))
    except UnsupportedModelError as exc:
        print(f"prepare: unsupported model: {exc}", file=sys.stderr)
        return 2
    except UnsupportedDegree as exc:
        print(f"prepare: unsupported tensor-parallel degree: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"prepare: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
