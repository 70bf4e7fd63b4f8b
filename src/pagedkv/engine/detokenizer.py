"""Incremental detokenization: each new token costs O(1), not a re-decode of the output.

Uses the ``tokenizers`` library's ``DecodeStream`` (it holds back bytes of a character
split across tokens and handles byte-level and SentencePiece-style decoders), fed the
output ids in order. A tokenizer without a fast backend falls back to decoding the
whole output per token (correct, O(n) per token).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Text of the tokens pushed so far, as ``tokenizer.decode(ids)`` would give it.

    Args:
        tokenizer: a Hugging Face tokenizer (fast: its ``backend_tokenizer`` is used).
        skip_special_tokens: leave special tokens' text out, as ``decode`` does.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.text = ""
        self._tokenizer, self._skip = tokenizer, skip_special_tokens
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._backend = None  # decode()'s clean-up rewrites earlier text: no streaming equivalent
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []

    def finish(self) -> str:
        """The request ended: the full decode of every pushed id (shows a character the
        output cut in two as U+FFFD, as ``decode`` does, instead of holding it back);
        returns the text it added."""
        full = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        piece = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full
        return piece

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completed (may be empty: a partial character)."""
        self._ids.append(token_id)
        if self._stream is None:
            new = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
            piece, self.text = new[len(self.text):], new
            return piece
        piece = self._stream.step(self._backend, token_id) or ""
        self.text += piece
        return piece
