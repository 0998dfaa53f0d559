"""Turn a stream of token ids into a stream of text, one piece per token where possible.

Decoding a token alone is wrong for byte-level BPE (a character may span tokens) and for
SentencePiece (a leading space depends on the previous token). So each new piece is the text of
a short window of recent tokens minus the text of the same window without the newest ones, and
nothing is emitted while the window ends inside a UTF-8 character. When the request ends (its
token budget or its end-of-sequence token), `flush` gives what is still held back, a character cut
by the last token as U+FFFD, as Hugging Face's decode and vLLM show it — never silently dropped.
"""

from __future__ import annotations

from polylane.runtime.sampling.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start: tokens before it are settled text
        self.read_offset = 0  # tokens before it have been emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """The text of the tokens not emitted yet (a character cut short ends in U+FFFD)."""
        if self.read_offset == len(self.token_ids):
            return ""
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
