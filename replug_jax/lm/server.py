"""``replug serve``: any in-process Flax LM behind an OpenAI-compatible completions API.

Implements ``POST /v1/completions`` with ``prompt`` (string or list), ``max_tokens``
(0 = score only), ``echo``, ``logprobs`` (top-n per token, OpenAI legacy format with
``tokens``, ``token_logprobs``, ``text_offset``, ``top_logprobs``), ``temperature``
(0 = greedy), ``top_p``, ``stop``, ``seed``, and vLLM's ``prompt_logprobs``; plus
``GET /v1/models`` and ``GET /health``. The API backend is tested against it, and researchers
can put any local model behind it.
"""

import threading
import time
import uuid
from typing import Any

import numpy as np

from replug_jax.extras import require
from replug_jax.lm.flax_scorer import FlaxLM


def _request_model():
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

    return CompletionRequest


def _tokens_with_offsets(lm: FlaxLM, text: str) -> tuple[list[int], list[str], list[int]]:
    enc = lm.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = [s for s, _ in enc["offset_mapping"]]
    ends = [e for _, e in enc["offset_mapping"]]
    # Token strings are the exact slices of the text, so offsets and strings agree.
    strings = [text[s:(offsets[i + 1] if i + 1 < len(ids) else ends[i])]
               for i, s in enumerate(offsets)]
    return ids, strings, offsets


def _logprob_block(lm: FlaxLM, ids: list[int], strings: list[str], offsets: list[int],
                   start: int, n_top: int | None) -> dict:
    """OpenAI-style logprobs for tokens ``ids[start:]`` given everything before them."""
    seq = lm.bos + ids
    shift = len(lm.bos)
    token_lp: list[float | None] = []
    top: list[dict[str, float] | None] = []
    need = max(n_top or 0, 1)
    lp_top, id_top = lm.position_top_logprobs(seq, need)
    full = lm.score_token_ids([seq[:max(shift + start, 1)]], [seq[max(shift + start, 1):]])[0] \
        if len(seq) > max(shift + start, 1) else np.zeros(0, np.float32)
    offset = 0
    for i in range(start, len(ids)):
        pos = shift + i
        if pos == 0:  # first token without a BOS: nothing predicts it
            token_lp.append(None)
            top.append(None)
            continue
        token_lp.append(float(full[offset]))
        offset += 1
        if n_top:
            top.append({lm.tokenizer.decode([int(t)], skip_special_tokens=True): float(v)
                        for t, v in zip(id_top[pos - 1][:n_top], lp_top[pos - 1][:n_top])})
        else:
            top.append(None)
    return {"tokens": strings[start:], "token_logprobs": token_lp,
            "text_offset": offsets[start:], "top_logprobs": top if n_top else None}


def create_app(lm: FlaxLM, model_name: str | None = None):
    """The FastAPI application serving ``lm``. Requests run one at a time (one device)."""
    fastapi = require("fastapi", "serve", "replug serve")
    FastAPI, HTTPException = fastapi.FastAPI, fastapi.HTTPException
    CompletionRequest = _request_model()
    name = model_name or lm.name
    lock = threading.Lock()
    app = FastAPI(title="replug-jax LM server", version="1")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": name}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model",
                                            "owned_by": "replug-jax"}]}

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> dict[str, Any]:
        prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        if not prompts:
            raise HTTPException(400, "prompt is empty")
        if req.max_tokens < 0:
            raise HTTPException(400, "max_tokens must be >= 0")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        choices, usage_in, usage_out = [], 0, 0
        with lock:
            for i, prompt in enumerate(prompts):
                ids, strings, offsets = _tokens_with_offsets(lm, prompt)
                if len(lm.bos) + len(ids) + req.max_tokens > lm.max_context:
                    raise HTTPException(400, f"prompt of {len(ids)} tokens plus max_tokens "
                                        f"exceeds the context of {lm.max_context}")
                usage_in += len(ids)
                text, finish = "", "length"
                gen_ids: list[int] = []
                if req.max_tokens > 0:
                    g = lm.generate_ensemble([[prompt]], np.zeros((1, 1), np.float32),
                                             max_new_tokens=req.max_tokens,
                                             temperature=max(req.temperature, 0.0),
                                             top_p=req.top_p, stop=stop, seed=req.seed or 0)
                    gen_ids, text = g.token_ids[0], g.texts[0]
                    finish = "stop" if g.stopped_by[0] in ("eos", "stop") else "length"
                    usage_out += len(gen_ids)
                choice: dict[str, Any] = {"index": i, "text": (prompt if req.echo else "") + text,
                                          "finish_reason": finish, "logprobs": None}
                if req.logprobs is not None:
                    all_ids = ids + list(gen_ids)
                    full_text = prompt + lm.tokenizer.decode(gen_ids)
                    _, all_strings, all_offsets = _tokens_with_offsets(lm, full_text) \
                        if gen_ids else (ids, strings, offsets)
                    if len(all_strings) != len(all_ids):  # re-tokenisation merged tokens
                        all_strings = strings + [lm.tokenizer.decode([t]) for t in gen_ids]
                        all_offsets = offsets + [len(prompt) + len(lm.tokenizer.decode(
                            gen_ids[:j])) for j in range(len(gen_ids))]
                    start = 0 if req.echo else len(ids)
                    block = _logprob_block(lm, all_ids, all_strings, all_offsets, start,
                                           req.logprobs)
                    choice["logprobs"] = block
                if req.prompt_logprobs is not None:
                    block = _logprob_block(lm, ids, strings, offsets, 0, req.prompt_logprobs)
                    choice["prompt_logprobs"] = [
                        None if lp is None else {str(t): {"logprob": lp, "decoded_token": s}}
                        for t, s, lp in zip(ids, block["tokens"], block["token_logprobs"])]
                choices.append(choice)
        return {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion",
                "created": int(time.time()), "model": name, "choices": choices,
                "usage": {"prompt_tokens": usage_in, "completion_tokens": usage_out,
                          "total_tokens": usage_in + usage_out}}

    return app


def serve(lm: FlaxLM, host: str = "127.0.0.1", port: int = 8000,
          model_name: str | None = None) -> None:
    uvicorn = require("uvicorn", "serve", "replug serve")
    uvicorn.run(create_app(lm, model_name), host=host, port=port, log_level="info")
