"""Cost models of round numbers for the simulator's hand-checked tests: times a reader
can add up by hand."""

from __future__ import annotations

from yb_conductor.cost_model import CostModel, DecodeCost, PrefillCost, TransferCost

#: Bytes of one 512-token block at 1,000 bytes a token.
BLOCK_BYTES = 512 * 1000

#: 1 ms a prompt token, a decode step 10 ms whatever the batch, a block loaded in 10 ms
#: from this host's pool and 20 ms from another's; at one device, with no all-reduce
#: figures (so two devices halve the work, and two lanes halve a load).
ROUND_512 = CostModel(
    name="round-512",
    kv_bytes_per_token=1000,
    prefill=PrefillCost(base_s=0.0, per_token_s=0.001, per_pair_s=0.0),
    decode=DecodeCost(base_s=0.010, per_seq_s=0.0, per_context_token_s=0.0),
    transfer=TransferCost(
        setup_s=0.0,
        dram_local_gbps=BLOCK_BYTES / 0.010 / 1e9,
        dram_remote_gbps=BLOCK_BYTES / 0.020 / 1e9,
    ),
)
