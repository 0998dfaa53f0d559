"""From logits to text: the sampler with logit bias, grammar masks and logprobs (`sampler`), per-model
sampling defaults (`defaults`), grammar constraints (`grammar`), tokenizers and chat templates
(`tokenizer`) and incremental detokenising (`detokenizer`)."""
