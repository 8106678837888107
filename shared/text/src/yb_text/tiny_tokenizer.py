"""A small byte-level BPE tokenizer built in code, for the tiny random test model.

Tests must run offline and fast, so the tiny model cannot borrow a hub tokenizer. Byte
level keeps it a real tokenizer: every string encodes, and a multi-byte character spans
several tokens, which is exactly what incremental detokenization has to get right. A few
merges give it multi-character tokens too.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, the same template shape SmolLM2 uses, so prompts look alike in tests.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Pairs in byte-level alphabet spelling ("Ġ" is a space); order is merge priority.
_MERGES = (
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("e", "r"),
    ("a", "n"),
    ("o", "n"),
    ("Ġ", "a"),
    ("r", "e"),
    ("Ġ", "s"),
    ("Ġ", "c"),
    ("a", "r"),
    ("i", "s"),
    ("Ġ", "P"),
    ("Ġ", "w"),
    ("o", "u"),
)


@lru_cache(maxsize=1)
def _build() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for left, right in _MERGES:
        vocab.setdefault(left + right, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh transformers tokenizer over the tiny byte-level vocabulary (~290 ids).

    `<|im_end|>` is the EOS token, as in SmolLM2's chat format.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=_build(),
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
