"""The compose files' NATS stores have room for the event log at its byte limit.

The services create `YB_EVENTS` with `nats.max_bytes` (the default unless compose
sets it) and the instance stream beside it (`INSTANCE_LOG_BYTES`); each node's
`max_file_store` must hold both plus the conductor's snapshots and leases, or
JetStream would refuse writes before the streams trim themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from yb_core.config import INSTANCE_LOG_BYTES, load_config

ROOT = Path(__file__).resolve().parents[1]
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def _size(text: str) -> int:
    match = re.fullmatch(r"(\d+)\s*([KMGT]?)B?", text.strip().strip('"').upper())
    assert match, text
    return int(match.group(1)) * _UNITS[match.group(2)]


@pytest.mark.parametrize("name", ["nats.conf", "nats-cluster.conf"])
def test_each_nats_store_holds_the_log_at_its_limit(name: str) -> None:
    jetstream = (ROOT / "deploy" / name).read_text().split("jetstream {")[1].split("}")[0]
    match = re.search(r"^\s*max_file_store:\s*(\S+)", jetstream, re.M)
    assert match, f"{name}: no max_file_store"
    store = _size(match.group(1))
    for compose in ("docker-compose.yml", "docker-compose.cluster.yml"):
        doc = yaml.safe_load((ROOT / compose).read_text())
        env = {str(k): str(v) for k, v in (doc.get("x-yb-env") or {}).items()}
        limit = load_config(env={k: v for k, v in env.items() if "MAX_BYTES" in k}).nats
        # Room to spare: snapshots, leases, and the stream briefly over its limit.
        assert limit.event_log_bytes() * 2 + INSTANCE_LOG_BYTES <= store, (name, compose)
