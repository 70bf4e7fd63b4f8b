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
MESSAGE_CHARS = 16     # a chat message's count beyond its text: the template's role and delimiters
                       # (so 30,000 empty messages cannot render into 150,000 tokens uncounted)
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
        self._check_template()
        self._check_chars(sum(len(m["content"]) + len(m.get("name", "")) + MESSAGE_CHARS for m in messages),
                          "messages")
        return await self._off_loop(lambda: self.chat_prompt(messages))

    async def tokenize(self, req) -> tuple[list[int], list[str] | None]:
        """A ``/tokenize`` request (:class:`~pagedkv.server.tokenizer_routes.TokenizeRequest`)
        -> ``(ids, token strings or None)``; no character cap (the body limit bounds it).
        Raises APIError 400: messages but no chat template, or the template refused them."""
        if req.messages is not None:
            self._check_template()

        def work():
            text = req.prompt if req.messages is None else self._render(req.messages, req.add_generation_prompt)
            ids = self.tokenizer(text, add_special_tokens=req.add_special_tokens).input_ids
            return ids, (self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None)
        return await self._off_loop(work)

    async def detokenize(self, ids: list[int]) -> str:
        """The text of ``ids`` (special tokens included, so it round-trips)."""
        return await self._off_loop(lambda: self.tokenizer.decode(ids))

    # ---- worker thread ---------------------------------------------------------------
    def completion_prompt(self, p) -> dict:
        if isinstance(p, str):  # with the tokenizer's special tokens (e.g. a BOS), as vLLM and LLM.generate
            return {"prompt_token_ids": self.tokenizer(p, add_special_tokens=True).input_ids, "prompt": p}
        return {"prompt_token_ids": list(p), "prompt": None}

    def chat_prompt(self, messages: list[dict]) -> dict:
        text = self._render(messages, True)
        return {"prompt_token_ids": self._encode(text), "prompt": text}

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template may raise on e.g. role order
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    # ---- event loop ------------------------------------------------------------------
    async def _off_loop(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _check_template(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", code="no_chat_template")

    def _check_chars(self, n: int, param: str) -> None:
        if n > self.max_chars:
            framing = f" (with {MESSAGE_CHARS} a message for the template's framing)" if param == "messages" else ""
            raise APIError(400, f"the prompt has {n} characters{framing}, over the limit of {self.max_chars} "
                           f"({CHARS_PER_TOKEN} per token x max_model_len); it cannot fit the context",
                           param=param, code="context_length_exceeded")

    def _check_ids(self, ids: list[int]) -> None:
        bad = next((t for t in ids if t >= self.vocab_size), None)  # parse_completion refused t < 0
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                           param="prompt", code="invalid_value", reason="out_of_vocabulary")
