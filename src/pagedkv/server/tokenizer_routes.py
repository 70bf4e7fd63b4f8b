"""vLLM's tokenizer endpoints, so tools can count and score tokens exactly as the engine does.

    POST /tokenize        {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
                       or {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false}
                          -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize      {"tokens": [int]} -> {"prompt": str}
    GET  /tokenizer_info  -> {"tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token",
                              "model_max_length", "chat_template"}

Request and response shapes are vLLM's (``vllm/entrypoints/openai/protocol.py``,
``TokenizeCompletionRequest``, ``TokenizeChatRequest``, ``DetokenizeRequest``);
lm-evaluation-harness (0.4.9+) finds ``/tokenizer_info`` and ``/tokenize`` and then uses
the server's tokenizer instead of needing the model folder. A prompt here may be longer
than the context (the answer's ``count`` says by how much); the body limit bounds it.
Tokenizing runs on the server's tokenizer thread, never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.server.protocol import APIError, _bool, _str, _token_ids, bad, parse_messages


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None                 # exactly one of prompt and messages
    messages: list[dict] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


def parse_tokenize(body: dict) -> TokenizeRequest:
    """Check a ``/tokenize`` body. Raises :class:`APIError` (400)."""
    chat = body.get("messages") is not None
    if chat == (body.get("prompt") is not None):
        raise bad("prompt", "send exactly one of 'prompt' (a string) and 'messages'", "missing_required_parameter")
    prompt = None if chat else _str(body, "prompt")
    messages = parse_messages(body["messages"]) if chat else None
    return TokenizeRequest(model=_str(body, "model"), prompt=prompt, messages=messages,
                           add_special_tokens=_bool(body, "add_special_tokens", not chat),
                           add_generation_prompt=_bool(body, "add_generation_prompt", True),
                           return_token_strs=_bool(body, "return_token_strs", False))


def parse_detokenize(body: dict, vocab_size: int) -> tuple[str | None, list[int]]:
    """``(model, tokens)`` of a ``/detokenize`` body. Raises :class:`APIError` (400)."""
    if body.get("tokens") is None:
        raise bad("tokens", "'tokens' is required", "missing_required_parameter")
    tokens = _token_ids(body, "tokens")
    bad_id = next((t for t in tokens if t >= vocab_size), None)
    if bad_id is not None:
        raise APIError(400, f"token id {bad_id} is outside the vocabulary [0, {vocab_size})", param="tokens",
                       code="invalid_value")
    return _str(body, "model"), tokens


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """What a client needs to tokenize as the server does (vLLM's ``/tokenizer_info`` keys)."""
    return {"tokenizer_class": type(tokenizer).__name__, "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token, "model_max_length": max_model_len,
            "chat_template": getattr(tokenizer, "chat_template", None) or None}
