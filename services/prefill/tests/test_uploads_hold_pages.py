"""A job whose pages are held by uploads to the kvstore waits for them instead of failing.

One `yb up` cluster with one prefill instance whose engine has pages for exactly one
long prompt, no prefix cache, and uploads on. Every kvstore is SIGSTOPped, so the
first long prompt's new blocks stay held by their upload (a put waits for the store's
answer) after its stream has ended. A second long prompt sent then needs those pages:
it must wait in the prefill queue (the engine's queue gauge shows it there), not fail
"out of KV pages", and complete once the kvstores are resumed and the upload ends
(its puts not yet posted skipped meanwhile, those posted waited for).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from yb_testkit.faults import Scraper, SseClient, assert_completed, signal_instance, wait_until
from yb_testkit.fixtures import LocalCluster

MODEL = "tiny"
ACT_S = 60.0  # a request to reach a state, a stream to end (an upper bound)
BLOCK = 64  # tokens per page (the CPU default)
# 6 full blocks and one partial: 7 pages, the whole engine.
PROMPT_TOKENS = 6 * BLOCK + 1
PAGES = 7
UPLOADED_BLOCKS = 6


def _prompt(first: int) -> list[int]:
    """A long prompt of ids within the tiny model's vocabulary; `first` tells it apart."""
    return [first + i % 200 for i in range(PROMPT_TOKENS)]


pytestmark = [pytest.mark.timeout(300, func_only=True)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        tmp_path_factory.mktemp("uploads-hold-pages"),
        *("--model", "tiny-random", "--model-name", MODEL, "--prefill", "1", "--decode", "1"),
        env={
            "YB_MODEL__BLOCK_SIZE": str(BLOCK),
            "YB_PREFILL__NUM_KV_PAGES": str(PAGES),
            "YB_PREFILL__PREFIX_CACHE_PAGES": "0",
            "YB_PREFILL__STORE_BLOCKS": "true",
            # A put to a stopped kvstore waits this long: far longer than a test
            # holds them stopped, however slowly this machine runs.
            "YB_PREFILL__TRANSFER_TIMEOUT_S": "600",
        },
    )
    cluster.start(timeout_s=300)
    try:
        yield cluster
    finally:
        cluster.stop()


BODY = {"model": MODEL, "max_tokens": 1, "stream": True}


@contextmanager
def _upload_held(cluster: LocalCluster, first: list[int]) -> Iterator[SseClient]:
    """With every kvstore SIGSTOPped (resumed on the way out), the finished stream of
    prompt `first`, whose full blocks its upload then holds (a put waits for the
    store's answer)."""
    (prefill,) = [i for i in cluster.pids if i.startswith("prefill")]
    kvstores = [i for i in cluster.pids if i.startswith("kvstore")]
    assert kvstores, cluster.pids
    scraper = Scraper(cluster)
    for kvstore in kvstores:
        signal_instance(cluster, kvstore, signal.SIGSTOP)
    try:
        client = SseClient(cluster, {**BODY, "prompt": first}, timeout_s=ACT_S * 2)
        client.wait_done(ACT_S)
        wait_until(
            lambda: scraper.pages_used(prefill) == UPLOADED_BLOCKS,
            ACT_S,
            "the prompt's full blocks to be held by their upload alone",
        )
        yield client
    finally:
        for kvstore in kvstores:
            signal_instance(cluster, kvstore, signal.SIGCONT)


def test_a_job_that_needs_the_pages_of_an_upload_waits_for_them(cluster: LocalCluster) -> None:
    (prefill,) = [i for i in cluster.pids if i.startswith("prefill")]
    scraper = Scraper(cluster)
    with _upload_held(cluster, _prompt(10)) as first:
        second = SseClient(cluster, {**BODY, "prompt": _prompt(20)}, timeout_s=ACT_S * 2)
        wait_until(
            lambda: scraper.value(prefill, "yb_engine_queue_requests") == 1 or second.done.is_set(),
            ACT_S,
            "the second long prompt to wait in the prefill queue",
        )
        assert not second.done.is_set(), second.describe()
        assert scraper.pages_used(prefill) == UPLOADED_BLOCKS
    second.wait_done(ACT_S)
    assert_completed(first, second)
    # Both uploads end. The first's puts that were posted were waited for, not given
    # up (none failed, at least one stored beside the second's six); those not yet
    # posted when the second job began to wait were skipped.
    puts = {o: f'yb_prefill_block_puts_total{{outcome="{o}"}}' for o in ("stored", "skipped")}
    wait_until(
        lambda: sum(scraper.value(prefill, key) for key in puts.values()) == 2 * UPLOADED_BLOCKS,
        ACT_S,
        "both prompts' uploads to end",
    )
    assert scraper.value(prefill, 'yb_prefill_block_puts_total{outcome="failed"}') == 0
    assert scraper.value(prefill, puts["stored"]) > UPLOADED_BLOCKS
    assert scraper.value(prefill, puts["skipped"]) > 0


def test_a_prompt_bigger_than_the_engine_fails_at_once_while_uploads_hold_pages(
    cluster: LocalCluster,
) -> None:
    (prefill,) = [i for i in cluster.pids if i.startswith("prefill")]
    scraper = Scraper(cluster)
    with _upload_held(cluster, _prompt(30)) as first:
        # One page more than the whole engine: waiting for the upload cannot help.
        too_long = [40 + i % 200 for i in range(PAGES * BLOCK + 1)]
        refused = SseClient(cluster, {**BODY, "prompt": too_long}, timeout_s=ACT_S * 2)
        refused.wait_done(ACT_S)
        # Still held: the refusal did not wait for the upload.
        assert scraper.pages_used(prefill) == UPLOADED_BLOCKS
    assert_completed(first)
    assert any("out of KV pages" in error for error in refused.errors), refused.describe()
