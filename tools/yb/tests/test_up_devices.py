"""`yb up` and `yb profile` take the device settings; on a GPU `yb up` shares the device
among the engines it starts, on the CPU each takes what it can use, and `yb up` says what
that came to."""

from __future__ import annotations

from pathlib import Path

import pytest

from yb_core import config as config_module
from yb_core import events as ev
from yb_core.config import load_config
from yb_core.kv_spec import KVCacheSpec
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


def test_on_the_cpu_engines_are_sized_by_what_they_can_use(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def no_reading() -> int:
        raise AssertionError("free memory is not a size")

    monkeypatch.setattr(kv_sizing, "read_host_memory_available", no_reading)
    c, said = cluster(
        {"YB_MODEL__DEVICE": "cpu", "YB_DATA_DIR": str(tmp_path)}, Topology(prefill=2, decode=1)
    )
    c._share_gpu_memory()
    assert c.cfg.prefill.kv_memory_bytes == c.cfg.decode.kv_memory_bytes == 0
    assert not said
    env = c.service_env(c.process_specs()[-2])
    assert env["YB_DECODE__KV_SEQUENCES"] == env["YB_PREFILL__KV_SEQUENCES"] == "1"


class Announced:
    """What the launcher's watcher reports: the engines' announcements."""

    def __init__(self, ups: dict[str, ev.InstanceUp]) -> None:
        self.ups = ups

    def announcements(self) -> dict[str, ev.InstanceUp]:
        return dict(self.ups)


def test_yb_up_says_what_each_engine_took(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_sizing, "read_host_memory_available", lambda: 12 * GiB)
    c, _ = cluster({"YB_MODEL__DEVICE": "cpu"}, Topology(prefill=2, decode=1))
    spec = KVCacheSpec(parts=("k", "v"), heads=3, dim=64, dtype="float32", num_layers=30)
    page = spec.block_nbytes(64)

    def up(name: str, role: ev.Role, pages: int) -> ev.InstanceUp:
        return ev.InstanceUp(
            instance_id=name,
            role=role,
            host="h",
            kv_capacity_blocks=pages,
            kv_block_bytes=page,
            kv_spec=spec,
        )

    ups = {"prefill-0": up("prefill-0", "prefill", 128), "decode-0": up("decode-0", "decode", 256)}
    c.watcher = Announced(ups)  # type: ignore[assignment]
    assert c.kv_report() == []  # prefill-1 has not announced itself yet
    ups["prefill-1"] = up("prefill-1", "prefill", 128)
    ups["kvstore-0"] = ev.InstanceUp(instance_id="kvstore-0", role="kvstore", host="h")
    head, *lines = c.kv_report()
    assert head.startswith(
        "KV cache per engine (1.41 GiB in all; 12.0 GiB of memory still available;"
    )
    assert "YB_DECODE__KV_SEQUENCES" in head
    assert lines == [
        "  decode-0        256 pages =    16,384 tokens,      720 MiB",
        "  prefill-0       128 pages =     8,192 tokens,      360 MiB",
        "  prefill-1       128 pages =     8,192 tokens,      360 MiB",
        "  one token keeps 46,080 bytes (k and v of 3 x 64 float32 in each of 30 layers)",
    ]
    monkeypatch.setattr(kv_sizing, "read_host_memory_available", lambda: GiB)
    assert "1.0 GiB of memory still available" in c.kv_report()[0]


def test_on_cuda_the_engines_split_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_reading() -> int:
        raise AssertionError("host memory is not the budget on CUDA")

    monkeypatch.setattr(kv_sizing, "read_host_memory_available", no_reading)
    monkeypatch.setattr(config_module, "nvidia_gpu_visible", lambda: True)
    c, said = cluster({}, Topology(prefill=2, decode=2))
    assert c.cfg.model.block_size == 256  # auto, with a GPU visible
    c._share_gpu_memory()
    assert c.cfg.decode.gpu_memory_utilization == pytest.approx(0.9 / 4)
    assert c.cfg.prefill.gpu_memory_utilization == pytest.approx(0.9 / 4)
    assert c.cfg.decode.kv_memory_bytes == 0
    assert "share one GPU" in said[-1]


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


@pytest.mark.parametrize("family", ["falcon_h1 (hybrid recurrent)", "t5 (encoder)"])
def test_yb_up_refuses_a_family_it_cannot_compute_before_starting_anything(
    family: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from yb_testkit.checkpoints import refused_config_dir
    from yb_tools.cli import main

    model = refused_config_dir(family, tmp_path / "model")
    code = main(["up", "--model", str(model), "--data-dir", str(tmp_path / "data")])
    assert code == 2
    err = capsys.readouterr().err
    assert "unsupported model" in err and family.split()[0] in err
    assert family.split("(")[1].rstrip(")").split()[-1] in err  # what is missing
    assert not (tmp_path / "data" / "nats").exists()
    assert not (tmp_path / "data" / "cluster.json").exists()
