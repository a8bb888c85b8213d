"""What ``replug serve`` accepts: its limits (:class:`ServeLimits`, which ``replug serve
--help`` prints), the completions and chat request models (pydantic, from the ``serve``
extra), the chat prompt a request continues, and the checks that refuse a request with a
:class:`RequestError` naming the limit it breaks."""

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from replug_jax.imports import require

if TYPE_CHECKING:
    from replug_jax.lm.flax_scorer import FlaxLM


def _limit(default, help: str, zero_ok: bool = False):
    return dataclasses.field(default=default, metadata={"help": help, "zero_ok": zero_ok})


@dataclasses.dataclass
class ServeLimits:
    """What one request may ask for, and how requests are queued and batched (each field's
    ``help`` is what ``replug serve --help`` prints)."""

    max_prompts: int = _limit(32, "prompts per request")
    max_tokens: int = _limit(512, "new tokens per prompt")
    max_logprobs: int = _limit(20, "top-n logprobs per token")
    max_prompt_logprobs: int = _limit(20, "top-n prompt_logprobs per token")
    max_body_bytes: int = _limit(1 << 20, "request body size in bytes")
    queue_size: int = _limit(64, "requests waiting before the server answers 429")
    max_batch: int = _limit(16, "prompts of concurrent requests run as one batch (requests "
                            "are never split)")
    batch_window_s: float = _limit(0.01, "seconds the worker waits to fill a batch",
                                   zero_ok=True)
    request_timeout_s: float = _limit(300.0, "seconds a request may wait and run before 504")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (value >= 0 if f.metadata["zero_ok"] else value > 0):
                raise ValueError(f"--{f.name.replace('_', '-')} must be "
                                 f"{'>= 0' if f.metadata['zero_ok'] else 'positive'}, got {value}")


def request_model():
    """The subset of OpenAI's legacy completions request we implement (plus vLLM's
    ``prompt_logprobs``), as a pydantic model (pydantic comes with the ``serve`` extra)."""
    pydantic = require("pydantic", "serve", "replug serve")

    class CompletionRequest(pydantic.BaseModel):
        model: str | None = None
        prompt: str | list[str]
        max_tokens: int = 16
        echo: bool = False
        logprobs: int | None = None
        temperature: float = 1.0
        top_p: float = 1.0
        stop: str | list[str] | None = None
        seed: int | None = None
        prompt_logprobs: int | None = None
        # what this server does not implement, declared so that a request asking for it is
        # refused (an ignored field would change the answer without a word)
        n: int = 1
        best_of: int | None = None
        presence_penalty: float = 0.0
        frequency_penalty: float = 0.0
        logit_bias: dict | None = None
        suffix: str | None = None

    return CompletionRequest


def chat_request_model():
    """OpenAI's chat-completions request, the subset that maps onto a completion."""
    pydantic = require("pydantic", "serve", "replug serve")

    class Message(pydantic.BaseModel):
        role: str
        content: str

    class ChatRequest(pydantic.BaseModel):
        model: str | None = None
        messages: list[Message]
        max_tokens: int | None = None
        max_completion_tokens: int | None = None
        logprobs: bool = False
        top_logprobs: int | None = None
        temperature: float = 1.0
        top_p: float = 1.0
        stop: str | list[str] | None = None
        seed: int | None = None

    return ChatRequest


def chat_prompt(lm: "FlaxLM", messages: list[dict]) -> str:
    """The text a chat request asks the model to continue: the messages through the model's
    chat template with the assistant's turn opened, or, when the last message is the
    assistant's, that message continued (a prefill)."""
    if not getattr(lm.tokenizer, "chat_template", None):
        raise RequestError(400, "this model has no chat template; use /v1/completions")
    if not messages:
        raise RequestError(400, "messages is empty")
    head, prefill = (messages[:-1], messages[-1]["content"]) \
        if messages[-1]["role"] == "assistant" else (messages, "")
    if not head:
        raise RequestError(400, "the messages need a turn before the assistant's")
    return lm.tokenizer.apply_chat_template(head, add_generation_prompt=True,
                                            tokenize=False) + prefill


class RequestError(ValueError):
    """A request the server refuses: ``status`` and a message that names the problem."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}


def validate(req, lm: "FlaxLM", limits: ServeLimits) -> list[str]:
    """The request's prompts, or a :class:`RequestError` naming the limit it breaks."""
    prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
    if not prompts:
        raise RequestError(400, "prompt is empty")
    checks = [
        (len(prompts) <= limits.max_prompts,
         f"{len(prompts)} prompts exceed the limit of {limits.max_prompts} per request "
         "(max_prompts)"),
        (req.max_tokens >= 0, "max_tokens must be >= 0"),
        (req.max_tokens <= limits.max_tokens,
         f"max_tokens {req.max_tokens} exceeds the limit of {limits.max_tokens} (max_tokens)"),
        (req.logprobs is None or 0 <= req.logprobs <= limits.max_logprobs,
         f"logprobs must be in 0..{limits.max_logprobs} (max_logprobs)"),
        (req.prompt_logprobs is None or 0 <= req.prompt_logprobs <= limits.max_prompt_logprobs,
         f"prompt_logprobs must be in 0..{limits.max_prompt_logprobs} (max_prompt_logprobs)"),
        (np.isfinite(req.temperature) and req.temperature >= 0,
         "temperature must be a finite number >= 0"),
        (np.isfinite(req.top_p) and 0 < req.top_p <= 1, "top_p must be in (0, 1]"),
        (req.seed is None or 0 <= req.seed < 2**32, "seed must be in 0..2**32-1"),
        *unsupported(req),
    ]
    for ok, message in checks:
        if not ok:
            raise RequestError(400, message)
    return prompts


def unsupported(req) -> list[tuple[bool, str]]:
    """Checks that the request asks for nothing this server does not do (one choice per
    prompt, no penalties, no logit bias, no suffix)."""
    return [
        (getattr(req, "n", 1) == 1 and getattr(req, "best_of", None) in (None, 1),
         "n and best_of other than 1 are not supported: send the request once per choice "
         "(with different seeds when sampling)"),
        (getattr(req, "presence_penalty", 0.0) == 0 and
         getattr(req, "frequency_penalty", 0.0) == 0,
         "presence_penalty and frequency_penalty are not supported (they would change the "
         "distribution REPLUG mixes)"),
        (not getattr(req, "logit_bias", None), "logit_bias is not supported"),
        (getattr(req, "suffix", None) in (None, ""), "suffix is not supported"),
    ]
