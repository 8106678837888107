"""The GPU path across processes (`pytest -m cuda`; skipped without CUDA).

- KV pages in GPU memory go from one process to another over UCX on one GPU, received
  in place (nothing staged through host memory), with UCX choosing CUDA IPC.
- `yb up --device cuda` answers with exactly the greedy tokens of one process running
  prefill and decode on the same GPU: disaggregation changes nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from yb_testkit.fixtures import LocalCluster
from yb_testkit.reference import single_process_answer

pytestmark = pytest.mark.cuda

PEER = Path(__file__).with_name("cuda_kv_peer.py")
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in a sentence."}]
MAX_TOKENS = 32


async def _line(stream: asyncio.StreamReader, prefix: str, timeout: float = 60.0) -> str:
    while True:
        raw = await asyncio.wait_for(stream.readline(), timeout)
        if not raw:
            raise AssertionError(f"the peer ended before printing {prefix!r}")
        line = raw.decode().strip()
        if line.startswith("error "):
            raise AssertionError(line)
        if line.startswith(prefix + " "):
            return line.removeprefix(prefix + " ")


@pytest.mark.timeout(300)
async def test_kv_pages_cross_processes_on_one_gpu_over_cuda_ipc() -> None:
    import torch

    from yb_dataplane.transport import KVSender, PeerAddress

    # Page-sized buffers as an engine sends them: (layer, page) chunks of 256 tokens.
    sizes = [256 * 3 * 64 * 2 * 2] * 8
    gen = torch.Generator(device="cuda").manual_seed(7)
    pages = [
        torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=gen)
        for size in sizes
    ]
    want = [hashlib.sha256(p.cpu().numpy().tobytes()).hexdigest() for p in pages]
    spec = {"device": "cuda:0", "sizes": sizes, "request_id": "cuda-kv", "deadline_s": 60.0}
    # UCX prints the protocol it selects for each transfer (the receiver pulls the pages:
    # rendezvous), which is where CUDA IPC must appear.
    env = {**os.environ, "UCX_PROTO_INFO": "y"}
    peer = await asyncio.create_subprocess_exec(
        sys.executable,
        str(PEER),
        json.dumps(spec),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    assert peer.stdout is not None
    sender = KVSender(connect_timeout_s=20.0)
    try:
        address = PeerAddress.parse(await _line(peer.stdout, "address"))
        await sender.send(address, "cuda-kv", list(enumerate(pages)), deadline_s=60.0)
        await sender.commit(address, "cuda-kv", deadline_s=60.0)
        assert (await _line(peer.stdout, "received")).split() == want
        assert int(await _line(peer.stdout, "staged")) == 0
        rest = (await asyncio.wait_for(peer.stdout.read(), 60)).decode()
    finally:
        await sender.close()
        if peer.returncode is None:
            peer.kill()
        await peer.wait()
    assert "cuda_ipc" in rest, rest


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_yb_up_on_cuda_answers_as_one_process(tmp_path: Path) -> None:
    from openai import OpenAI

    cluster = LocalCluster(tmp_path / "cuda", "--device", "cuda")
    cluster.start(timeout_s=900)
    try:
        client = OpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.api_key, timeout=300)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=QUESTION,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        text = reply.choices[0].message.content or ""
        loaded = [
            json.loads(line)
            for name in ("prefill-0", "decode-0")
            for line in cluster.instance_log(name).splitlines()
            if '"engine_loaded"' in line
        ]
    finally:
        code = cluster.stop()
    assert code == 0, cluster.output()
    assert "Paris" in text, text
    reference = single_process_answer(
        QUESTION, MAX_TOKENS, device="cuda", dtype="bfloat16", block_size=256, num_pages=8
    )
    assert text == reference, text
    # Both engines ran on the GPU: the attention path they chose is a CUDA one.
    assert len(loaded) == 2, loaded
    assert all(str(record.get("device")).startswith("cuda") for record in loaded), loaded
