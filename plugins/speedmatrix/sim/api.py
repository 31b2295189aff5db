"""vLLM's wire rules for the simulator's requests: JSON, error bodies, and the request checks.

One job: what a request may be and how a refusal reads, as vLLM 0.32 answers (its error body
``{"error": {"message", "type", "param", "code"}}``, its messages word for word, pydantic's lax
booleans), kept apart from the server's clock and streaming so the rules read in one place.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from speedmatrix.sim.profile import Profile
from speedmatrix.sim.tokenizer import Tokenizer

try:
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    loads = orjson.loads
except ImportError:  # pragma: no cover - orjson is a project dependency

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    loads = json.loads


class ApiError(Exception):
    def __init__(self, status: int, message: str, etype: str = "BadRequestError", param=None):
        super().__init__(message)
        self.status, self.message, self.etype, self.param = status, message, etype, param


def error_response(status: int, message: str, etype: str, param: str | None = None):
    body = {"error": {"message": message, "type": etype, "param": param, "code": status}}
    return web.Response(status=status, body=dumps(body), content_type="application/json")


def read_flag(data: dict[str, Any], name: str, *, nullable: bool) -> bool:
    """A boolean field read as vLLM's pydantic request model reads it.

    pydantic's lax mode lets "true", "no", 1 or 0 through, so a client that sends them works
    against vLLM and must work here; anything else is the 400 vLLM's validation handler writes.
    """
    value = data.get(name, False)
    if value is True or value is False or (value is None and nullable):
        return bool(value)
    from pydantic import TypeAdapter, ValidationError  # rare path: keep it off the import

    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError as exc:
        e = exc.errors()[0]
        err = {"type": e["type"], "loc": ("body", name), "msg": e["msg"], "input": value}
        raise ApiError(400, f"1 validation error:\n  {err} {[err]}", "Bad Request") from exc


TEXT_PARTS = ("text", "input_text", "refusal")
"""Content-part types vLLM reads as text (its chat_utils); any other (an image, audio) is a
multimodal input the simulated text-only model refuses, as vLLM's text-only models do."""


def content_text(content: Any) -> str:
    """A message's content as the text the template sees, read as vLLM reads it.

    The OpenAI format allows a string, null (an assistant turn with tool calls), or a list of
    content parts: ``{"type": "text", "text": …}`` and the other text types, or a bare string.
    vLLM joins the text parts with newlines (its "string" content format), so the prompt a
    GuideLLM or `vllm bench serve` request makes (a one-part list) is the same prompt here."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, "message content must be a string or a list of parts", param="messages")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type", "text") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get(kind) or part.get("text"), str):
            texts.append(part.get(kind) if isinstance(part.get(kind), str) else part["text"])
        elif kind is None or not isinstance(kind, str) or kind in TEXT_PARTS:
            raise ApiError(400, f"content part without text: {part!r}"[:200], param="messages")
        else:
            raise ApiError(
                400, f"{kind!r} content is not supported: the model is text-only", "messages"
            )
    return "\n".join(texts)


def chat_text(messages: Any, add_generation_prompt: bool = True) -> str:
    """The simulator's chat template: ``<|role|> content`` per message, one per line, then
    ``<|assistant|>`` when a generation prompt is asked for (vLLM's default)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    parts = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "each message needs a role and content", param="messages")
        parts.append(f"<|{m['role']}|> {content_text(m.get('content'))}")
    return "\n".join(parts) + ("\n<|assistant|>" if add_generation_prompt else "")


def prompt_ids(tokenizer: Tokenizer, prompt: Any) -> list[int]:
    """The token ids of a completions ``prompt``: a string, a list of ids, or a one-element
    list of either (vLLM takes one prompt per request here); a 400 otherwise."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list):
        ids = prompt
        bad = tokenizer.out_of_vocab(ids)
        if bad is not None:
            raise ApiError(400, f"Token id {bad} is out of vocabulary", param="prompt")
    else:
        raise ApiError(
            400, "prompt must be a string or a list of token ids (one prompt)", param="prompt"
        )
    if not ids:
        raise ApiError(400, "You must pass at least one prompt")
    return ids


def completion_params(
    profile: Profile, data: dict[str, Any], ids: list[int], default_max: int | None
):
    """A completion request's fields checked as vLLM 0.32 checks them (a 400 or 404 with its
    message otherwise): ``(max_tokens, min_tokens, ignore_eos, stream, stream_options, cache_salt)``,
    max_tokens clamped to the room max-model-len leaves."""
    p = profile
    model = data.get("model")
    if model is not None and model != p.served_model_name:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    # vLLM 0.32's boundary: more than max_model_len prompt tokens is refused here (the
    # renderer's length check); exactly max_model_len passes it, and then has no room
    # for one output token: max_tokens is clamped to max_model_len - prompt = 0, which
    # SamplingParams refuses ("max_tokens must be at least 1, got 0.").
    if len(ids) > p.max_model_len:
        # vLLM words a count of exactly max_model_len + 1 "at least" (its tokenizer stops
        # there for text; it says so for token ids too)
        least = "at least " if len(ids) == p.max_model_len + 1 else ""
        raise ApiError(
            400,
            f"This model's maximum context length is {p.max_model_len} tokens. However, "
            f"your prompt contains {least}{len(ids)} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={len(ids)})",
            param="input_tokens",
        )
    max_tokens = data.get("max_tokens", data.get("max_completion_tokens", default_max))
    if max_tokens is None:
        max_tokens = p.max_model_len - len(ids)
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        # vLLM's get_max_tokens: what would pass max_model_len is shortened, silently
        max_tokens = min(max_tokens, p.max_model_len - len(ids))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(
            400,
            f"max_tokens must be at least 1, got {max_tokens}. "
            f"(parameter=max_tokens, value={max_tokens})",
            param="max_tokens",
        )
    # vLLM raises these two without naming a parameter: param is null.
    min_tokens = data.get("min_tokens", 0)
    if not isinstance(min_tokens, int) or min_tokens < 0:
        raise ApiError(400, f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise ApiError(
            400,
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
        )
    stream = read_flag(data, "stream", nullable=True)
    ignore_eos = read_flag(data, "ignore_eos", nullable=False)
    opts = data.get("stream_options")
    if opts is not None and not stream:
        raise ApiError(
            400,
            "Stream options can only be defined when `stream=True`.",
            param="stream_options",
        )
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    salt = data.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(400, "cache_salt must be a non-empty string", param="cache_salt")
    return max_tokens, min_tokens, ignore_eos, stream, opts or {}, salt
