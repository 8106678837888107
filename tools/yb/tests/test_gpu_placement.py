"""Engine instances on their own GPUs (`yb_tools.placement`, `yb up --gpus`), and the
tensor-parallel degrees `yb up` is given (`--prefill-tp`, `--decode-tp`): placed and
checked before anything starts. This machine has no GPU: the GPUs are described to the
placement, and the refusals are the ones a user here gets."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from yb_core import config as config_module
from yb_core.config import load_config
from yb_tools.cli import main
from yb_tools.cli.launcher import Cluster, Topology
from yb_tools.placement import (
    Gpu,
    PlacementError,
    engines_per_gpu,
    machine_gpus,
    parse_gpus,
    place,
)

FOUR = [Gpu(i, "NVIDIA H200") for i in range(4)]


def test_each_instance_gets_its_own_gpus_as_many_as_its_degree() -> None:
    got = place([("prefill-0", 2), ("prefill-1", 1), ("decode-0", 1)], FOUR)
    assert got == {"prefill-0": [0, 1], "prefill-1": [2], "decode-0": [3]}
    assert engines_per_gpu(got) == {"prefill-0": 1, "prefill-1": 1, "decode-0": 1}
    # Chosen GPUs only, in the order given.
    assert place([("a", 1), ("b", 1)], FOUR, [3, 1]) == {"a": [3], "b": [1]}


def test_more_instances_than_gpus_share_them_and_split_their_memory() -> None:
    got = place([("prefill-0", 1), ("prefill-1", 1), ("decode-0", 1)], FOUR[:2])
    assert got == {"prefill-0": [0], "prefill-1": [1], "decode-0": [0]}
    assert engines_per_gpu(got) == {"prefill-0": 2, "prefill-1": 1, "decode-0": 2}
    # A wide instance never holds one GPU twice.
    assert place([("a", 1), ("b", 2)], FOUR[:2]) == {"a": [0], "b": [1, 0]}


def test_gpus_the_machine_lacks_are_refused_saying_what_is_there() -> None:
    with pytest.raises(PlacementError) as missing:
        place([("prefill-0", 1)], FOUR[:2], [0, 5])
    assert str(missing.value) == (
        "--gpus asks for GPU [5] but this machine has 2 GPUs: 0 (NVIDIA H200), 1 (NVIDIA H200)"
    )
    with pytest.raises(PlacementError) as wide:
        place([("prefill-0", 4)], FOUR, [0, 1])
    assert "prefill-0 spans 4 GPUs (tensor_parallel 4) but 2 are chosen (0, 1)" in str(wide.value)
    with pytest.raises(PlacementError, match="shows no NVIDIA GPU"):
        place([("prefill-0", 1)], [])


def _driver(root: Path, minors: dict[str, int]) -> None:
    """The NVIDIA driver's /proc entries of GPUs at these PCI addresses (with these
    device minors, which need not follow them)."""
    gpus = root / "proc" / "driver" / "nvidia" / "gpus"
    for i, (bus, minor) in enumerate(minors.items()):
        (gpus / bus).mkdir(parents=True)
        (gpus / bus / "information").write_text(
            f"Model: \t\t NVIDIA H200\nIRQ:   \t\t 1\nGPU UUID: \t GPU-{i}aaa\n"
            f"Device Minor: \t {minor}\n"
        )


def test_the_machine_gpus_come_from_the_driver_and_honour_cuda_visible_devices(
    tmp_path: Path,
) -> None:
    # Numbered in PCI order, as nvidia-smi and CUDA (PCI_BUS_ID) number them, whatever
    # the device minors say.
    _driver(tmp_path, {"0000:65:00.0": 0, "0000:17:00.0": 1})
    h200 = [Gpu(0, "NVIDIA H200", "GPU-1aaa"), Gpu(1, "NVIDIA H200", "GPU-0aaa")]

    def gpus(env: dict[str, str]) -> list[Gpu]:
        return machine_gpus(env, tmp_path, nvidia_smi=None)

    assert gpus({}) == h200
    assert gpus({"CUDA_VISIBLE_DEVICES": "1"}) == [h200[1]]
    assert gpus({"CUDA_VISIBLE_DEVICES": "GPU-0a,0"}) == [h200[1], h200[0]]  # UUID prefix
    # As CUDA reads it: the first entry that names no GPU hides the rest.
    assert gpus({"CUDA_VISIBLE_DEVICES": "0,7,1"}) == [h200[0]]
    assert gpus({"CUDA_VISIBLE_DEVICES": "GPU-,1"}) == []  # ambiguous
    assert gpus({"CUDA_VISIBLE_DEVICES": ""}) == gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    with pytest.raises(PlacementError, match="names a MIG instance"):
        gpus({"CUDA_VISIBLE_DEVICES": "MIG-4f1c"})
    assert machine_gpus({}, tmp_path / "nowhere", nvidia_smi=None) == []
    # Without the driver's /proc entries, its device nodes, numbered from 0 (a container
    # given GPU 3 alone sees it as GPU 0).
    (tmp_path / "container" / "dev").mkdir(parents=True)
    for node in ("nvidia3", "nvidiactl", "nvidia-uvm"):
        (tmp_path / "container" / "dev" / node).touch()
    assert machine_gpus({}, tmp_path / "container", nvidia_smi=None) == [Gpu(0)]
    assert parse_gpus("all") is None and parse_gpus("0,2") == [0, 2]
    with pytest.raises(ValueError):
        parse_gpus("0,0")


NVIDIA_SMI_L = """GPU 0: NVIDIA H200 (UUID: GPU-3b1f0c2e-1111-2222-3333-444455556666)
GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-9d2e4f6a-1111-2222-3333-444455556666)
  MIG 3g.40gb     Device  0: (UUID: MIG-5a6b7c8d-1111-2222-3333-444455556666)
"""


def test_nvidia_smi_names_the_gpus_first(tmp_path: Path) -> None:
    # A stand-in for nvidia-smi (there is no GPU here), run as the launcher runs it.
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n[ \"$1\" = -L ] || exit 9\ncat <<'EOF'\n{NVIDIA_SMI_L}EOF\n")
    smi.chmod(0o755)
    _driver(tmp_path, {"0000:17:00.0": 0})  # read only when nvidia-smi gives nothing
    got = machine_gpus({"CUDA_VISIBLE_DEVICES": "1,0"}, tmp_path, nvidia_smi=str(smi))
    assert [g.describe() for g in got] == ["1 (NVIDIA A100-SXM4-80GB)", "0 (NVIDIA H200)"]
    assert got[1].uuid == "GPU-3b1f0c2e-1111-2222-3333-444455556666"
    with pytest.raises(PlacementError) as missing:
        place([("prefill-0", 1)], got, [2])
    assert str(missing.value) == (
        "--gpus asks for GPU [2] but this machine has 2 GPUs: "
        "1 (NVIDIA A100-SXM4-80GB), 0 (NVIDIA H200)"
    )
    # Not installed, or failing (no driver loaded): the driver's entries are read.
    assert machine_gpus({}, tmp_path, nvidia_smi=str(tmp_path / "absent")) == [
        Gpu(0, "NVIDIA H200", "GPU-0aaa")
    ]
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed'; exit 9\n")
    assert machine_gpus({}, tmp_path, nvidia_smi=str(smi)) == [Gpu(0, "NVIDIA H200", "GPU-0aaa")]


def up_cluster(monkeypatch: pytest.MonkeyPatch, *argv: str) -> Cluster:
    """The cluster `yb up ARGV` would start, taken where it would start it."""
    from yb_tools import cli

    seen: list[Cluster] = []
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # the test run's handlers stay

    def stop_there(cluster: Cluster) -> None:
        seen.append(cluster)
        raise _Stop

    monkeypatch.setattr(Cluster, "check_device", stop_there)
    with pytest.raises(_Stop):
        cli.main(["up", *argv])
    return seen[0]


class _Stop(Exception):
    """Raised where `yb up` would check the devices, to stop it there."""


def test_the_degree_flags_reach_each_engines_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    c = up_cluster(
        monkeypatch, "--data-dir", str(tmp_path), "--prefill-tp", "4", "--decode-tp", "2"
    )
    assert c.cfg.tensor_parallel_of(c.cfg.prefill) == 4
    assert c.cfg.tensor_parallel_of(c.cfg.decode) == 2
    # What each engine process is started with: its role's degree.
    want = {"prefill": 4, "decode": 2}
    for spec in c.process_specs():
        if spec.role in want:
            engine = load_config(env=c.service_env(spec))
            got = engine.tensor_parallel_of(getattr(engine, spec.role))
            assert got == want[spec.role], spec.instance_id
    # Unset: the model's degree (1), for both roles.
    c = up_cluster(monkeypatch, "--data-dir", str(tmp_path))
    assert c.cfg.tensor_parallel_of(c.cfg.prefill) == c.cfg.tensor_parallel_of(c.cfg.decode) == 1
    assert c.gpus is None
    assert up_cluster(monkeypatch, "--data-dir", str(tmp_path), "--gpus", "2,0").gpus == [2, 0]


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefill-tp", "0"],
        ["--decode-tp", "-1"],
        ["--decode-tp", "two"],
        ["--gpus", "0,0"],
        ["--gpus", "first"],
    ],
)
def test_degrees_below_one_and_malformed_gpus_are_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["up", *argv])
    assert exited.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_each_engine_process_sees_only_its_gpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(config_module, "nvidia_gpu_visible", lambda: True)
    monkeypatch.setattr("yb_tools.cli.launcher.machine_gpus", lambda: FOUR[:2])
    said: list[str] = []
    cfg = load_config(env={"YB_DATA_DIR": str(tmp_path)})
    c = Cluster(cfg, Topology(prefill=2, decode=1), said.append)
    c.place_engines()
    assert c.devices == {"prefill-0": [0], "prefill-1": [1], "decode-0": [0]}
    specs = {s.instance_id: s for s in c.process_specs()}
    env = c.service_env(specs["prefill-0"])
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    # Numbered as nvidia-smi numbers them, and on CUDA, not `auto`, whatever was asked.
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["YB_MODEL__DEVICE"] == "cuda"
    assert float(env["YB_PREFILL__GPU_MEMORY_UTILIZATION"]) == pytest.approx(0.45)
    env = c.service_env(specs["prefill-1"])
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert float(env["YB_PREFILL__GPU_MEMORY_UTILIZATION"]) == pytest.approx(0.9)
    # The other services are not placed: they see what `yb up` sees.
    gateway = c.service_env(specs["gateway-0"])
    assert gateway.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert gateway["YB_MODEL__DEVICE"] == "auto"
    # Where each went, said once; KV memory split only on the shared GPU.
    assert said[0] == "GPUs: prefill-0 [0], prefill-1 [1], decode-0 [0]"
    c._share_gpu_memory()
    assert said[-1] == (
        "KV memory: engines sharing a GPU split gpu_memory_utilization: prefill-0 1/2, decode-0 1/2"
    )
    assert c.cfg.prefill.gpu_memory_utilization == pytest.approx(0.9)  # per engine, above


def test_tensor_parallel_instances_get_disjoint_gpus_through_the_launcher(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(config_module, "nvidia_gpu_visible", lambda: True)
    eight = [Gpu(i, "NVIDIA H200") for i in range(8)]
    monkeypatch.setattr("yb_tools.cli.launcher.machine_gpus", lambda: eight)
    cfg = load_config(
        env={"YB_DATA_DIR": str(tmp_path)},
        overrides={"prefill": {"tensor_parallel": 2}, "decode": {"tensor_parallel": 4}},
    )
    c = Cluster(cfg, Topology(prefill=2, decode=1), lambda _: None, gpus=[7, 6, 5, 4, 3, 2, 1, 0])
    c.place_engines()
    assert c.devices == {"prefill-0": [7, 6], "prefill-1": [5, 4], "decode-0": [3, 2, 1, 0]}
    specs = {s.instance_id: s for s in c.process_specs()}
    env = c.service_env(specs["decode-0"])
    assert env["CUDA_VISIBLE_DEVICES"] == "3,2,1,0"
    assert float(env["YB_DECODE__GPU_MEMORY_UTILIZATION"]) == pytest.approx(0.9)
    # One GPU short: refused, saying what was asked and what is there.
    from yb_engine.models import DeviceUnavailable

    c = Cluster(cfg, Topology(prefill=1, decode=1), lambda _: None, gpus=[0, 1, 2])
    with pytest.raises(DeviceUnavailable) as short:
        c.place_engines()
    assert str(short.value).startswith(
        "decode-0 spans 4 GPUs (tensor_parallel 4) but 3 are chosen (0, 1, 2); "
        "this machine has 8 GPUs: 0 (NVIDIA H200), 1 (NVIDIA H200)"
    )


def test_what_cannot_be_placed_is_refused_or_left_as_before(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from yb_engine.models import DeviceUnavailable

    monkeypatch.setattr(config_module, "nvidia_gpu_visible", lambda: True)
    monkeypatch.setattr("yb_tools.cli.launcher.machine_gpus", lambda: FOUR)

    def cluster(device: str, gpus: list[int] | None) -> tuple[Cluster, list[str]]:
        said: list[str] = []
        env = {"YB_DATA_DIR": str(tmp_path), "YB_MODEL__DEVICE": device}
        return Cluster(load_config(env=env), Topology(), said.append, gpus=gpus), said

    # `--device cuda:N` pins every engine to one GPU: nothing placed, `--gpus` refused.
    c, _ = cluster("cuda:1", None)
    c.place_engines()
    assert c.devices == {}
    with pytest.raises(DeviceUnavailable, match="pins every engine to one: use --device cuda"):
        cluster("cuda:1", [0])[0].place_engines()
    with pytest.raises(DeviceUnavailable, match=r"they run on the CPU .* has 4 GPUs"):
        cluster("cpu", [0])[0].place_engines()

    # MIG instances cannot be placed: left shared as before, unless `--gpus` asks.
    def mig() -> list[Gpu]:
        raise PlacementError("CUDA_VISIBLE_DEVICES='MIG-1' names a MIG instance (MIG-1)")

    monkeypatch.setattr("yb_tools.cli.launcher.machine_gpus", mig)
    c, said = cluster("cuda", None)
    c.place_engines()
    assert c.devices == {}
    assert said == ["GPUs not placed: CUDA_VISIBLE_DEVICES='MIG-1' names a MIG instance (MIG-1)"]
    c._share_gpu_memory()
    assert "3 engines share one GPU" in said[-1]
    with pytest.raises(DeviceUnavailable, match="MIG instance"):
        cluster("cuda", [0])[0].place_engines()


def test_gpus_asked_of_a_machine_without_one_are_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["up", "--gpus", "0,1", "--data-dir", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "--gpus places engines on GPUs, but they run on the CPU" in err
    assert "this machine shows no NVIDIA GPU" in err
    assert not (tmp_path / "cluster.json").exists()


def test_a_degree_the_model_cannot_take_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The tiny random model has 4 heads: three ranks cannot share them.
    code = main(["up", "--model", "tiny-random", "--prefill-tp", "3", "--data-dir", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "prefill at tensor_parallel 3: 4 attention heads cannot be cut 3 ways" in err
    assert not (tmp_path / "nats").exists()
