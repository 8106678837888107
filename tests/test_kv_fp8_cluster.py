"""An 8-bit KV cache through the whole cluster (`yb up --kv-dtype fp8_e4m3`).

A tiny random Llama (4 heads, 2 KV heads) with prefill at TP=1 and decode at TP=2, its
KV in FP8 rows with a scale each: the prefill writes 8-bit pages, UCX carries them cut
by decode's ranks, the kvstores hold them, and:

- the greedy text is what one process computes with an 8-bit cache;
- a prefix the pool holds is reused (no engine prefix cache: it comes from a kvstore),
  with the same text;
- every engine announces the 8-bit layout, and its blocks' bytes are the spec's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from yb_core import events as ev
from yb_testkit.checkpoints import build_checkpoint
from yb_testkit.faults import events_of, read_log
from yb_testkit.fixtures import LocalCluster
from yb_testkit.reference import assert_prefix_reused_from_pool, single_process_answer

BLOCK = 64
ASK: list[Any] = [{"role": "user", "content": "Tell me about the weather in Paris."}]

pytestmark = pytest.mark.timeout(420, func_only=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, LocalCluster]]:
    root = tmp_path_factory.mktemp("fp8")
    checkpoint = build_checkpoint("llama", root / "model")
    cluster = LocalCluster(
        root / "data",
        *("--model", str(checkpoint), "--model-name", "tiny"),
        *("--kv-dtype", "fp8_e4m3", "--decode-tp", "2"),
        env={"YB_PREFILL__PREFIX_CACHE_PAGES": "0"},
    )
    cluster.start(timeout_s=300)
    try:
        yield checkpoint, cluster
    finally:
        cluster.stop()


def test_the_client_gets_what_one_process_computes_with_8_bit_kv(
    served: tuple[Path, LocalCluster],
) -> None:
    path, cluster = served
    expected = single_process_answer(ASK, 16, model_path=path, kv_dtype="fp8_e4m3")
    client = OpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.api_key, max_retries=0)
    completion = client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=16
    )
    assert completion.choices[0].message.content == expected


def test_an_8_bit_prefix_in_the_pool_is_reused(served: tuple[Path, LocalCluster]) -> None:
    assert_prefix_reused_from_pool(served[1], "tiny", block_size=BLOCK)


def test_engines_announce_the_8_bit_layout(served: tuple[Path, LocalCluster]) -> None:
    ups = [
        up
        for up in events_of(read_log(served[1]), ev.InstanceUp)
        if up.role in ("prefill", "decode")
    ]
    assert ups
    for up in ups:
        spec = up.kv_spec
        assert spec is not None and spec.dtype == "float8_e4m3fn" and spec.scaled, up
        # A row of 8-bit numbers and its 4-byte scale, for K and V of each KV head.
        assert spec.bytes_per_token_layer == 2 * spec.heads * (spec.dim + 4)
