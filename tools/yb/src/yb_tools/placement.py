"""Which GPUs each engine instance of a local cluster gets.

`yb up` gives every engine instance its own devices: a tensor-parallel instance of
degree N gets N distinct GPUs, and its process (and its ranks) sees only those
(`CUDA_VISIBLE_DEVICES`), so rank r runs on `cuda:r` of its own set. Instances take the
chosen GPUs (`--gpus`, every GPU the machine shows by default) in start order (prefill
instances, then decode), N at a time; when there are more instances than GPUs, the next
instance starts over at the first GPU, so engines share a GPU only when there are more
of them than GPUs, and each then gets its share of that GPU's memory
(`gpu_memory_utilization` divided by the engines on its busiest GPU). Sharing, not a
refusal, because the default cluster (two prefill instances and a decode instance) must
keep serving from a machine with one GPU.

Asking for a GPU the machine does not have, or for an instance wider than the GPUs
chosen, is refused before anything starts, with what the machine has.

GPU indices are `nvidia-smi`'s (PCI bus order); the engines are started with
`CUDA_DEVICE_ORDER=PCI_BUS_ID` so that CUDA numbers them the same way (its own default
puts the fastest first). Torch-free (the launcher stays light): the GPUs come from
`nvidia-smi -L`, else the NVIDIA driver's /proc entries, else /dev/nvidiaN, and
`CUDA_VISIBLE_DEVICES` is honoured as CUDA reads it (indices or `GPU-` UUIDs, up to the
first entry that names no GPU). A MIG instance cannot be placed: `machine_gpus` refuses
one named there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from yb_core.config import YbConfig

#: The longest `nvidia-smi -L` may take: it waits on the driver, which a wedged GPU can
#: hold up; past this the driver's /proc entries are read instead.
NVIDIA_SMI_TIMEOUT_S = 10.0

#: What every placed engine process gets beside its `CUDA_VISIBLE_DEVICES`, so that CUDA
#: numbers the GPUs as nvidia-smi, `--gpus` and the messages here do.
CUDA_ORDER_ENV = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


class PlacementError(ValueError):
    """The GPUs asked for are not there, or cannot be placed; the message says what is."""


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU as the machine numbers it (nvidia-smi's index), its model name and UUID
    when known."""

    index: int
    name: str = ""
    uuid: str = ""

    def describe(self) -> str:
        return f"{self.index} ({self.name})" if self.name else str(self.index)


def machine_gpus(
    env: Mapping[str, str] | None = None,
    root: Path = Path("/"),
    nvidia_smi: str | None = "nvidia-smi",
) -> list[Gpu]:
    """The NVIDIA GPUs this machine shows to this process, in index order: what
    `nvidia_smi -L` lists (None: not asked), else what the driver lists under `root`,
    less what `CUDA_VISIBLE_DEVICES` hides. Raises `PlacementError` when that variable
    names a MIG instance."""
    env = os.environ if env is None else env
    listed = nvidia_smi_gpus(nvidia_smi) if nvidia_smi else None
    gpus = driver_gpus(root) if listed is None else listed
    return visible_gpus(gpus, env.get("CUDA_VISIBLE_DEVICES"))


def nvidia_smi_gpus(command: str, timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> list[Gpu] | None:
    """The GPUs `command -L` lists; None when it is not installed, fails or hangs."""
    path = shutil.which(command)
    if path is None:
        return None
    try:
        done = subprocess.run(
            [path, "-L"], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_nvidia_smi(done.stdout) if done.returncode == 0 else None


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """`nvidia-smi -L`'s lines: `GPU 0: NVIDIA H200 (UUID: GPU-...)`. The indented MIG
    lines under a GPU are not GPUs of their own."""
    gpus = []
    for line in text.splitlines():
        if found := re.match(r"GPU (\d+): (.*?)(?: \(UUID: ([^)]*)\))?\s*$", line):
            gpus.append(Gpu(int(found[1]), found[2].strip(), found[3] or ""))
    return sorted(gpus, key=lambda g: g.index)


def driver_gpus(root: Path = Path("/")) -> list[Gpu]:
    """The GPUs the driver lists: /proc/driver/nvidia/gpus has one entry per GPU,
    named by its PCI address, so their order is nvidia-smi's; without it (no driver
    /proc), one per /dev/nvidiaN node in minor order. Numbered by position, as nvidia-smi
    and CUDA number them (in a container given GPU 3 alone, that GPU is 0)."""
    found: list[Gpu] = []
    driver = root / "proc" / "driver" / "nvidia" / "gpus"
    try:
        entries = sorted(driver.iterdir())
    except OSError:
        entries = []
    for entry in entries:
        fields: dict[str, str] = {}
        try:
            for line in (entry / "information").read_text().splitlines():
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
        except OSError:
            pass
        found.append(Gpu(len(found), fields.get("Model", ""), fields.get("GPU UUID", "")))
    if found:
        return found
    try:
        minors = sorted(
            int(node.name.removeprefix("nvidia"))
            for node in (root / "dev").iterdir()
            if re.fullmatch(r"nvidia\d+", node.name)
        )
    except OSError:
        minors = []
    return [Gpu(i) for i in range(len(minors))]


def visible_gpus(gpus: Sequence[Gpu], visible: str | None) -> list[Gpu]:
    """`gpus` as a process with `CUDA_VISIBLE_DEVICES=visible` sees them (None: all).
    CUDA's rule: entries are indices or (prefixes of) `GPU-` UUIDs, and the first one
    that names no GPU hides itself and every one after it ("", "-1": none)."""
    if visible is None:
        return list(gpus)
    by_index = {g.index: g for g in gpus}
    shown: list[Gpu] = []
    for entry in (part.strip() for part in visible.split(",")):
        if entry.startswith("MIG-"):
            raise PlacementError(
                f"CUDA_VISIBLE_DEVICES={visible!r} names a MIG instance ({entry}): yb up "
                "places whole GPUs; name GPUs there by index or UUID"
            )
        if entry.isdigit():
            gpu = by_index.get(int(entry))
        else:
            matches = [g for g in gpus if g.uuid and entry and g.uuid.startswith(entry)]
            gpu = matches[0] if len(matches) == 1 else None
        if gpu is None:
            break
        if gpu not in shown:
            shown.append(gpu)
    return shown


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
    start order; `chosen` the GPU indices to use (None: every one of `gpus`). Raises
    `PlacementError` for a chosen GPU not among `gpus`, for no GPU at all, and for an
    instance wider than the GPUs chosen."""
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


def place_engines(
    cfg: YbConfig,
    engines: Sequence[tuple[str, str]],
    chosen: Sequence[int] | None,
    gpus: Callable[[], list[Gpu]],
    say: Callable[[str], None],
) -> dict[str, list[int]]:
    """`yb up`'s placement: `engines` are (instance id, role) in start order, `chosen`
    is `--gpus` (None: not given), `gpus` reads the machine's. Each engine gets its own
    GPUs where they run on CUDA (`model.device` auto or cuda); none (`{}`) on the CPU,
    under `cuda:N` (every engine pinned to one) and where `CUDA_VISIBLE_DEVICES` names
    MIG instances (said): there they share what they see. Raises `PlacementError` for
    GPUs the machine does not have, and for `--gpus` where nothing is placed."""
    device = cfg.model.device
    placing = cfg.model.cuda_expected() and device in ("auto", "cuda")
    if not placing and chosen is None:
        return {}
    try:
        have = gpus()
    except PlacementError as exc:
        if chosen is not None:
            raise
        say(f"GPUs not placed: {exc}")
        return {}
    if not cfg.model.cuda_expected():
        raise PlacementError(
            f"--gpus places engines on GPUs, but they run on the CPU (model.device "
            f"{device!r}): {describe_machine(have)}"
        )
    if not placing:
        raise PlacementError(
            f"--gpus places each engine on its own GPUs; model.device {device!r} pins "
            "every engine to one: use --device cuda"
        )
    sections = {"prefill": cfg.prefill, "decode": cfg.decode}
    degrees = [(name, cfg.tensor_parallel_of(sections[role])) for name, role in engines]
    try:
        placed = place(degrees, have, chosen)
    except PlacementError as exc:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise PlacementError(
            f"{exc}" if visible is None else f"{exc} (CUDA_VISIBLE_DEVICES={visible!r})"
        ) from None
    say("GPUs: " + ", ".join(f"{name} {d}" for name, d in placed.items()))
    return placed


def engine_env(
    cfg: YbConfig, role: str, instance: str, placement: Mapping[str, Sequence[int]]
) -> dict[str, str]:
    """What a placed engine process is started with: its own GPUs only, numbered as
    nvidia-smi numbers them (rank r runs on `cuda:r` of them), `model.device` `cuda`
    (not `auto`: an engine given GPUs must not serve from the CPU because its torch
    cannot reach them), and its share of its busiest GPU's memory (unless its section
    sizes its KV explicitly)."""
    env = {
        **CUDA_ORDER_ENV,
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, placement[instance])),
        "YB_MODEL__DEVICE": "cuda",
    }
    section = cfg.prefill if role == "prefill" else cfg.decode
    if not (section.num_kv_pages or section.kv_memory_bytes):
        share = engines_per_gpu(placement)[instance]
        env[f"YB_{role.upper()}__GPU_MEMORY_UTILIZATION"] = str(
            section.gpu_memory_utilization / share
        )
    return env
