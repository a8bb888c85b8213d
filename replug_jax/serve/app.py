"""``replug serve``: any in-process Flax LM behind an OpenAI-compatible completions API.

Implements ``POST /v1/completions`` with ``prompt`` (string or list), ``max_tokens``
(0 = score only), ``echo``, ``logprobs`` (top-n per token, OpenAI's legacy shape with
``tokens``, ``token_logprobs``, ``text_offset``, ``top_logprobs``, as OpenAI and vLLM answer
it), ``temperature`` (0 = greedy), ``top_p``, ``stop``, ``seed``, and vLLM's
``prompt_logprobs``; ``POST /v1/chat/completions`` with ``messages`` (rendered with the
model's chat template; a final assistant message is continued), ``max_tokens`` /
``max_completion_tokens``, ``logprobs`` / ``top_logprobs`` (the per-token ``content[]``
shape); plus ``GET /v1/models`` and ``GET /health``. The API backend and the ``openai``
package are tested against it, and researchers can put any local model behind it.

Under load, requests wait in a bounded queue; one worker takes the oldest and, for up to
``batch_window_s``, every queued request that can share its forward passes (scoring requests
always; greedy generations with the same ``max_tokens`` and ``stop``), and runs them as one
batch: one bucketed scoring call, one coordinated decode. A full queue answers 429 with
``Retry-After``; a request that waits longer than ``request_timeout_s`` answers 504. Every
limit (:class:`ServeLimits`) is a 400 that names it. With an API key (``--api-key`` or
``$REPLUG_SERVE_API_KEY``) every ``/v1`` route needs ``Authorization: Bearer <key>``; the key
is compared in constant time and never logged.
"""

import collections
import dataclasses
import queue
import secrets
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np

from replug_jax.imports import require
from replug_jax.serve.logprobs import (
    content_logprobs,
    logprob_blocks,
    public,
    token_bytes,
    tokens_with_offsets,
)
from replug_jax.serve.limits import (
    RequestError,
    ServeLimits,
    chat_prompt,
    chat_request_model,
    request_model,
    validate,
)

if TYPE_CHECKING:  # the limits are read by the CLI parser, which must not load JAX
    from replug_jax.lm.flax_scorer import FlaxLM

API_KEY_ENV = "REPLUG_SERVE_API_KEY"


@dataclasses.dataclass
class _Job:
    req: Any
    prompts: list[str]
    encoded: list[tuple[list[int], list[str], list[int]]]  # each prompt's ids, strings, offsets
    key: tuple  # requests with equal keys can share one decode
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    cancelled: bool = False


class Batcher:
    """The bounded request queue and the worker that runs compatible requests as one batch."""

    def __init__(self, lm: "FlaxLM", limits: ServeLimits):
        self.lm, self.limits = lm, limits
        self.queue: queue.Queue[_Job] = queue.Queue(maxsize=limits.queue_size)
        self.stats = {"requests": 0, "batches": 0, "largest_batch": 0, "rejected_full": 0,
                      "timed_out": 0}
        self._deferred: collections.deque[_Job] = collections.deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replug-serve-batcher",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def key(req) -> tuple:
        if req.max_tokens == 0:
            return ("score",)
        if req.temperature > 0:  # sampled: its own seed and RNG stream, never shared
            return ("sample", uuid.uuid4().hex)
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        return ("greedy", req.max_tokens, stop)

    def submit(self, req, prompts: list[str], encoded: list) -> dict:
        job = _Job(req, prompts, encoded, self.key(req))
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            self.stats["rejected_full"] += 1
            raise RequestError(429, f"the server is busy: {self.limits.queue_size} requests "
                               "are already queued (queue_size); retry later",
                               {"Retry-After": "1"}) from None
        if not job.done.wait(self.limits.request_timeout_s):
            job.cancelled = True
            self.stats["timed_out"] += 1
            raise RequestError(504, f"the request did not finish within "
                               f"{self.limits.request_timeout_s:g} s (request_timeout_s)")
        if job.error is not None:
            raise job.error
        return job.result

    def close(self) -> None:
        """Finish what is queued, then stop the worker."""
        self._stop.set()
        self._thread.join(timeout=self.limits.request_timeout_s)

    def _next(self, timeout: float) -> _Job | None:
        if self._deferred:
            return self._deferred.popleft()
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _run(self) -> None:
        while not (self._stop.is_set() and self.queue.empty() and not self._deferred):
            first = self._next(0.1)
            if first is None:
                continue
            group, later = [first], []
            rows = len(first.prompts)
            deadline = time.monotonic() + self.limits.batch_window_s
            while rows < self.limits.max_batch:
                job = self._next(max(0.0, deadline - time.monotonic()))
                if job is None:
                    break
                if job.key == first.key and rows + len(job.prompts) <= self.limits.max_batch:
                    group.append(job)
                    rows += len(job.prompts)
                else:
                    later.append(job)
            self._deferred.extend(later)
            group = [j for j in group if not j.cancelled]
            if not group:
                continue
            try:
                results = run_batch(self.lm, group)
                for job, result in zip(group, results):
                    job.result = result
            except BaseException as err:  # surfaced to every request of the batch
                for job in group:
                    job.error = err
            self.stats["requests"] += len(group)
            self.stats["batches"] += 1
            self.stats["largest_batch"] = max(self.stats["largest_batch"], len(group))
            for job in group:
                job.done.set()


def run_batch(lm: "FlaxLM", jobs: list[_Job]) -> list[dict]:
    """Answer every job of a batch: one coordinated decode for all their prompts (the jobs
    share a key), then one batched scoring pass for every logprob block."""
    flat = [(j, i, p) for j, job in enumerate(jobs) for i, p in enumerate(job.prompts)]
    req0 = jobs[0].req
    gen = {}
    if req0.max_tokens > 0:
        stop = [req0.stop] if isinstance(req0.stop, str) else list(req0.stop or [])
        # rows padded to a power of two (copies of the first prompt, discarded): a few decode
        # shapes to compile rather than one per batch size
        rows = [[p] for _, _, p in flat]
        rows += [rows[0]] * ((1 << (len(rows) - 1).bit_length()) - len(rows))
        g = lm.generate_ensemble(rows, np.zeros((len(rows), 1), np.float32),
                                 max_new_tokens=req0.max_tokens,
                                 sampling_temperature=max(req0.temperature, 0.0), top_p=req0.top_p,
                                 stop=stop, seed=req0.seed if req0.seed is not None
                                 else secrets.randbits(32))  # unseeded: a fresh stream
        for n, (j, i, _) in enumerate(flat):
            gen[j, i] = (g.token_ids[n], g.texts[n],
                         "stop" if g.stopped_by[n] in ("eos", "stop") else "length")
    items, where = [], []
    choices: dict[tuple[int, int], dict] = {}
    for j, i, prompt in flat:
        req = jobs[j].req
        ids, strings, offsets = jobs[j].encoded[i]
        gen_ids, text, finish = gen.get((j, i), ([], "", "length"))
        choices[j, i] = {"index": i, "text": (prompt if req.echo else "") + text,
                         "finish_reason": finish, "logprobs": None,
                         "_usage": (len(ids), len(gen_ids))}
        if req.logprobs is not None:
            all_ids = ids + list(gen_ids)
            full_text = prompt + lm.tokenizer.decode(gen_ids)
            _, all_strings, all_offsets = tokens_with_offsets(lm, full_text) \
                if gen_ids else (ids, strings, offsets)
            if len(all_strings) != len(all_ids):  # re-tokenisation merged tokens
                all_strings = strings + [lm.tokenizer.decode([t]) for t in gen_ids]
                all_offsets = offsets + [len(prompt) + len(lm.tokenizer.decode(gen_ids[:k]))
                                         for k in range(len(gen_ids))]
            items.append((all_ids, all_strings, all_offsets, 0 if req.echo else len(ids),
                          req.logprobs))
            where.append((j, i, "logprobs"))
        if req.prompt_logprobs is not None:
            items.append((ids, strings, offsets, 0, req.prompt_logprobs))
            where.append((j, i, "prompt_logprobs"))
    for (j, i, field), block in zip(where, logprob_blocks(lm, items) if items else []):
        if field == "logprobs":
            choices[j, i]["logprobs"] = block
        else:
            ids = items[where.index((j, i, field))][0]
            choices[j, i]["prompt_logprobs"] = prompt_logprob_entries(
                lm, ids, block["tokens"], block["token_logprobs"], block["_top_ids"])
    out = []
    for j, job in enumerate(jobs):
        mine = [choices[j, i] for i in range(len(job.prompts))]
        usage_in = sum(c["_usage"][0] for c in mine)
        usage_out = sum(c.pop("_usage")[1] for c in mine)
        out.append({"choices": mine, "usage": {"prompt_tokens": usage_in,
                                               "completion_tokens": usage_out,
                                               "total_tokens": usage_in + usage_out}})
    return out


def prompt_logprob_entries(lm, ids, strings, logprobs, top_ids) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first, which nothing
    predicts) a dict by token id of ``{"logprob", "rank", "decoded_token"}``: the prompt's
    own token first (as vLLM orders it: clients read it there), then the top-N alternatives.
    The rank (1 = likeliest) is given where it is known: for the top-N, and for the prompt's
    token when it is among them (else None)."""
    out: list[dict | None] = []
    for p, (t, s, lp) in enumerate(zip(ids, strings, logprobs)):
        if lp is None:
            out.append(None)
            continue
        top = (top_ids[p] if top_ids is not None else None) or []
        rank = next((r + 1 for r, (x, _) in enumerate(top) if x == t), None)
        entry = {str(t): {"logprob": lp, "rank": rank, "decoded_token": s,
                          "bytes": list(token_bytes(lm, t, in_text=True))}}
        for r, (x, v) in enumerate(top):
            entry.setdefault(str(x), {"logprob": v, "rank": r + 1,
                                      "decoded_token": lm.tokenizer.decode([x])})
        out.append(entry)
    return out


def create_app(lm: "FlaxLM", model_name: str | None = None, *,
               limits: ServeLimits | None = None, api_key: str | None = None):
    """The FastAPI application serving ``lm`` (see the module docstring)."""
    fastapi = require("fastapi", "serve", "replug serve")
    responses = require("fastapi.responses", "serve", "replug serve")
    FastAPI, Request, Depends = fastapi.FastAPI, fastapi.Request, fastapi.Depends
    CompletionRequest = request_model()
    ChatRequest = chat_request_model()
    limits = limits or ServeLimits()
    name = model_name or lm.name
    batcher = Batcher(lm, limits)
    app = FastAPI(title="replug-jax LM server", version="1")
    app.state.batcher = batcher
    app.router.add_event_handler("shutdown", batcher.close)

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(),
                                                                    api_key.encode()):
            raise RequestError(401, "missing or wrong API key (Authorization: Bearer ...)",
                               {"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestError)
    def refused(request, err: RequestError):
        return responses.JSONResponse({"error": {"message": str(err), "code": err.status}},
                                      status_code=err.status, headers=err.headers)

    @app.exception_handler(fastapi.exceptions.RequestValidationError)
    def invalid(request, err):
        # Not FastAPI's default, which echoes the input back: a NaN in it cannot be JSON.
        problems = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}"
                             for e in err.errors())
        return refused(request, RequestError(422, f"invalid request: {problems}"))

    @app.middleware("http")
    async def body_limit(request, call_next):
        # Content-Length is required and checked before the body is read; the HTTP layer then
        # holds the body to it, so no request can make the server buffer more.
        declared = request.headers.get("content-length")
        if request.method == "POST" and declared is None:
            return refused(request, RequestError(
                400, f"a request body needs a Content-Length (at most {limits.max_body_bytes} "
                "bytes, max_body_bytes)"))
        if declared is not None and (not declared.isdigit()
                                     or int(declared) > limits.max_body_bytes):
            return refused(request, RequestError(
                400, f"the request body exceeds the limit of {limits.max_body_bytes} bytes "
                "(max_body_bytes)"))
        return await call_next(request)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": name, "queued": batcher.queue.qsize(),
                **batcher.stats}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model",
                                            "owned_by": "replug-jax"}]}

    def complete(req) -> dict[str, Any]:
        prompts = validate(req, lm, limits)
        encoded = [tokens_with_offsets(lm, prompt) for prompt in prompts]  # once per prompt
        for i, (ids, _, _) in enumerate(encoded):
            if not lm.bos and not ids:  # nothing to condition on: not the padding token
                raise RequestError(400, f"prompt {i} is empty and this model has no BOS token "
                                   "to condition on: send some text")
            if len(lm.bos) + len(ids) + req.max_tokens > lm.max_context:
                raise RequestError(400, f"prompt of {len(ids)} tokens plus max_tokens exceeds "
                                   f"the context of {lm.max_context}")
        return batcher.submit(req, prompts, encoded)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    def completions(req: CompletionRequest) -> dict[str, Any]:
        result = complete(req)
        for choice in result["choices"]:
            if choice.get("logprobs") is not None:
                choice["logprobs"] = public(choice["logprobs"])
        return {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion",
                "created": int(time.time()), "model": name, **result}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    def chat_completions(req: ChatRequest) -> dict[str, Any]:
        if req.logprobs and req.top_logprobs is None:
            top = 0
        elif req.top_logprobs is not None and not req.logprobs:
            raise RequestError(400, "top_logprobs needs logprobs: true")
        else:
            top = req.top_logprobs if req.logprobs else None
        max_tokens = next((n for n in (req.max_completion_tokens, req.max_tokens)
                           if n is not None), 16)  # an explicit 0 is 0
        result = complete(CompletionRequest(
            model=req.model, prompt=chat_prompt(lm, [m.model_dump() for m in req.messages]),
            max_tokens=max_tokens, logprobs=top, temperature=req.temperature,
            top_p=req.top_p, stop=req.stop, seed=req.seed))
        [choice] = result["choices"]
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion",
                "created": int(time.time()), "model": name, "usage": result["usage"],
                "choices": [{"index": 0, "finish_reason": choice["finish_reason"],
                             "message": {"role": "assistant", "content": choice["text"]},
                             "logprobs": None if choice["logprobs"] is None else
                             content_logprobs(lm, choice["logprobs"])}]}

    return app


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, insecure: bool = False) -> None:
    """Refuse to serve beyond the loopback interface without an API key (unless
    ``insecure``): anyone who reaches the port could use the model."""
    if not is_loopback(host) and api_key is None and not insecure:
        raise ValueError(f"refusing to serve on {host} without an API key: anyone who reaches "
                         f"the port could use it; pass --api-key (or ${API_KEY_ENV}), or "
                         "--insecure")


def serve(lm: "FlaxLM", host: str = "127.0.0.1", port: int = 8000,
          model_name: str | None = None, *, limits: ServeLimits | None = None,
          api_key: str | None = None, insecure: bool = False) -> None:
    """Run the server until interrupted; on SIGINT/SIGTERM, requests in flight finish."""
    check_exposure(host, api_key, insecure)
    uvicorn = require("uvicorn", "serve", "replug serve")
    limits = limits or ServeLimits()
    uvicorn.run(create_app(lm, model_name, limits=limits, api_key=api_key), host=host,
                port=port, log_level="info",
                timeout_graceful_shutdown=int(limits.request_timeout_s))
