"""OpenAI-compatible request bodies (the subset lowbit serves) and the error body.

Fields the server cannot honour are refused with a 400 naming the field, rather than
accepted and ignored: n > 1, best_of, logprobs, echo, tools, response formats.
Unknown extra fields are ignored, as OpenAI-compatible servers commonly do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP = 4


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return stops

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Content as text; list content may hold only {"type": "text"} parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"message content part of type {part.get('type')!r} is not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


def unsupported(req: _Common) -> str | None:
    """Message naming the first field this server cannot honour, or None."""
    if req.n != 1:
        return "n > 1 is not supported; send n requests"
    if isinstance(req, CompletionRequest):
        if req.echo:
            return "echo is not supported"
        if req.logprobs is not None:
            return "logprobs is not supported"
        if req.best_of not in (None, 1):
            return "best_of is not supported"
        if req.suffix:
            return "suffix is not supported"
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs:
            return "logprobs is not supported"
        if req.tools:
            return "tools are not supported"
        if req.response_format and req.response_format.get("type") not in (None, "text"):
            return "response_format other than text is not supported"
    stops = req.stop_list()
    if len(stops) > MAX_STOP:
        return f"stop has {len(stops)} sequences; at most {MAX_STOP} are allowed"
    return None


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
