"""Request prompts to token ids, off the event loop.

Tokenizing is CPU work in proportion to the text (SmolLM2's tokenizer: about 0.2 s per
500k characters). On the asyncio thread, eight ~1 MB prompts held ``/health`` for 6.8 s
and stalled every open stream. So :class:`Prompts` does on the loop only what is cheap
(the character cap, token-id ranges) and renders chat templates and tokenizes in its own
worker thread (the tokenizer releases the GIL). One worker: a Hugging Face fast tokenizer
is not meant for concurrent calls, and the cap bounds each job.

The cap: a prompt longer than ``CHARS_PER_TOKEN * max_model_len`` characters (chat: the
messages' contents together) cannot fit the context unless its tokens average more than
``CHARS_PER_TOKEN`` characters, which natural text never does, so it is refused before
it is tokenized: 400 ``context_length_exceeded``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from pagedkv.server.protocol import APIError

CHARS_PER_TOKEN = 32   # generous: English BPE averages about 4 characters per token
T = TypeVar("T")


class Prompts:
    """Prompts -> ``{"prompt_token_ids": [...], "prompt": str | None}`` for the engine loop.
    ``vocab_size``: token ids must be in ``[0, vocab_size)``."""

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_chars = CHARS_PER_TOKEN * max_model_len
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-tokenize")

    def close(self) -> None:
        """Drop queued jobs; a running one ends on its own (the thread does not block exit)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def completion(self, prompts: list) -> list[dict]:
        """Each prompt (a string or token ids, as ``parse_completion`` checked them).
        Raises APIError 400: over the character cap, or a token id outside the vocabulary."""
        for p in prompts:
            if isinstance(p, str):
                self._check_chars(len(p), "prompt")
            else:
                self._check_ids(p)
        return await self._off_loop(lambda: [self.completion_prompt(p) for p in prompts])

    async def chat(self, messages: list[dict]) -> dict:
        """The messages rendered with the chat template, then tokenized. Raises APIError 400:
        no chat template, over the character cap, or the template refused the messages."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", code="no_chat_template")
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        return await self._off_loop(lambda: self.chat_prompt(messages))

    # ---- worker thread ---------------------------------------------------------------
    def completion_prompt(self, p) -> dict:
        if isinstance(p, str):
            return {"prompt_token_ids": self._encode(p), "prompt": p}
        return {"prompt_token_ids": list(p), "prompt": None}

    def chat_prompt(self, messages: list[dict]) -> dict:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template may raise on e.g. role order
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        return {"prompt_token_ids": self._encode(text), "prompt": text}

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    # ---- event loop ------------------------------------------------------------------
    async def _off_loop(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _check_chars(self, n: int, param: str) -> None:
        if n > self.max_chars:
            raise APIError(400, f"the prompt has {n} characters, over the limit of {self.max_chars} "
                           f"({CHARS_PER_TOKEN} per token x max_model_len); it cannot fit the context",
                           param=param, code="context_length_exceeded")

    def _check_ids(self, ids: list[int]) -> None:
        bad = next((t for t in ids if t >= self.vocab_size), None)  # parse_completion refused t < 0
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                           param="prompt", code="invalid_value", reason="out_of_vocabulary")
