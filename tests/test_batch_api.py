"""The Batch API with the official `openai` client against a whole cluster (`yb up`,
tiny random model): upload, create, poll, read the output and error files, list,
cancel, delete, and the refusals.

Each batch mixes good lines with bad ones (malformed JSON, an endpoint not served, a
model not served, a duplicate `custom_id`): the bad ones go to the error file, one
each, and never fail the batch; every good one is answered once, in the output file.
(A gateway restart in the middle of a batch is services/gateway/tests/test_batches.py.)
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI
from openai.types import Batch
from openai.types.chat import ChatCompletion
from openai.types.completion import Completion

from yb_testkit.fixtures import LocalCluster

MODEL = "tiny"
#: `gateway.batch_max_file_bytes` of this cluster.
LIMIT = 64 * 1024

pytestmark = pytest.mark.timeout(300, func_only=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        tmp_path_factory.mktemp("batch"),
        *("--model", "tiny-random", "--model-name", MODEL),
        env={
            "YB_DECODE__KV_SEQUENCES": "4",
            "YB_GATEWAY__BATCH_MAX_FILE_BYTES": str(LIMIT),
            "YB_GATEWAY__BATCH_POLL_S": "0.25",
            "YB_GATEWAY__BATCH_CONCURRENCY": "4",
        },
    )
    cluster.start(timeout_s=300)
    try:
        yield cluster
    finally:
        if cluster.process is not None and cluster.process.poll() is None:
            cluster.stop()


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.api_key, max_retries=0)


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _chat(custom_id: str, model: str = MODEL, url: str = "/v1/chat/completions") -> str:
    ask = [{"role": "user", "content": f"Say something about {custom_id}."}]
    return _line(custom_id, url, {"model": model, "messages": ask, "max_tokens": 4})


def _text(custom_id: str) -> str:
    body = {"model": MODEL, "prompt": f"Once upon a {custom_id}", "max_tokens": 4}
    return _line(custom_id, "/v1/completions", body)


CHAT_GOOD = [f"chat-{i}" for i in range(10)]
CHAT_FILE = "\n".join(
    [
        *(_chat(c) for c in CHAT_GOOD[:5]),
        '{"custom_id": "broken", "method": "POST", ',  # malformed JSON
        _chat("embed", url="/v1/embeddings"),  # an endpoint not served
        _chat("other-model", model="gpt-4o"),  # a model not served
        *(_chat(c) for c in CHAT_GOOD[5:]),
        _chat("chat-3"),  # a duplicate custom_id
    ]
).encode()
#: Line in the file -> the code it is refused with (custom_id None: unreadable).
CHAT_REFUSED = [
    (None, "invalid_json_line"),
    ("embed", "invalid_url"),
    ("other-model", "model_not_found"),
    ("chat-3", "duplicate_custom_id"),
]
TEXT_GOOD = [f"text-{i}" for i in range(5)]
TEXT_FILE = "\n".join([*(_text(c) for c in TEXT_GOOD), _chat("wrong-endpoint")]).encode()


def _wait(
    client: OpenAI,
    cluster: LocalCluster,
    batch_id: str,
    statuses: set[str],
    timeout_s: float = 120,
) -> Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert batch.status not in ("failed", "expired"), batch
        if time.monotonic() > deadline:
            pytest.fail(
                f"batch {batch_id} still {batch.status} after {timeout_s}s: {batch}\n"
                f"the gateway's log of it, and its warnings:\n{_worker_log(cluster, batch_id)}"
            )
        time.sleep(0.25)


def _worker_log(cluster: LocalCluster, batch_id: str) -> str:
    """What the gateway logged about a batch (its lines' admissions left out), and
    every warning and error it logged."""
    lines = [
        line
        for line in cluster.instance_log("gateway-0").splitlines()
        if (batch_id in line and '"request_admitting"' not in line)
        or '"level": "warning"' in line
        or '"level": "error"' in line
    ]
    return "\n".join(lines[-60:])


def _jsonl(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_batches_of_chat_and_text_lines_with_bad_lines(
    client: OpenAI, cluster: LocalCluster
) -> None:
    chat_file = client.files.create(file=("chat.jsonl", CHAT_FILE), purpose="batch")
    assert (chat_file.object, chat_file.purpose, chat_file.bytes) == (
        "file",
        "batch",
        len(CHAT_FILE),
    )
    assert client.files.retrieve(chat_file.id) == chat_file
    text_file = client.files.create(file=("text.jsonl", TEXT_FILE), purpose="batch")
    chat = client.batches.create(
        input_file_id=chat_file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"suite": "batch"},
    )
    text = client.batches.create(
        input_file_id=text_file.id, endpoint="/v1/completions", completion_window="24h"
    )
    assert chat.status == "validating" and chat.metadata == {"suite": "batch"}

    chat = _wait(client, cluster, chat.id, {"completed"})
    text = _wait(client, cluster, text.id, {"completed"})
    assert chat.request_counts is not None and text.request_counts is not None
    assert chat.request_counts.model_dump() == {"total": 14, "completed": 10, "failed": 4}
    assert text.request_counts.model_dump() == {"total": 6, "completed": 5, "failed": 1}

    # Every good line answered once, in input order, with a whole OpenAI object.
    for batch, good, kind in ((chat, CHAT_GOOD, ChatCompletion), (text, TEXT_GOOD, Completion)):
        output = _jsonl(client, batch.output_file_id)
        ids = [line["custom_id"] for line in output]
        assert ids == good and Counter(ids).most_common(1)[0][1] == 1
        for line in output:
            assert line["error"] is None and line["id"].startswith("batch_req_")
            response = line["response"]
            assert response["status_code"] == 200
            answer = kind.model_validate(response["body"])
            assert answer.id == response["request_id"] and answer.model == MODEL
            assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 4
    # Every bad line in the error file, once, with why.
    errors = _jsonl(client, chat.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == CHAT_REFUSED
    assert all(e["response"] is None and e["error"]["message"] for e in errors)
    text_errors = _jsonl(client, text.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in text_errors] == [
        ("wrong-endpoint", "invalid_url")
    ]

    listed = [b.id for b in client.batches.list(limit=10)]
    assert listed[:2] == [text.id, chat.id]  # the newest first
    files = {f.id for f in client.files.list(purpose="batch")}
    assert {chat_file.id, text_file.id} <= files

    # Cancelled at once: what ran is in the output, the rest is in the error file.
    again = client.batches.create(
        input_file_id=chat_file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert client.batches.cancel(again.id).status in ("cancelling", "cancelled")
    again = _wait(client, cluster, again.id, {"cancelled"})
    counts = again.request_counts
    assert counts is not None and counts.total == 14
    assert counts.completed + counts.failed == counts.total
    ran = _jsonl(client, again.output_file_id) if again.output_file_id else []
    stopped = _jsonl(client, again.error_file_id)
    assert len(ran) + len(stopped) == 14 and len(ran) == counts.completed
    assert {e["error"]["code"] for e in stopped} - {c for _, c in CHAT_REFUSED} <= {
        "batch_cancelled"
    }

    deleted = client.files.delete(text_file.id)
    assert deleted.deleted and deleted.id == text_file.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(text_file.id)


def test_what_is_not_served_is_refused(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("big.jsonl", b"x" * (LIMIT + 1)), purpose="batch")
    assert refused.value.code == "file_too_large"
    small = client.files.create(file=("one.jsonl", _chat("one").encode()), purpose="batch")
    window: Any = "1h"
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(
            input_file_id=small.id, endpoint="/v1/chat/completions", completion_window=window
        )
    assert refused.value.param == "completion_window"
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(
            input_file_id=small.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    assert refused.value.param == "endpoint"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")
