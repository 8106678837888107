"""Block keys: chained, stable across processes, model-specific."""

from __future__ import annotations

import subprocess
import sys

from yb_shared.hashing import block_hashes, model_identity


def test_full_blocks_only_and_chained() -> None:
    ident = model_identity("m")
    tokens = list(range(100))
    keys = block_hashes(tokens, 16, ident)
    assert len(keys) == 6  # 96 tokens in full blocks, 4 left over
    # A shared prefix gives shared leading keys; a change in block 2 changes every key after.
    other = [*tokens[:40], 999, *tokens[41:]]
    other_keys = block_hashes(other, 16, ident)
    assert other_keys[:2] == keys[:2]
    assert all(a != b for a, b in zip(other_keys[2:], keys[2:], strict=True))


def test_model_identity_separates_models() -> None:
    tokens = list(range(32))
    assert block_hashes(tokens, 16, model_identity("a")) != block_hashes(
        tokens, 16, model_identity("b")
    )


def test_stable_across_processes() -> None:
    code = (
        "from yb_shared.hashing import block_hashes, model_identity;"
        "print(block_hashes(list(range(64)), 16, model_identity('m')))"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in (1, 2)
    }
    assert len(runs) == 1
    assert runs.pop().strip() == str(block_hashes(list(range(64)), 16, model_identity("m")))
