"""When a decode instance's uploads of piggybacked blocks give their pages back."""

from __future__ import annotations

from yb_decode.service import uploads_yield


def test_uploads_yield_while_a_running_request_could_miss_its_next_page() -> None:
    # Four running requests, each may need a page at its next token.
    assert uploads_yield(free_pages=3, running=4)
    assert uploads_yield(free_pages=0, running=1)


def test_uploads_keep_their_pages_while_every_running_request_has_one_spare() -> None:
    assert not uploads_yield(free_pages=4, running=4)
    assert not uploads_yield(free_pages=0, running=0)
