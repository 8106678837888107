"""A rank (1..N-1) of a tensor-parallel instance: `python -m yb_engine.tp_worker`.

Started by the instance's rank 0 (`yb_engine.tp_instance`), which writes a `RankStart`
on its stdin first: the rank loads its share of the weights, maps the KV pages rank 0
made for it, says `ready` on stdout, joins the process group, and then runs every call
rank 0 sends, in order, until `StopCall` or the end of its stdin (rank 0 gone). Any
error ends the process with a non-zero code: rank 0 notices, and the instance goes
down as one. A holdable prefill (`PrefillCall.holdable`) meets rank 0's decision
after each layer; held, the rank runs the calls that come meanwhile inside it, as
rank 0 does (`yb_engine.pausing`), until `ResumeCall` or `AbandonCall`.
"""

from __future__ import annotations

import contextlib
import sys
from datetime import timedelta
from pathlib import Path

from yb_core.telemetry import get_logger

log = get_logger(__name__)


def main() -> int:
    import torch
    from torch.distributed import TCPStore

    from yb_engine.kv_cache import PagedKVCache
    from yb_engine.kv_quant import kv_dtype_for, storage_dtype
    from yb_engine.models import load_engine_model
    from yb_engine.pausing import GO, HOLD, PauseAbandoned
    from yb_engine.runner import ModelRunner, PrefillSeq
    from yb_engine.tensor_parallel import Shard, TPGroup
    from yb_engine.tp_instance import (
        AbandonCall,
        DecodeCall,
        MixedCall,
        PrefillBatchCall,
        PrefillCall,
        ResumeCall,
        StopCall,
        decode_call,
        decode_start,
        map_pages,
        read_frame,
    )

    stdin = sys.stdin.buffer
    first = read_frame(stdin)
    if first is None:
        return 0
    start = decode_start(first)
    if start.threads:
        torch.set_num_threads(start.threads)
    shard = Shard(start.rank, start.size)
    model = load_engine_model(start.model, Path(start.cache_dir), shard=shard)
    arch = shard.local_arch(model.config)
    kv_dtype = kv_dtype_for(start.model.kv_dtype, model.dtype)
    spec = arch.kv_spec(str(kv_dtype).removeprefix("torch."))
    pages = map_pages(
        start.kv_fd,
        PagedKVCache.numel(spec, start.num_pages, start.block_size),
        storage_dtype(kv_dtype),
    )
    cache = PagedKVCache(
        arch, start.num_pages, start.block_size, dtype=kv_dtype, device="cpu", storage=pages
    )
    timeout = timedelta(seconds=start.timeout_s)
    store = TCPStore(start.store_host, start.store_port, start.size, False, timeout)
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.buffer.flush()
    group = TPGroup(shard, model.config, store, start.timeout_s)
    runner = ModelRunner(model, cache, tp=group)
    log.info("tp_rank_ready", rank=start.rank, size=start.size, heads=spec.heads)

    def discard(start: int, rows: torch.Tensor) -> None:
        """Rank 0 keeps the logits; this rank only takes part in computing them."""

    def hold_hook(layer: int, start: int, end: int) -> None:
        """After each layer of a holdable call: rank 0's decision (`TPGroup.agree`);
        held, the calls that come meanwhile, until the hold ends."""
        step = group.agree(GO)
        if step == HOLD:
            ended = serve()
            if ended is ResumeCall:
                return
            if ended is not AbandonCall:
                raise _Stopped
        if step != GO:
            raise PauseAbandoned(f"abandoned after layer {layer}")

    def serve() -> type[ResumeCall] | type[AbandonCall] | None:
        """Compute rank 0's calls until the end of the stream or a stop (None), or,
        inside a held call, until the hold ends (its call's type)."""
        while (payload := read_frame(stdin)) is not None:
            call = decode_call(payload)
            try:
                match call:
                    case PrefillCall():
                        runner.prefill(
                            call.token_ids,
                            call.block_table,
                            call.num_cached_tokens,
                            call.chunk_size,
                            layer_hook=hold_hook if call.holdable else None,
                            all_logits=call.logits == "all",
                            row_logits=discard if call.logits == "rows" else None,
                        )
                    case PrefillBatchCall():
                        runner.prefill_batch(
                            [
                                PrefillSeq(s.token_ids, s.block_table, s.num_cached_tokens)
                                for s in call.seqs
                            ]
                        )
                    case DecodeCall():
                        runner.decode(call.batch)
                    case MixedCall():
                        runner.mixed(call.batch, call.chunk)
                    case ResumeCall() | AbandonCall():
                        return type(call)
                    case StopCall():
                        return None
            except PauseAbandoned:
                pass  # rank 0 ended the held call at the same layer
        return None

    with contextlib.suppress(_Stopped):
        serve()
    return 0


class _Stopped(Exception):
    """The stream ended, or a stop came, inside a held call."""


if __name__ == "__main__":
    sys.exit(main())
