"""A prompt's own logprobs, for completions' `echo` with `logprobs` (how evaluation
harnesses score a continuation: lm-evaluation-harness sends context plus continuation
with `echo: true, logprobs: 1, max_tokens: 0 or 1`).

The prefill computes such a prompt from its first token, handing each chunk's logits
to a `PromptScorer` as they come (`ModelRunner.prefill(..., row_logits=...)`), so no
more than one chunk's `[chunk, vocab]` logits is ever held: a long prompt's whole
`[n, vocab]` in float32 (9.6 GB for 49,152 tokens of SmolLM2's vocabulary) would not
fit. A reused prefix brings KV but no logits, so the request's planned reuse is dropped
and the whole prompt is computed; its full blocks are still kept and stored for the
requests after it. Row i of the logits is the distribution after prompt
token i, which scores token i + 1; the first token has no entry (OpenAI's `null`).

Each entry has the shape of a sampled token's (`TokenLogprob`: the token's logprob and
the k likeliest alternatives, likeliest first), taken from the raw distribution (the
log-softmax of the logits in float32) exactly as a sampled token's is, so a prompt
token that is the likeliest has the very value its alternative shows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from yb_core.protocol import TokenLogprob

#: Rows turned into logprobs at a time: the log-softmax of a whole long prompt at once
#: would need a second `[n, vocab]` float32 tensor beside the logits.
ROWS_PER_STEP = 256


def prompt_logprobs(
    token_ids: Sequence[int], rows: Sequence[torch.Tensor], top: int
) -> list[TokenLogprob]:
    """Prompt tokens 1..n-1's logprobs, each with its `top` likeliest alternatives.

    `rows` are `ModelRunner.prefill(all_logits=True)`'s logits for the whole prompt
    (`[n, vocab]` together, computed from position 0, in one call or in several whose
    rows follow each other); the last row, after the last token, scores no prompt token
    and is not read.
    """
    n = len(token_ids)
    logits = torch.cat(list(rows)) if len(rows) > 1 else rows[0]
    if logits.shape[0] != n:
        raise ValueError(f"{logits.shape[0]} rows of logits for a prompt of {n} tokens")
    out: list[TokenLogprob] = []
    with torch.inference_mode():
        targets = torch.tensor(list(token_ids[1:]), dtype=torch.int64, device=logits.device)
        for start in range(0, n - 1, ROWS_PER_STEP):
            end = min(start + ROWS_PER_STEP, n - 1)
            logp = torch.log_softmax(logits[start:end].float(), dim=-1)
            chosen = logp.gather(1, targets[start:end, None])[:, 0].tolist()
            top_ids: list[list[int]] = [[] for _ in chosen]
            top_values: list[list[float]] = [[] for _ in chosen]
            if top > 0:
                values, ids = logp.topk(min(top, logp.shape[1]), dim=-1)
                top_values, top_ids = values.tolist(), ids.tolist()
            for j, value in enumerate(chosen):
                out.append(
                    TokenLogprob(
                        token_id=int(token_ids[start + j + 1]),
                        logprob=value,
                        top=list(zip(top_ids[j], top_values[j], strict=True)),
                    )
                )
    return out


class PromptScorer:
    """Prompt tokens 1..n-1's logprobs, built chunk by chunk: `add(start, rows)` takes
    the logits after tokens `start ..` (what `ModelRunner.prefill(row_logits=...)`
    hands over; chunks in order, from token 0), turns them into entries and lets them
    go. `entries` holds what `prompt_logprobs` computes for the whole prompt."""

    def __init__(self, token_ids: Sequence[int], top: int) -> None:
        self.token_ids = token_ids
        self.top = top
        self.entries: list[TokenLogprob] = []
        self._next = 0  # the row expected next

    def add(self, start: int, rows: torch.Tensor) -> None:
        if start != self._next:
            raise ValueError(f"rows from token {start}, expected from {self._next}")
        n = len(self.token_ids)
        self._next = start + rows.shape[0]
        # The row after the last token scores no prompt token.
        scoring = rows[: max(0, min(rows.shape[0], n - 1 - start))]
        if scoring.shape[0]:
            ids = [*self.token_ids[start : start + scoring.shape[0] + 1]]
            self.entries.extend(prompt_logprobs(ids, [scoring, scoring[-1:]], self.top))
