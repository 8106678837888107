"""The Batch API on real gateways over a real nats-server, with the test kit's
conductor and engine as peers: files and batches kept in JetStream, lines refused one
by one, and a batch that survives the restart of its gateway with every line answered
and run exactly once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

import httpx
import msgspec
import nats.errors
import nats.js.errors
import pytest
from gateway_testkit import MODEL, Cluster, GatewayFactory, client_for, error_of, wait_for

from yb_core.bus import Bus
from yb_gateway.batch_lines import BatchLine, ParsedInput, parse_input
from yb_gateway.batch_store import BatchError, BatchObject, BatchStore, FileObject, LineResult
from yb_gateway.batches import RETRY_MAX_S, retry_wait_s
from yb_gateway.errors import rejected
from yb_gateway.runner import RunResult
from yb_gateway.service import GatewayService
from yb_testkit.fixtures import AuthNats

pytestmark = pytest.mark.timeout(120)

# The poll short enough that a test does not wait for the worker; the lease long
# enough that no pause of this process on a busy machine loses it (a stopping gateway
# gives its leases up, so the next one does not wait for them).
BATCH: dict[str, Any] = {"batch_poll_s": 0.2, "batch_lease_ttl_s": 30.0, "batch_concurrency": 2}
BUCKET = "yb_batches"


def chat_line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"line {custom_id}"}],
            "max_tokens": 8,
            **body,
        },
    }


def jsonl(*lines: dict[str, Any] | str) -> bytes:
    return b"".join(
        (line if isinstance(line, str) else json.dumps(line)).encode() + b"\n" for line in lines
    )


async def upload(client: httpx.AsyncClient, data: bytes, **form: str) -> httpx.Response:
    return await client.post(
        "/v1/files",
        data={"purpose": "batch", **form},
        files={"file": ("input.jsonl", data, "application/jsonl")},
    )


async def create_batch(client: httpx.AsyncClient, file_id: str, **body: Any) -> httpx.Response:
    return await client.post(
        "/v1/batches",
        json={
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **body,
        },
    )


async def wait_status(
    client: httpx.AsyncClient, batch_id: str, statuses: set[str], timeout_s: float = 30
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        response = await client.get(f"/v1/batches/{batch_id}")
        assert response.status_code == 200, response.text
        batch: dict[str, Any] = response.json()
        if batch["status"] in statuses:
            return batch
        if time.monotonic() > deadline:
            pytest.fail(f"batch still {batch['status']} after {timeout_s}s: {batch}")
        await asyncio.sleep(0.1)


async def recorded_lines(bus: Bus, batch_id: str) -> set[int]:
    """The lines of a batch whose results are recorded, read from the bucket."""
    store = await BatchStore.open(
        bus.jetstream, BUCKET, replicas=1, lease_ttl_s=BATCH["batch_lease_ttl_s"], timeout_s=5
    )
    return set(await store.line_results(batch_id))


async def file_lines(client: httpx.AsyncClient, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    response = await client.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.content.splitlines()]


# --- reading the input ---------------------------------------------------------------


def test_a_refused_line_waits_its_back_off_no_less_than_retry_after_jittered() -> None:
    # The refusal's Retry-After reaches the worker.
    result = RunResult.of_error("r", rejected("batch_held: held back", 2.4))
    assert (result.status, result.retry_after_s) == (429, 3.0)
    # The back-off, or the Retry-After when longer, at most RETRY_MAX_S; then half of
    # it fixed and half drawn.
    assert retry_wait_s(0.5, 0.0, 0.0) == 0.25
    assert retry_wait_s(0.5, 0.0, 1.0) == 0.5
    assert retry_wait_s(0.5, result.retry_after_s, 0.0) == 1.5
    assert retry_wait_s(4.0, 30.0, 1.0) == RETRY_MAX_S


def test_bad_lines_are_refused_one_by_one_and_the_rest_run() -> None:
    data = jsonl(
        chat_line("a"),
        "{not json",
        {**chat_line("b"), "url": "/v1/embeddings"},
        {**chat_line("c"), "url": "/v1/completions"},
        chat_line("d", model="other-model"),
        chat_line("a"),  # a duplicate custom_id
        chat_line("e", stream=True),
        {**chat_line("f"), "method": "GET"},
        {"custom_id": "g", "url": "/v1/chat/completions", "body": {}},
        "",
        chat_line("h"),
    )
    parsed = parse_input(data, "batch_x", "/v1/chat/completions", MODEL, 100)
    assert isinstance(parsed, ParsedInput)
    assert [(line.index, line.custom_id) for line in parsed.lines] == [(0, "a"), (9, "h")]
    assert isinstance(parsed.lines[0], BatchLine)
    assert json.loads(parsed.lines[0].body)["model"] == MODEL
    codes = {r.index: (r.custom_id, r.error.code if r.error else None) for r in parsed.refused}
    assert codes == {
        1: (None, "invalid_json_line"),
        2: ("b", "invalid_url"),
        3: ("c", "invalid_url"),
        4: ("d", "model_not_found"),
        5: ("a", "duplicate_custom_id"),
        6: ("e", "stream_unsupported"),
        7: ("f", "invalid_method"),
        8: ("g", "invalid_line"),
    }
    assert parsed.total == 10  # the blank line is not one
    assert [r.id for r in parsed.refused][:1] == ["batch_req_x_1"]
    # A whole file is refused only when it holds nothing, or too much.
    empty = parse_input(b"\n \n", "batch_x", "/v1/chat/completions", MODEL, 100)
    assert isinstance(empty, BatchError) and empty.code == "empty_file"
    many = parse_input(data, "batch_x", "/v1/chat/completions", MODEL, 3)
    assert isinstance(many, BatchError) and many.code == "too_many_lines"


# --- the API -------------------------------------------------------------------------


async def test_files_and_batches_are_refused_as_openai_refuses_them(
    gateway_factory: GatewayFactory,
) -> None:
    gw = await gateway_factory(batch_max_file_bytes=1000, **BATCH)
    async with client_for(gw) as client:
        over = await upload(client, b"x" * 1001)
        assert error_of(over, 400)["code"] == "file_too_large"
        far_over = await upload(client, b"x" * 50_000)  # past the body limit as well
        assert error_of(far_over, 400)["code"] == "file_too_large"
        assert error_of(await upload(client, b"{}", purpose="fine-tune"), 400)["param"] == (
            "purpose"
        )
        plain = await client.post("/v1/files", json={"purpose": "batch"})
        assert error_of(plain, 400)["message"].startswith("A file is uploaded as multipart")

        uploaded = await upload(client, jsonl(chat_line("a")))
        assert uploaded.status_code == 200, uploaded.text
        record = uploaded.json()
        assert record["object"] == "file" and record["purpose"] == "batch"
        assert record["bytes"] == len(jsonl(chat_line("a"))) and record["filename"] == "input.jsonl"
        file_id = record["id"]
        assert (await client.get(f"/v1/files/{file_id}")).json() == record
        assert (await client.get(f"/v1/files/{file_id}/content")).content == jsonl(chat_line("a"))
        listed = (await client.get("/v1/files", params={"purpose": "batch"})).json()
        assert [f["id"] for f in listed["data"]] == [file_id] and listed["has_more"] is False

        window = await create_batch(client, file_id, completion_window="1h")
        assert error_of(window, 400)["param"] == "completion_window"
        embeddings = await create_batch(client, file_id, endpoint="/v1/embeddings")
        assert error_of(embeddings, 400)["param"] == "endpoint"
        unknown = await create_batch(client, file_id, foo=1)
        assert error_of(unknown, 400)["code"] == "unknown_parameter"
        missing = await create_batch(client, "file-nope")
        assert error_of(missing, 404)["param"] == "input_file_id"
        assert error_of(await client.get("/v1/batches/batch_nope"), 404)["code"] == "not_found"
        assert error_of(await client.get("/v1/files/file-nope"), 404)["code"] == "not_found"
        assert error_of(await client.get("/v1/batches", params={"limit": 0}), 400)


async def test_a_batch_runs_lists_cancels_and_deletes(
    gateway_factory: GatewayFactory, cluster: Cluster
) -> None:
    gw = await gateway_factory(**BATCH)
    lines = [chat_line(f"ok-{i}") for i in range(4)]
    data = jsonl(
        *lines,
        "{oops",
        chat_line("bad-model", model="nope"),
        chat_line("ok-0"),
        chat_line("bad-field", foo=1),  # refused when it runs, as over HTTP
    )
    async with client_for(gw) as client:
        file_id = (await upload(client, data)).json()["id"]
        created = await create_batch(client, file_id, metadata={"job": "nightly"})
        assert created.status_code == 200, created.text
        batch = created.json()
        assert batch["status"] == "validating" and batch["metadata"] == {"job": "nightly"}
        assert batch["expires_at"] - batch["created_at"] == 24 * 3600
        # The input of an unfinished batch stays.
        assert error_of(await client.delete(f"/v1/files/{file_id}"), 400)["code"] == "file_in_use"

        done = await wait_status(client, batch["id"], {"completed"})
        assert done["request_counts"] == {"total": 8, "completed": 4, "failed": 4}
        assert done["in_progress_at"] and done["finalizing_at"] and done["completed_at"]
        output = await file_lines(client, done["output_file_id"])
        assert [o["custom_id"] for o in output] == [f"ok-{i}" for i in range(4)]  # input order
        for line in output:
            response = line["response"]
            assert line["error"] is None and response["status_code"] == 200
            assert response["body"]["id"] == response["request_id"]
            assert response["body"]["choices"][0]["message"]["content"] == "Hello, world!"
        errors = await file_lines(client, done["error_file_id"])
        refused, ran = errors[:3], errors[3]
        assert [(e["custom_id"], e["error"]["code"]) for e in refused] == [
            (None, "invalid_json_line"),
            ("bad-model", "model_not_found"),
            ("ok-0", "duplicate_custom_id"),
        ]
        assert all(e["response"] is None for e in refused)
        assert ran["custom_id"] == "bad-field" and ran["error"] is None
        assert ran["response"]["status_code"] == 400
        assert ran["response"]["body"]["error"]["code"] == "unknown_parameter"
        outputs = (await client.get(f"/v1/files/{done['output_file_id']}")).json()
        assert outputs["purpose"] == "batch_output"

        # Cancelling: a batch whose lines wait on a silent conductor.
        cluster.conductor.mode = "silent"
        second = (await create_batch(client, file_id)).json()
        await wait_status(client, second["id"], {"in_progress"})
        cancelled = await client.post(f"/v1/batches/{second['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelling"
        final = await wait_status(client, second["id"], {"cancelled"})
        assert final["cancelled_at"] and final["output_file_id"] is None
        never = await file_lines(client, final["error_file_id"])
        # The four good lines, and the last one (never reached: two lanes wait).
        assert [e["error"]["code"] for e in never if e["error"]].count("batch_cancelled") == 5
        assert error_of(await client.post(f"/v1/batches/{done['id']}/cancel"), 400)["code"] == (
            "batch_not_cancellable"
        )

        # Lists: the newest batch first, and paged.
        page = (await client.get("/v1/batches", params={"limit": 1})).json()
        assert [b["id"] for b in page["data"]] == [second["id"]] and page["has_more"]
        rest = (await client.get("/v1/batches", params={"after": second["id"]})).json()
        assert [b["id"] for b in rest["data"]] == [done["id"]] and not rest["has_more"]

        deleted = await client.delete(f"/v1/files/{file_id}")
        assert deleted.json() == {"id": file_id, "object": "file", "deleted": True}
        assert error_of(await client.get(f"/v1/files/{file_id}/content"), 404)


async def test_a_line_held_back_for_interactive_load_is_tried_again_and_completes(
    gateway_factory: GatewayFactory, cluster: Cluster
) -> None:
    """A batch line is logged as one, with its deadline; the conductor holds it back
    (429 `batch_held`) while interactive load uses the capacity, and the worker tries
    it again, without counting it as failed, until it is admitted once the load goes."""
    cluster.conductor.hold_batch = 2
    gw = await gateway_factory(**BATCH)
    started = time.time()
    async with client_for(gw) as client:
        file_id = (await upload(client, jsonl(chat_line("held")))).json()["id"]
        batch_id = (await create_batch(client, file_id)).json()["id"]
        done = await wait_status(client, batch_id, {"completed"})
        output = await file_lines(client, done["output_file_id"])
    assert done["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
    assert done["error_file_id"] is None
    assert [(o["custom_id"], o["response"]["status_code"]) for o in output] == [("held", 200)]
    tries = [e for e in cluster.conductor.admitted if f"-{batch_id}-0-" in e.request_id]
    assert len(tries) == 3 and cluster.conductor.hold_batch == 0
    line_timeout_s = gw.cfg.gateway.batch_line_timeout_s
    for event in tries:
        assert event.batch
        assert started < event.batch_deadline <= time.time() + line_timeout_s
    # Every try is due when the first was: the line's deadline, not the try's.
    assert max(e.batch_deadline for e in tries) - min(e.batch_deadline for e in tries) < 1.0
    # An ordinary request is no batch line.
    async with client_for(gw) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
    assert response.status_code == 200, response.text
    assert not cluster.conductor.admitted[-1].batch


async def test_a_line_held_back_until_its_deadline_times_out(
    gateway_factory: GatewayFactory, cluster: Cluster
) -> None:
    """Refused every time (the interactive load never goes), the line ends at its
    deadline with `line_timeout` in the error file, not with the last 429."""
    cluster.conductor.hold_batch = 10**6
    # Far longer than a try and its back-off (at most 1 s after a Retry-After of 1 s),
    # so the line is tried again before its deadline however slowly this machine runs.
    gw = await gateway_factory(**BATCH, batch_line_timeout_s=8.0)
    async with client_for(gw) as client:
        file_id = (await upload(client, jsonl(chat_line("never")))).json()["id"]
        batch_id = (await create_batch(client, file_id)).json()["id"]
        done = await wait_status(client, batch_id, {"completed"})
        errors = await file_lines(client, done["error_file_id"])
    assert done["request_counts"] == {"total": 1, "completed": 0, "failed": 1}
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("never", "line_timeout")]
    assert len([e for e in cluster.conductor.admitted if e.batch]) >= 2  # it was tried again


# --- durability ----------------------------------------------------------------------


async def test_a_batch_survives_the_restart_of_its_gateway(
    gateway_factory: GatewayFactory, cluster: Cluster, bus: Bus
) -> None:
    """Stopped after some lines are recorded, the gateway finishes the lines it runs
    and gives the batch up; a new gateway on the same NATS completes it. Every line
    is in the output once, and each was admitted once, across both gateways."""
    # The engine holds the 5th job on: 4 lines are answered, 2 more are in flight
    # when the stop begins, and they finish once it has begun.
    cluster.engine.hold_from = 4
    first = await gateway_factory(**BATCH)
    count = 12
    ids = [f"line-{i}" for i in range(count)]
    async with client_for(first) as client:
        file_id = (await upload(client, jsonl(*(chat_line(c) for c in ids)))).json()["id"]
        batch_id = (await create_batch(client, file_id)).json()["id"]

    deadline = time.monotonic() + 30
    while len(await recorded_lines(bus, batch_id)) < 4 or len(cluster.engine.jobs) < 6:
        assert time.monotonic() < deadline, "4 lines were not recorded, 2 more taken"
        await asyncio.sleep(0.05)
    stopping = asyncio.create_task(first.stop())
    await wait_for(lambda: first.batch_worker.draining, 30, "the gateway to start stopping")
    cluster.engine.resume.set()
    await stopping
    after_stop = await recorded_lines(bus, batch_id)
    assert len(after_stop) == 6  # the 4 answered, and the 2 in flight finished

    second: GatewayService = await gateway_factory(**BATCH)
    async with client_for(second) as client:
        done = await wait_status(client, batch_id, {"completed"})
        assert done["request_counts"] == {"total": count, "completed": count, "failed": 0}
        output = await file_lines(client, done["output_file_id"])
    assert done["error_file_id"] is None
    assert [o["custom_id"] for o in output] == ids  # each line once, in input order
    # Each line was run once: one admission per line in the log, over both gateways.
    admitted = Counter(
        "-".join(event.request_id.split("-")[1:-1]) for event in cluster.conductor.admitted
    )
    assert admitted == Counter({f"{batch_id}-{i}": 1 for i in range(count)})
    # The lines recorded before the stop kept their first answer.
    first_ids = {o["response"]["request_id"] for o in output}
    assert len(first_ids) == count


async def test_lines_cut_off_by_a_stop_run_again_and_are_answered_once(
    gateway_factory: GatewayFactory, cluster: Cluster, bus: Bus
) -> None:
    """A gateway that cannot wait for its lines (`batch_drain_s` 0) cancels them; the
    next gateway runs them again. Each line still has one result, in the output once,
    and only the lines cut off were admitted twice."""
    cluster.engine.delay_s = 0.1
    first = await gateway_factory(batch_drain_s=0, **BATCH)
    count = 8
    ids = [f"line-{i}" for i in range(count)]
    async with client_for(first) as client:
        file_id = (await upload(client, jsonl(*(chat_line(c) for c in ids)))).json()["id"]
        batch_id = (await create_batch(client, file_id)).json()["id"]
    deadline = time.monotonic() + 30
    while len(await recorded_lines(bus, batch_id)) < 2:
        assert time.monotonic() < deadline, "no line was recorded"
        await asyncio.sleep(0.05)
    await first.stop()
    recorded = await recorded_lines(bus, batch_id)

    second = await gateway_factory(**BATCH)
    async with client_for(second) as client:
        done = await wait_status(client, batch_id, {"completed"})
        output = await file_lines(client, done["output_file_id"])
    assert [o["custom_id"] for o in output] == ids
    admitted = Counter(int(event.request_id.split("-")[2]) for event in cluster.conductor.admitted)
    assert set(admitted) == set(range(count))
    # Twice only the lines in flight on the first gateway, never one it had recorded.
    twice = {i for i, n in admitted.items() if n == 2}
    assert max(admitted.values()) <= 2 and not twice & recorded
    assert len(twice) <= BATCH["batch_concurrency"]  # at most the lines in flight


async def test_a_batch_leased_by_another_gateway_waits_for_its_lease(
    gateway_factory: GatewayFactory, cluster: Cluster, bus: Bus
) -> None:
    """Two gateways never both work on a batch: while another holds the lease, the
    batch waits; once that one dies (stops renewing), the lease expires and a live
    gateway takes it and runs it.

    The test is the other gateway. Each renewal of its lease succeeds only if nobody
    took the lease since the one before, so the status read between two successful
    renewals was read while the lease was held, however slowly this machine runs."""
    del cluster
    ttl_s = 10.0
    store = await BatchStore.open(bus.jetstream, BUCKET, replicas=1, lease_ttl_s=ttl_s, timeout_s=5)
    data = jsonl(chat_line("only"))
    now = int(time.time())
    await store.put_file(
        FileObject(
            id="file-dead", bytes=len(data), created_at=now, filename="in.jsonl", purpose="batch"
        ),
        data,
    )
    # The gateway runs before the lease is taken, so no slow start can outlast it.
    gw = await gateway_factory(**{**BATCH, "batch_lease_ttl_s": ttl_s})
    batch_id = "batch_0123abcd"
    holder = "gateway-dead:1"
    revision = await store.acquire_lease(batch_id, holder)
    assert revision
    await store.create_batch(
        BatchObject(
            id=batch_id,
            endpoint="/v1/chat/completions",
            input_file_id="file-dead",
            completion_window="24h",
            status="validating",
            created_at=now,
            expires_at=now + 24 * 3600,
        )
    )
    async with client_for(gw) as client:
        for _ in range(8):  # some 8 of the gateway's looks for batches, 0.2 s apart
            await asyncio.sleep(BATCH["batch_poll_s"])
            status = (await client.get(f"/v1/batches/{batch_id}")).json()["status"]
            last_renewal = time.monotonic()
            revision = await store.renew_lease(batch_id, holder, revision)
            assert status == "validating"
        # The holder dies here: its lease expires `ttl_s` after its last renewal.
        done = await wait_status(client, batch_id, {"completed"}, timeout_s=ttl_s + 30)
    assert time.monotonic() - last_renewal >= ttl_s * 0.9
    assert done["request_counts"] == {"total": 1, "completed": 1, "failed": 0}


# --- the store ---------------------------------------------------------------------


async def test_a_file_whose_chunks_are_gone_is_an_error_not_a_wait(bus: Bus) -> None:
    """A file read takes each chunk within the request timeout and checks size and
    digest: a file whose chunks were purged (its record says it has bytes) raises at
    once, as a JetStream error the worker retries; nats-py's own `get` would wait for
    the chunks forever."""
    store = await BatchStore.open(bus.jetstream, BUCKET, replicas=1, lease_ttl_s=5, timeout_s=2)
    data = b"y" * 200_000  # two chunks
    for file_id in ("file-kept", "file-lost"):
        record = FileObject(
            id=file_id, bytes=len(data), created_at=1, filename="f", purpose="batch"
        )
        await store.put_file(record, data)
    assert await store.file_bytes("file-kept") == data
    nuid = (await (await bus.jetstream.object_store(f"{BUCKET}_files")).get_info("file-lost")).nuid
    await bus.jetstream.purge_stream(f"OBJ_{BUCKET}_files", subject=f"$O.{BUCKET}_files.C.{nuid}")
    with pytest.raises(nats.js.errors.DigestMismatchError):
        await asyncio.wait_for(store.file_bytes("file-lost"), 10)
    assert await store.file_bytes("file-kept") == data
    assert await store.file_bytes("file-never") is None


async def test_reads_leave_no_consumer_behind(bus: Bus) -> None:
    """Every read of a bucket deletes its consumer: the server refuses new consumers
    on a stream past its limit, so reads left for the server to expire would make a
    burst of them (a client listing batches in a loop) fail."""
    store = await BatchStore.open(bus.jetstream, BUCKET, replicas=1, lease_ttl_s=5, timeout_s=5)
    data = b"z" * 1000
    record = FileObject(id="file-a", bytes=len(data), created_at=1, filename="a", purpose="batch")
    await store.put_file(record, data)
    line = LineResult(index=0, id="batch_req_a_0", custom_id="c", status_code=200)
    await store.record_line("batch_a", line)
    for _ in range(3):
        assert [f.id for f in await store.list_files()] == ["file-a"]
        assert await store.list_batches() == []
        assert list(await store.line_results("batch_a")) == [0]
        assert await store.file_bytes("file-a") == data
    for stream in (f"KV_{BUCKET}", f"KV_{BUCKET}_lines", f"OBJ_{BUCKET}_files"):
        info = await bus.jetstream.stream_info(stream)
        assert info.state.consumer_count == 0, (stream, info.state.consumer_count)


async def test_a_renewal_whose_answer_was_lost_keeps_the_lease(bus: Bus) -> None:
    """A renewal stored by JetStream but timed out on the way back leaves the holder
    a revision behind: its next renewal still keeps the lease it holds, and a lease
    another gateway took (or nobody holds) is lost."""
    store = await BatchStore.open(bus.jetstream, BUCKET, replicas=1, lease_ttl_s=5, timeout_s=2)
    taken = await store.acquire_lease("batch_a", "gateway-0:1")
    await store.renew_lease("batch_a", "gateway-0:1", taken)  # its answer "lost"
    renewed = await store.renew_lease("batch_a", "gateway-0:1", taken)
    assert renewed > taken
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await store.renew_lease("batch_a", "gateway-1:1", taken)
    await store.release_lease("batch_a", renewed)
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await store.renew_lease("batch_a", "gateway-0:1", renewed)
    assert await store.acquire_lease("batch_a", "gateway-1:1")
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await store.renew_lease("batch_a", "gateway-0:1", renewed)


# --- permissions ---------------------------------------------------------------------


async def test_only_the_gateway_role_may_use_the_batch_buckets(auth_nats_server: AuthNats) -> None:
    """Under the generated NATS permissions the gateway does all the Batch API does to
    its buckets, and no other role may touch them."""
    gateway = await Bus.connect(auth_nats_server.config("gateway"), "test-gateway", timeout_s=10)
    prefill = await Bus.connect(auth_nats_server.config("prefill"), "test-prefill", timeout_s=10)
    try:
        store = await BatchStore.open(
            gateway.jetstream, BUCKET, replicas=1, lease_ttl_s=5, timeout_s=5
        )
        data = b"x" * 300_000  # several chunks of the object store
        record = FileObject(
            id="file-a", bytes=len(data), created_at=1, filename="a", purpose="batch"
        )
        await store.put_file(record, data)
        assert await store.file_bytes("file-a") == data
        assert [f.id for f in await store.list_files()] == ["file-a"]
        batch = BatchObject(
            id="batch_a",
            endpoint="/v1/completions",
            input_file_id="file-a",
            completion_window="24h",
            status="validating",
            created_at=1,
        )
        await store.create_batch(batch)
        changed = await store.update_batch(
            "batch_a", lambda b: msgspec.structs.replace(b, status="in_progress")
        )
        assert changed is not None and changed.status == "in_progress"
        assert [b.id for b in await store.list_batches()] == ["batch_a"]
        line = LineResult(index=0, id="batch_req_a_0", custom_id="c", status_code=200)
        assert await store.record_line("batch_a", line)
        assert not await store.record_line("batch_a", line)  # once
        assert list(await store.line_results("batch_a")) == [0]
        await store.forget_lines("batch_a")
        assert await store.line_results("batch_a") == {}
        revision = await store.acquire_lease("batch_a", "gateway-0:1")
        assert revision and not await store.acquire_lease("batch_a", "gateway-1:1")
        revision = await store.renew_lease("batch_a", "gateway-0:1", revision)
        await store.release_lease("batch_a", revision)
        assert await store.acquire_lease("batch_a", "gateway-1:1")
        assert await store.delete_file("file-a") and await store.file_bytes("file-a") is None
        assert not gateway.permission_errors, gateway.permission_errors

        with pytest.raises((nats.errors.Error, TimeoutError)):
            await BatchStore.open(prefill.jetstream, BUCKET, replicas=1, lease_ttl_s=5, timeout_s=5)
        assert prefill.permission_errors
    finally:
        await gateway.close()
        await prefill.close()
