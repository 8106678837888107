"""`yb up` and `yb profile` take the device settings, and `yb up` shares one KV budget
among the engines it starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from yb_core import config as config_module
from yb_core.config import load_config
from yb_engine import kv_sizing
from yb_tools.cli import _overrides, add_device_arguments
from yb_tools.cli.launcher import Cluster, Topology

GiB = 2**30


def parse(*argv: str) -> dict[str, object]:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    add_device_arguments(parser)
    return _overrides(parser.parse_args(["up", *argv]))


def test_device_and_dtype_flags_reach_the_model_section() -> None:
    assert parse() == {}
    overrides = parse("--device", "cuda:1", "--dtype", "float16")
    assert overrides == {"model": {"device": "cuda:1", "dtype": "float16"}}
    cfg = load_config(env={}, overrides=overrides)
    assert (cfg.model.device, cfg.model.dtype, cfg.model.block_size) == ("cuda:1", "float16", 256)
    assert load_config(env={}, overrides=parse("--device", "cpu")).model.block_size == 64
    with pytest.raises(SystemExit):
        parse("--dtype", "fp8")


def cluster(env: dict[str, str], topology: Topology) -> tuple[Cluster, list[str]]:
    said: list[str] = []
    return Cluster(load_config(env=env), topology, said.append), said


def test_on_the_cpu_each_engine_gets_an_equal_share_of_one_reading(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    readings = iter([12 * GiB, 1 * GiB])  # a second reading would be smaller
    monkeypatch.setattr(kv_sizing, "read_host_memory_available", lambda: next(readings))
    c, said = cluster(
        {"YB_MODEL__DEVICE": "cpu", "YB_DATA_DIR": str(tmp_path)}, Topology(prefill=2, decode=1)
    )
    c._share_kv_memory()
    share = int(12 * GiB * 0.3) // 3
    assert c.cfg.prefill.kv_memory_bytes == c.cfg.decode.kv_memory_bytes == share
    assert "3 engines" in said[-1]
    # every engine gets the number in its environment
    env = c.service_env(c.process_specs()[-2])
    assert env["YB_DECODE__KV_MEMORY_BYTES"] == str(share)
    assert env["YB_PREFILL__KV_MEMORY_BYTES"] == str(share)


def test_explicit_settings_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_sizing, "read_host_memory_available", lambda: 12 * GiB)
    c, _ = cluster(
        {
            "YB_MODEL__DEVICE": "cpu",
            "YB_DECODE__NUM_KV_PAGES": "100",
            "YB_PREFILL__CPU_KV_MEMORY_FRACTION": "0.6",
        },
        Topology(prefill=1, decode=1),
    )
    c._share_kv_memory()
    assert (c.cfg.decode.num_kv_pages, c.cfg.decode.kv_memory_bytes) == (100, 0)
    assert c.cfg.prefill.kv_memory_bytes == int(12 * GiB * 0.6) // 2


def test_on_cuda_the_engines_split_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_reading() -> int:
        raise AssertionError("host memory is not the budget on CUDA")

    monkeypatch.setattr(kv_sizing, "read_host_memory_available", no_reading)
    monkeypatch.setattr(config_module, "nvidia_gpu_visible", lambda: True)
    c, said = cluster({}, Topology(prefill=2, decode=2))
    assert c.cfg.model.block_size == 256  # auto, with a GPU visible
    c._share_kv_memory()
    assert c.cfg.decode.gpu_memory_utilization == pytest.approx(0.9 / 4)
    assert c.cfg.prefill.gpu_memory_utilization == pytest.approx(0.9 / 4)
    assert c.cfg.decode.kv_memory_bytes == 0
    assert "share one GPU" in said[-1]


def test_no_engines_no_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_sizing, "read_host_memory_available", lambda: 12 * GiB)
    c, said = cluster({"YB_MODEL__DEVICE": "cpu"}, Topology(prefill=0, decode=0))
    c._share_kv_memory()
    assert c.cfg.decode.kv_memory_bytes == 0 and not said


def test_status_warns_when_instances_disagree_on_the_block_size() -> None:
    from yb_core import events as ev
    from yb_tools.cli.status import InstanceRow, render

    def row(name: str, role: str, block_size: int, down: str = "") -> InstanceRow:
        up = ev.InstanceUp(
            instance_id=name,
            role=role,
            host="h",
            block_size=block_size,
            attention_backend="flash-attn-cute" if block_size == 256 else "torch-sdpa",
        )
        return InstanceRow(up=up, down=down, last_seen=0.0)

    agreeing = {
        "prefill-0": row("prefill-0", "prefill", 256),
        "decode-0": row("decode-0", "decode", 256),
        "gateway-0": row("gateway-0", "gateway", 0),
        "old": row("old", "decode", 64, down="stopped"),
    }
    text = render(agreeing, 15.0, 0.0)
    assert "WARNING" not in text
    assert "flash-attn-cute " in text  # the widest backend name fits its column
    disagreeing = {**agreeing, "kvstore-0": row("kvstore-0", "kvstore", 64)}
    warning = render(disagreeing, 15.0, 0.0).splitlines()[-1]
    assert warning.startswith("WARNING: instances disagree on model.block_size")
    assert "64: kvstore-0; 256: decode-0, prefill-0" in warning


def test_status_shows_each_prefill_group_and_whether_it_can_run() -> None:
    from yb_core import events as ev
    from yb_tools.cli.status import InstanceRow, render

    def stage(name: str, start: int, end: int, down: str = "") -> InstanceRow:
        up = ev.InstanceUp(
            instance_id=name,
            role="prefill",
            host="h",
            group="g0",
            layer_start=start,
            layer_end=end,
            num_layers=30,
            chunk_tokens=512,
        )
        return InstanceRow(up=up, down=down)

    rows = {"b": stage("b", 15, 30), "a": stage("a", 0, 15)}
    assert render(rows, 15.0, 0.0).splitlines()[-1] == (
        "prefill group g0: a [0, 15) -> b [15, 30) of 30 layers, 512-token chunks: runs"
    )
    rows["b"] = stage("b", 15, 30, down="no heartbeat")
    assert render(rows, 15.0, 0.0).splitlines()[-1] == (
        "prefill group g0: a [0, 15) of 30 layers, 512-token chunks: layers 15+ uncovered"
    )


def test_yb_up_refuses_cuda_on_a_machine_without_a_gpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from yb_tools.cli import main

    monkeypatch.setattr(config_module, "nvidia_gpu_visible", lambda: False)
    code = main(["up", "--device", "cuda", "--data-dir", str(tmp_path)])
    assert code == 2
    assert "model.device is 'cuda' but this machine shows no NVIDIA GPU" in capsys.readouterr().err
    assert not (tmp_path / "cluster.json").exists()
