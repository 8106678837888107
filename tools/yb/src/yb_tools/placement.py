"""Which GPUs each engine instance of a local cluster gets.

`yb up` gives every engine instance its own devices: a tensor-parallel instance of
degree N gets N distinct GPUs, and its process (and its ranks) sees only those
(`CUDA_VISIBLE_DEVICES`), so rank r runs on `cuda:r` of its own set. Instances take the
chosen GPUs (`--gpus`, every GPU the machine shows by default) in order, N at a time;
when there are more instances than GPUs, the next instance starts over at the first
GPU, so engines share a GPU only when there are more of them than GPUs, and each
then gets its share of that GPU's memory (`gpu_memory_utilization` divided by the
engines on its busiest GPU).

Asking for a GPU the machine does not have, or for an instance wider than the GPUs
chosen, is refused before anything starts, with what the machine has.

Torch-free (the launcher stays light): the GPUs are read from the NVIDIA driver's
/proc entries, else /dev/nvidiaN, and `CUDA_VISIBLE_DEVICES` is honoured.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


class PlacementError(ValueError):
    """The GPUs asked for are not there; the message says what is."""


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU as the machine numbers it, and its model name when known."""

    index: int
    name: str = ""

    def describe(self) -> str:
        return f"{self.index} ({self.name})" if self.name else str(self.index)


def machine_gpus(env: Mapping[str, str] | None = None, root: Path = Path("/")) -> list[Gpu]:
    """The NVIDIA GPUs this machine shows to this process, in index order."""
    env = os.environ if env is None else env
    found: dict[int, str] = {}
    driver = root / "proc" / "driver" / "nvidia" / "gpus"
    try:
        entries = sorted(driver.iterdir())
    except OSError:
        entries = []
    for i, entry in enumerate(entries):
        name = ""
        try:
            for line in (entry / "information").read_text().splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "Model":
                    name = value.strip()
                elif key.strip() == "Device Minor" and value.strip().isdigit():
                    i = int(value.strip())
        except OSError:
            pass
        found[i] = name
    if not found:
        for node in (root / "dev").glob("nvidia[0-9]*"):
            if re.fullmatch(r"nvidia\d+", node.name):
                found[int(node.name.removeprefix("nvidia"))] = ""
    gpus = [Gpu(i, found[i]) for i in sorted(found)]
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        if not wanted or wanted == ["-1"]:
            return []
        if all(v.isdigit() for v in wanted):
            by_index = {g.index: g for g in gpus}
            gpus = [by_index[int(v)] for v in wanted if int(v) in by_index]
    return gpus


def parse_gpus(text: str) -> list[int] | None:
    """`--gpus`: `all` (None), or GPU indices, comma-separated."""
    if text.strip() == "all":
        return None
    try:
        chosen = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--gpus {text!r}: GPU indices like 0,1,3, or all") from None
    if len(set(chosen)) != len(chosen) or any(i < 0 for i in chosen):
        raise ValueError(f"--gpus {text!r}: each GPU once, indices from 0")
    return chosen


def describe_machine(gpus: Sequence[Gpu]) -> str:
    """What the machine has, in words."""
    if not gpus:
        return "this machine shows no NVIDIA GPU"
    listed = ", ".join(g.describe() for g in gpus)
    return f"this machine has {len(gpus)} GPU{'s' if len(gpus) > 1 else ''}: {listed}"


def place(
    instances: Sequence[tuple[str, int]],
    gpus: Sequence[Gpu],
    chosen: Sequence[int] | None = None,
) -> dict[str, list[int]]:
    """Each instance's GPUs: `instances` are (instance id, tensor-parallel degree) in
    start order; `chosen` the GPU indices to use (None: every one of `gpus`)."""
    have = [g.index for g in gpus]
    if chosen is None:
        chosen = have
    missing = [i for i in chosen if i not in have]
    if missing:
        raise PlacementError(f"--gpus asks for GPU {missing} but {describe_machine(gpus)}")
    if not chosen:
        raise PlacementError(f"no GPU to place the engines on: {describe_machine(gpus)}")
    out: dict[str, list[int]] = {}
    at = 0
    for instance, degree in instances:
        if degree > len(chosen):
            raise PlacementError(
                f"{instance} spans {degree} GPUs (tensor_parallel {degree}) but "
                f"{len(chosen)} {'are' if len(chosen) > 1 else 'is'} chosen "
                f"({', '.join(map(str, chosen))}); {describe_machine(gpus)}"
            )
        out[instance] = [chosen[(at + k) % len(chosen)] for k in range(degree)]
        at = (at + degree) % len(chosen)
    return out


def engines_per_gpu(placement: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """For each instance, how many instances share its busiest GPU (its memory share)."""
    count: dict[int, int] = {}
    for devices in placement.values():
        for d in devices:
            count[d] = count.get(d, 0) + 1
    return {name: max(count[d] for d in devices) for name, devices in placement.items()}
