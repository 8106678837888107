"""Which of a computed prompt's blocks an engine puts into its host's kvstore, and what
an upload counts (the puts themselves run against a real kvstore in
`services/prefill/tests/test_uploads_hold_pages.py` and `tests/test_piggyback.py`)."""

from __future__ import annotations

from yb_dataplane.block_upload import UploadResult, blocks_to_store, full_blocks


def test_only_full_blocks_with_a_key_are_stored() -> None:
    assert full_blocks(num_tokens=200, num_keys=4, block_size=64) == 3  # the 4th is partial
    assert full_blocks(num_tokens=256, num_keys=4, block_size=64) == 4
    assert full_blocks(num_tokens=256, num_keys=2, block_size=64) == 2  # keys run out first
    assert full_blocks(num_tokens=10, num_keys=1, block_size=64) == 0


def test_blocks_read_from_the_store_itself_are_not_put_back() -> None:
    # Blocks 0-1 came from this host's kvstore, 2 from another host's (a replica goes
    # here), 3-4 were computed.
    loaded = {0: "kvstore-0", 1: "kvstore-0", 2: "kvstore-1"}
    assert blocks_to_store(0, 5, loaded, "kvstore-0") == [2, 3, 4]
    # Blocks before `first` are not the upload's (the prefill's engine tier).
    assert blocks_to_store(2, 5, loaded, "kvstore-0") == [2, 3, 4]
    assert blocks_to_store(0, 5, loaded, "kvstore-1") == [0, 1, 3, 4]
    assert blocks_to_store(0, 2, loaded, "kvstore-0") == []


def test_an_upload_counts_only_the_outcomes_it_had() -> None:
    assert UploadResult().counts() == {}
    assert UploadResult(stored=3, failed=1, nbytes=99).counts() == {"stored": 3, "failed": 1}
