"""Text in and out of the model: tokenizer loading, the tiny test tokenizer, and
incremental detokenization with stop strings. Needs transformers' tokenizers, not torch."""
