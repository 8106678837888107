"""The request ids of block puts and fetches: what a kvstore reads from them."""

from __future__ import annotations

import pytest

from yb_dataplane.transport.blocks import PutId, fetch_layers, fetch_request_id, parse_put_id


def test_a_fetch_names_its_layers_and_the_range_it_wants() -> None:
    assert fetch_layers(fetch_request_id("fetch.a", 30)) == (30, range(30))
    assert fetch_layers(fetch_request_id("fetch.a", 30, range(30))) == (30, range(30))
    assert fetch_layers(fetch_request_id("fetch.a", 30, range(15, 30))) == (30, range(15, 30))
    assert fetch_layers("repl.x") == (1, range(1))  # whole blocks
    with pytest.raises(ValueError):
        fetch_request_id("fetch.a", 30, range(20, 31))


@pytest.mark.parametrize("tail", ["L0", "Lx", "L30x5", "L30x5-5", "L30x20-31", "L30x-3-4"])
def test_a_malformed_layer_range_is_refused(tail: str) -> None:
    assert fetch_layers(f"fetch.a.{tail}") is None


def test_a_put_id_round_trips() -> None:
    put = PutId(0xABC, 30, 4096)
    assert parse_put_id(put.request_id()) == put
    assert parse_put_id("put.abc.0.4096.n") is None
