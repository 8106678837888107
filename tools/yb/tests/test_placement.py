"""Engine instances on their own GPUs (`yb_tools.placement`, `yb up --gpus`), and the
tensor-parallel degrees `yb up` is given (`--prefill-tp`, `--decode-tp`): placed and
checked before anything starts. This machine has no GPU: the GPUs are described to the
placement, and the refusals are the ones a user here gets."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from yb_core import config as config_module
from yb_core.config import load_config
from yb_tools.cli import _overrides, main
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


def test_the_machine_gpus_come_from_the_driver_and_honour_cuda_visible_devices(
    tmp_path: Path,
) -> None:
    gpus = tmp_path / "proc" / "driver" / "nvidia" / "gpus"
    for minor, bus in ((0, "0000:17:00.0"), (1, "0000:65:00.0")):
        (gpus / bus).mkdir(parents=True)
        (gpus / bus / "information").write_text(
            f"Model: \t\t NVIDIA H200\nIRQ:   \t\t 1\nDevice Minor: \t {minor}\n"
        )
    assert machine_gpus({}, tmp_path) == [Gpu(0, "NVIDIA H200"), Gpu(1, "NVIDIA H200")]
    assert machine_gpus({"CUDA_VISIBLE_DEVICES": "1"}, tmp_path) == [Gpu(1, "NVIDIA H200")]
    assert machine_gpus({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == []
    assert machine_gpus({}, tmp_path / "nowhere") == []
    assert parse_gpus("all") is None and parse_gpus("0,2") == [0, 2]
    with pytest.raises(ValueError):
        parse_gpus("0,0")


def test_the_degree_flags_reach_each_role() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("--prefill-tp", type=int)
    parser.add_argument("--decode-tp", type=int)
    args = parser.parse_args(["up", "--prefill-tp", "4", "--decode-tp", "2"])
    cfg = load_config(env={}, overrides=_overrides(args))
    assert cfg.tensor_parallel_of(cfg.prefill) == 4
    assert cfg.tensor_parallel_of(cfg.decode) == 2
    assert load_config(env={}).tensor_parallel_of(load_config(env={}).decode) == 1
    with pytest.raises(SystemExit):
        main(["up", "--prefill-tp", "0"])


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
    assert float(env["YB_PREFILL__GPU_MEMORY_UTILIZATION"]) == pytest.approx(0.45)
    env = c.service_env(specs["prefill-1"])
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert float(env["YB_PREFILL__GPU_MEMORY_UTILIZATION"]) == pytest.approx(0.9)
    # The other services are not placed: they see what `yb up` sees.
    gateway = c.service_env(specs["gateway-0"])
    assert gateway.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


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
