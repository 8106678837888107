"""Shared pieces of the yb tool's tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from yb_tools.sim.workload import TraceItem


def _uniform_items(n: int, prompt: int, output: int) -> list[TraceItem]:
    """`n` requests 1 ms apart, each of `prompt` tokens (no prefix shared: every
    request's 512-token blocks have keys of their own) and `output` tokens out."""
    return [
        TraceItem(
            index=i,
            request_id=f"r{i}",
            arrival=0.001 * i,
            prompt_tokens=prompt,
            output_tokens=output,
            keys=[10_000 * i + k for k in range(prompt // 512)],
        )
        for i in range(n)
    ]


@pytest.fixture
def uniform_items() -> Callable[..., list[TraceItem]]:
    """A trace builder: `uniform_items(n, prompt=..., output=...)`."""
    return _uniform_items
