"""Choosing next tokens from logits, batched, reproducibly per request.

Every sampled request owns a `torch.Generator`, seeded from its `seed` when it has one.
A request's draw therefore does not depend on which other requests share its batch or
in what order: the same seed and prompt give the same text whether the request runs
alone or among 31 others. Each step consumes exactly one uniform number per sampled
request (inverse-CDF sampling), which keeps the stream of draws easy to reason about.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from yb_core.protocol import SamplingParams


def is_greedy(params: SamplingParams) -> bool:
    """Greedy decoding: temperature 0 (or below), or top-k of 1."""
    return params.temperature <= 0.0 or params.top_k == 1


def new_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's random stream: seeded if `seed` is set, else from OS entropy.

    None for greedy requests, which draw nothing. CPU generators on every device, so a
    seed means the same draws on a laptop and on a GPU server.
    """
    if is_greedy(params):
        return None
    gen = torch.Generator(device="cpu")
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def choice_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """The random stream of choice `index` of a request (`n` > 1 draws n of them).

    Choice 0's is `new_generator(params)`, so a request with n = 1 draws what it always
    did. Choice i > 0 of a seeded request is seeded from a hash of (seed, i): the same
    on every engine, and unrelated to choice 0's stream and to the stream of seed + i.
    """
    if index == 0 or is_greedy(params):
        return new_generator(params)
    gen = torch.Generator(device="cpu")
    if params.seed is None:
        gen.seed()
    else:
        digest = hashlib.blake2b(f"{params.seed}/{index}".encode(), digest_size=8).digest()
        gen.manual_seed(int.from_bytes(digest, "little") >> 1)
    return gen


def skip_draws(generator: torch.Generator | None, n: int) -> None:
    """Advance a request's stream past `n` tokens' draws (one uniform per token).

    Prefill samples the first token and the decode engine the rest, each with its own
    `new_generator(params)`; the decode side skips the draw prefill used, so a seeded
    request yields exactly what one generator drawing every token would.
    """
    if generator is not None and n > 0:
        torch.rand(n, generator=generator)


class Sampler:
    """Greedy, temperature, top-k and top-p (nucleus) sampling over a batch.

    Rows of the batch may use different settings; greedy rows take the argmax, the
    rows that filter (top-k, top-p) are sorted and filtered together, and every sampled
    row draws from its own generator: a row's token depends on its logits, settings and
    generator only, never on the rows beside it.
    """

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """One token id per row of `logits` `[B, vocab]`."""
        batch, vocab = logits.shape
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"{batch} rows of logits, {len(params)} params, {len(generators)} generators"
            )
        out = [0] * batch
        random_rows: list[int] = []
        greedy_rows: list[int] = []
        for i, p in enumerate(params):
            (greedy_rows if is_greedy(p) else random_rows).append(i)
        if greedy_rows:
            picks = logits[greedy_rows].argmax(dim=-1).tolist()
            for i, tok in zip(greedy_rows, picks, strict=True):
                out[i] = int(tok)
        if not random_rows:
            return out
        # Rows that filter draw through the descending order of their logits, the others
        # through the vocabulary's order. Each group is drawn on its own: were the whole
        # batch sorted because one row filters, an unfiltered row's token would depend
        # on its neighbours.
        filtered = [i for i in random_rows if needs_filter(params[i], vocab)]
        plain = [i for i in random_rows if not needs_filter(params[i], vocab)]
        for group, sort in ((filtered, True), (plain, False)):
            if group:
                picks = _draw(
                    logits[group], [params[i] for i in group], [generators[i] for i in group], sort
                )
                for i, tok in zip(group, picks, strict=True):
                    out[i] = tok
        return out


def needs_filter(params: SamplingParams, vocab: int) -> bool:
    """Whether a sampled row keeps only part of the vocabulary (top-k or top-p)."""
    return 0 < params.top_k < vocab or params.top_p < 1.0


def _draw(
    logits: torch.Tensor,
    rows: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    sort: bool,
) -> list[int]:
    """One token per row of `logits[...]` by inverse-CDF sampling: one uniform number
    from each row's generator, over the descending order of its logits when `sort`
    (filtering by top-k and top-p keeps a prefix of that order), else over the
    vocabulary's order."""
    vocab = logits.shape[-1]
    device = logits.device
    temps = torch.tensor([p.temperature for p in rows], dtype=torch.float32, device=device)
    scaled = logits.float() / temps[:, None]
    order: torch.Tensor | None = None
    if sort:
        # Stable, so ties break the same way every time.
        scaled, order = scaled.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab, device=device)
        top_k = torch.tensor(
            [p.top_k if 0 < p.top_k < vocab else vocab for p in rows], device=device
        )
        scaled = scaled.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        top_p = torch.tensor([p.top_p for p in rows], dtype=torch.float32, device=device)
        # Drop a token once the mass before it already reaches top_p; the first
        # token always stays.
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= top_p[:, None], 0.0)
    else:
        probs = torch.softmax(scaled, dim=-1)
    cdf = probs.cumsum(dim=-1)
    draws = []
    for gen in generators:
        if gen is None:
            raise ValueError("a sampled row has no generator (see new_generator)")
        draws.append(float(torch.rand((), generator=gen)))
    targets = torch.tensor(draws, dtype=cdf.dtype, device=device)[:, None] * cdf[:, -1:]
    # right=True picks the first index whose cumulative mass exceeds the target, so a
    # token with zero probability (filtered) can never be chosen.
    picks = torch.searchsorted(cdf, targets, right=True).clamp_(max=vocab - 1)
    if order is not None:
        picks = order.gather(1, picks)
    return [int(t) for t in picks[:, 0].tolist()]
