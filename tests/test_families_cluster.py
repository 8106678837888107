"""Families other than Llama through the whole cluster, as a user serves them.

`yb up --model PATH` serves a tiny random checkpoint of a mixture-of-experts family and
of DeepSeek-V3 (latent attention and experts), built offline by transformers
(`yb_testkit.checkpoints`). The official `openai` client's answer must be the text one
process computes (prefill, then KV over UCX to decode, must not change it); a prompt
whose prefix the pool holds must come back with that prefix reused from the kvstore
(the prefill engines keep no prefix cache of their own here) and the same text; and
the engines announce their family's KV cache spec (a latent of 40 numbers per token
and layer for this DeepSeek-V3, not per-head keys and values).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from yb_testkit.checkpoints import build_checkpoint
from yb_testkit.fixtures import LocalCluster
from yb_testkit.reference import assert_prefix_reused_from_pool, single_process_answer

BLOCK = 64  # the default block size
ASK: list[Any] = [{"role": "user", "content": "Tell me about the weather in Paris."}]

pytestmark = pytest.mark.timeout(300, func_only=True)


class Served:
    def __init__(self, family: str, path: Path, cluster: LocalCluster) -> None:
        self.family = family
        self.path = path
        self.cluster = cluster
        self.client = OpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.api_key, max_retries=0)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    family = request.param
    root = tmp_path_factory.mktemp(family)
    path = build_checkpoint(family, root / "model")
    cluster = LocalCluster(
        root / "data",
        *("--model", str(path), "--model-name", family),
        # No prefix cache in the prefill engines: a reused prefix comes from the pool.
        env={"YB_PREFILL__PREFIX_CACHE_PAGES": "0"},
    )
    cluster.start(timeout_s=300)
    try:
        yield Served(family, path, cluster)
    finally:
        cluster.stop()


def test_the_openai_client_gets_what_one_process_computes(served: Served) -> None:
    expected = single_process_answer(ASK, 16, model_path=served.path)
    completion = served.client.chat.completions.create(
        model=served.family, messages=ASK, temperature=0, max_tokens=16
    )
    assert completion.choices[0].message.content == expected
    stream = served.client.chat.completions.create(
        model=served.family, messages=ASK, temperature=0, max_tokens=16, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_a_prefix_in_the_pool_is_reused_and_changes_nothing(served: Served) -> None:
    assert_prefix_reused_from_pool(served.cluster, served.family, block_size=BLOCK)


def test_the_engines_announce_the_family_kv_spec(served: Served) -> None:
    config = json.loads((served.path / "config.json").read_text())
    found = []
    for name in ("prefill-0", "decode-0"):
        for line in served.cluster.instance_log(name).splitlines():
            if '"kv_cache_sized"' in line:
                found.append(json.loads(line))
    assert len(found) == 2
    layers = config["num_hidden_layers"]
    if served.family == "deepseek_v3":
        latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        per_token = layers * latent * 4
    else:
        per_token = layers * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    for record in found:
        assert record["kv_bytes_per_token"] == per_token, record
        assert record["page_bytes"] == per_token * BLOCK, record
        assert record["family"] == served.family
