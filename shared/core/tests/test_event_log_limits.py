"""The event log's limits: bounded by bytes as well as age, discarding the oldest,
brought to the configured limits when it exists with others, and sized by `yb up`
from the data dir's disk."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest

from yb_core import events as ev
from yb_core.bus import Bus
from yb_core.config import (
    DEFAULT_EVENT_LOG_BYTES,
    MIN_EVENT_LOG_BYTES,
    ConfigError,
    NatsConfig,
    YbConfig,
    load_config,
)
from yb_tools.cli.launcher import Cluster, Topology


async def test_the_stream_is_bounded_by_bytes_and_a_full_log_still_takes_writes(
    bus: Bus, nats_config: NatsConfig
) -> None:
    # The fixture's stream has the default limit; a service configured smaller
    # brings it down (the existing stream is updated, not refused).
    assert (await bus.log_extent()).max_bytes == DEFAULT_EVENT_LOG_BYTES
    small = msgspec.structs.replace(nats_config, max_bytes=MIN_EVENT_LOG_BYTES)
    other = await Bus.connect(small, "small", timeout_s=10)
    try:
        info = await other.ensure_stream()
        assert info.config.max_bytes == MIN_EVENT_LOG_BYTES
        written = 0
        last = 0
        while written < 3 * MIN_EVENT_LOG_BYTES:
            beat = ev.LoadReport(instance_id="filler", role="gateway")
            last = await other.publish(beat)  # never refused: the oldest go instead
            written += len(ev.encode_event(beat))
        extent = await other.log_extent()
        assert extent.last_seq == last
        assert extent.trimmed and extent.bytes <= MIN_EVENT_LOG_BYTES
        assert not extent.reaches(1) and extent.reaches(extent.first_seq)
    finally:
        await other.close()


def test_a_limit_below_the_minimum_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"nats.max_bytes 1000 is below 65536"):
        load_config(env={"YB_NATS__MAX_BYTES": "1000"})
    assert load_config(env={}).nats.event_log_bytes() == DEFAULT_EVENT_LOG_BYTES
    assert NatsConfig(max_bytes=123456).event_log_bytes() == 123456


def test_yb_up_sizes_the_log_from_the_data_dirs_disk(tmp_path: Path) -> None:
    said: list[str] = []
    cluster = Cluster(YbConfig(data_dir=str(tmp_path)), Topology(), say=said.append)
    cluster._size_event_log()
    free = shutil.disk_usage(tmp_path).free
    expected = max(MIN_EVENT_LOG_BYTES, min(DEFAULT_EVENT_LOG_BYTES, free // 4))
    # Within what the disk's free space moved by between the two looks.
    assert abs(cluster.cfg.nats.max_bytes - expected) <= max(1, expected // 100)
    assert said and "event log bounded at" in said[0]
    # Every service gets the resolved value, so none brings the stream to another.
    env = cluster.service_env(cluster.process_specs()[0])
    assert env["YB_NATS__MAX_BYTES"] == str(cluster.cfg.nats.max_bytes)

    chosen = YbConfig(data_dir=str(tmp_path))
    chosen.nats.max_bytes = 5 * MIN_EVENT_LOG_BYTES
    kept = Cluster(chosen, Topology(), say=said.append)
    kept._size_event_log()
    assert kept.cfg.nats.max_bytes == 5 * MIN_EVENT_LOG_BYTES
