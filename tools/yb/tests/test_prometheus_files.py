"""The Prometheus files `yb up` keeps: the file_sd targets and the scrape config.

The fold is driven by hand; the watcher follows a real nats-server's instance stream
and rewrites a real file; the scrape config is checked by `promtool` where it is
installed.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from yb_core import events as ev
from yb_core.bus import Bus
from yb_core.config import NatsConfig, load_config
from yb_tools.cli.cluster_watch import ClusterWatcher
from yb_tools.cli.launcher import Cluster, Topology
from yb_tools.cli.prometheus_files import (
    ScrapeTarget,
    TargetFold,
    file_sd_groups,
    read_file_sd,
    scrape_config,
    write_file_sd,
    write_scrape_config,
)
from yb_tools.natsserver import NatsServer

WAIT_S = 30.0

PREFILL = ScrapeTarget(
    instance="prefill-0", role="prefill", host="host-0", address="127.0.0.1:9101"
)
GATEWAY = ScrapeTarget(
    instance="gateway-0", role="gateway", host="host-0", address="127.0.0.1:8000"
)


def up(target: ScrapeTarget, at: float) -> ev.InstanceUp:
    return ev.InstanceUp(
        instance_id=target.instance,
        role=target.role,  # type: ignore[arg-type]
        host=target.host,
        metrics_address=target.address,
        time=at,
    )


def test_file_sd_has_one_labelled_group_per_target(tmp_path: Path) -> None:
    assert file_sd_groups([PREFILL, GATEWAY]) == [
        {
            "targets": ["127.0.0.1:8000"],
            "labels": {"role": "gateway", "instance": "gateway-0", "host": "host-0"},
        },
        {
            "targets": ["127.0.0.1:9101"],
            "labels": {"role": "prefill", "instance": "prefill-0", "host": "host-0"},
        },
    ]
    path = tmp_path / "targets.json"
    write_file_sd(path, [PREFILL, GATEWAY])
    assert read_file_sd(path) == [GATEWAY, PREFILL]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    write_file_sd(path, [])
    assert json.loads(path.read_text()) == []
    assert [p.name for p in tmp_path.iterdir()] == ["targets.json"]  # no temp file left


def test_scrape_config_reads_the_token_from_its_file(tmp_path: Path) -> None:
    token = tmp_path / "metrics_token"
    token.write_text("s3cret-token\n")
    targets = tmp_path / "targets.json"
    write_file_sd(targets, [PREFILL])
    config = scrape_config(targets, token, scrape_interval_s=0.5)
    path = tmp_path / "prometheus.yml"
    write_scrape_config(path, config, header="first line\nsecond line")
    text = path.read_text()
    assert text.startswith("# first line\n# second line\n")
    assert "s3cret" not in text
    loaded = yaml.safe_load(text)
    assert loaded["global"]["scrape_interval"] == "500ms"
    (job,) = loaded["scrape_configs"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": str(token)}
    assert job["file_sd_configs"][0]["files"] == [str(targets)]
    assert scrape_config(targets, token)["global"]["scrape_interval"] == "5s"
    with pytest.raises(ValueError):
        scrape_config(targets, token, scrape_interval_s=0)

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (it comes with Debian's prometheus)")
    result = subprocess.run(
        [promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_fold_scrapes_only_live_processes_announced_since_they_started() -> None:
    fold = TargetFold()
    fold.apply(up(PREFILL, at=100.0))
    fold.apply(up(GATEWAY, at=100.0))
    fold.apply(ev.InstanceUp(instance_id="kvstore-0", role="kvstore", host="host-0", time=100.0))
    fold.apply(ev.LoadReport(instance_id="prefill-0", role="prefill", time=101.0))
    # kvstore-0 announced no metrics listener; gateway-0's process is not running.
    assert fold.targets({"prefill-0": 50.0, "kvstore-0": 50.0}) == [PREFILL]
    # A process started after the announcement: that was an earlier process's.
    assert fold.targets({"prefill-0": 150.0}) == []
    moved = ScrapeTarget("prefill-0", "prefill", "host-0", "127.0.0.1:9200")
    fold.apply(up(moved, at=160.0))
    assert fold.targets({"prefill-0": 150.0}) == [moved]
    fold.apply(ev.InstanceDown(instance_id="prefill-0", reason="stopped", time=170.0))
    assert fold.targets({"prefill-0": 150.0, "gateway-0": 50.0}) == [GATEWAY]


async def _wait_for(path: Path, expected: list[ScrapeTarget]) -> None:
    deadline = time.monotonic() + WAIT_S
    found: list[ScrapeTarget] = []
    while time.monotonic() < deadline:
        try:
            found = read_file_sd(path)
        except FileNotFoundError:
            found = []
        if found == expected:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} holds {found}, not {expected}")


async def test_watcher_follows_the_instance_stream(
    nats_config: NatsConfig, bus: Bus, tmp_path: Path
) -> None:
    path = tmp_path / "prometheus" / "targets.json"
    running = {"prefill-0": time.time() - 1.0, "gateway-0": time.time() - 1.0}
    watcher = ClusterWatcher(nats_config, path, lambda: dict(running))
    watcher.start()
    try:
        assert read_file_sd(path) == []
        await bus.publish(up(PREFILL, at=time.time()))
        await _wait_for(path, [PREFILL])
        await bus.publish(up(GATEWAY, at=time.time()))
        await _wait_for(path, [GATEWAY, PREFILL])
        # A process that exits leaves, whether or not it said goodbye.
        del running["gateway-0"]
        await _wait_for(path, [PREFILL])
        await bus.publish(ev.InstanceDown(instance_id="prefill-0", time=time.time()))
        await _wait_for(path, [])
        await bus.publish(up(PREFILL, at=time.time()))
        await _wait_for(path, [PREFILL])
    finally:
        await asyncio.to_thread(watcher.stop)
    assert read_file_sd(path) == []
    await asyncio.to_thread(watcher.stop)  # twice is fine


async def test_watcher_tells_who_announced_and_publishes_verdicts(
    nats_config: NatsConfig, bus: Bus, tmp_path: Path
) -> None:
    # A process counts as announced only by an announcement made since it started.
    started = time.time()
    running = {"prefill-0": started, "gateway-0": started}
    await bus.publish(up(GATEWAY, at=started - 60))  # an earlier process's
    watcher = ClusterWatcher(
        nats_config, tmp_path / "targets.json", lambda: dict(running), verdict_timeout_s=WAIT_S
    )
    watcher.start()
    try:
        await bus.publish(up(PREFILL, at=time.time()))
        await _wait_for(tmp_path / "targets.json", [PREFILL])
        assert watcher.announced() == {"prefill-0"}
        since = await bus.last_sequence()
        await asyncio.to_thread(
            watcher.declare_down, "prefill-0", "its process exited with signal SIGKILL"
        )
        reader = await bus.read_ordered(ev.instance_down_subject("prefill-0"), start_seq=since)
        try:
            item = await reader.next(timeout_s=WAIT_S)
        finally:
            await reader.close()
        assert item is not None
        assert item.event == ev.InstanceDown(
            instance_id="prefill-0",
            reason="its process exited with signal SIGKILL",
            time=item.event.time,
        )
        await _wait_for(tmp_path / "targets.json", [])  # the verdict ends its target too
    finally:
        await asyncio.to_thread(watcher.stop)


async def test_watcher_confirms_an_announcement_from_the_log_itself(
    nats_config: NatsConfig, bus: Bus, tmp_path: Path
) -> None:
    # The instance stream the watcher follows is a copy of the log, a moment behind:
    # when a child exits before the copy showed its announcement, the supervisor asks
    # the log, which holds it as soon as the publish was acknowledged.
    started = time.time()
    running = {"prefill-0": started}
    watcher = ClusterWatcher(nats_config, tmp_path / "targets.json", lambda: dict(running))
    watcher.start()
    try:
        await bus.publish(up(PREFILL, at=time.time()))
        await _wait_for(tmp_path / "targets.json", [PREFILL])  # connected and following
        decode = ScrapeTarget(
            instance="decode-0", role="decode", host="host-0", address="127.0.0.1:9102"
        )
        await bus.publish(up(decode, at=time.time()))
        confirm = watcher.confirm_announced
        assert await asyncio.to_thread(confirm, "decode-0", started, WAIT_S)
        # An announcement older than the process is an earlier process's; none at all.
        assert not await asyncio.to_thread(confirm, "decode-0", time.time() + 60)
        assert not await asyncio.to_thread(confirm, "decode-9", started)
    finally:
        await asyncio.to_thread(watcher.stop)
    assert not watcher.confirm_announced("decode-0", started)  # stopped: cannot tell


def test_launcher_keeps_an_inline_token_out_of_the_config(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    token = "inline-metrics-token-value"
    cfg = load_config(
        env={},
        overrides={
            "data_dir": str(tmp_path),
            "nats": {"url": nats_server.url},
            "telemetry": {"metrics_token": token},
        },
    )
    said: list[str] = []
    cluster = Cluster(cfg, Topology(), said.append)
    config_path, targets_path = cluster.write_prometheus_files()
    try:
        assert token not in config_path.read_text()
        (job,) = yaml.safe_load(config_path.read_text())["scrape_configs"]
        token_file = Path(job["authorization"]["credentials_file"])
        assert token_file.read_text().strip() == token
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert job["file_sd_configs"][0]["files"] == [str(targets_path)]
        assert read_file_sd(targets_path) == []
        hint = "\n".join(cluster.access_hint())
        assert f"prometheus --config.file={config_path}" in hint
    finally:
        cluster.stop()
    assert cluster.watcher is None
