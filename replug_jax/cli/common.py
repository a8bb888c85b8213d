"""What every ``replug`` sub-command shares: the parser class (errors in one line), argument
types that check values as they are parsed, ``--json``, output, and the JAX setup."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from replug_jax.remote import is_remote, local_copy


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``replug: error: …``, exit 2)."""

    def error(self, message: str):
        print(f"replug: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def retired(p: argparse.ArgumentParser, old: str, new: str) -> None:
    """The flag ``old`` of earlier releases, refused in one line that names ``new`` (its
    value, if given, is read first so that the message is about the name)."""
    class Refuse(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{old} is now {new}")

    p.add_argument(old, action=Refuse, nargs="?", help=argparse.SUPPRESS)


def _number(kind, test, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


positive_int = _number(int, lambda v: v > 0, "positive")
non_negative_int = _number(int, lambda v: v >= 0, ">= 0")
positive_float = _number(float, lambda v: v > 0, "positive")
non_negative_float = _number(float, lambda v: v >= 0, ">= 0")
unit_interval = _number(float, lambda v: 0 < v <= 1, "in (0, 1]")
open_unit_interval = _number(float, lambda v: 0 < v < 1, "in (0, 1)")  # a coverage
port_number = _number(int, lambda v: 0 < v < 65536, "in 1..65535")


def existing_file(text: str) -> pathlib.Path:
    path = pathlib.Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return path


def existing_dir(text: str) -> pathlib.Path:
    path = pathlib.Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    return path


def index_dir(text: str) -> pathlib.Path:
    if is_remote(text):  # gs://...: its local copy (pathlib would read "gs:/..." as local)
        try:
            return local_copy(text)
        except (FileNotFoundError, RuntimeError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    path = pathlib.Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such index directory")
    return path


def add_api_args(p, timeout: float, retries: int) -> None:
    """How to reach an OpenAI-compatible server (shared with ``replug api check``)."""
    p.add_argument("--api-model", default=None, help="model name sent to the API")
    p.add_argument("--api-endpoint", choices=("completions", "chat"), default="completions",
                   help="completions (default): /v1/completions with the raw prompt; chat: "
                   "/v1/chat/completions with the prompt as one user turn (the server applies "
                   "its chat template) and the text generated so far as a final assistant "
                   "message to continue. Chat endpoints give no prompt log-probs, so scoring "
                   "needs completions. The server is probed first (`replug api check`)")
    p.add_argument("--api-timeout", type=positive_float, default=timeout,
                   help=f"timeout per request in seconds (default {timeout:g})")
    p.add_argument("--api-retries", type=non_negative_int, default=retries,
                   help="retries of an API request after a 429, a 5xx, a timeout or a failed "
                   f"connection (exponential backoff from 0.5 s; default {retries})")
    p.add_argument("--api-concurrency", type=positive_int, default=4,
                   help="requests in flight at once (default 4)")
    p.add_argument("--api-batch-size", type=positive_int, default=16,
                   help="prompts per scoring request when the probe finds the server takes "
                   "a list of prompts (vLLM, replug serve), so it can batch them; one per "
                   "request otherwise (default 16)")


def command(parent, name: str, func, *, help: str, description: str | None = None,
            json: bool = True, **defaults) -> argparse.ArgumentParser:
    """A sub-command ``name`` of ``parent`` (a ``add_subparsers`` result) run by
    ``func(args) -> exit code``, with ``--json`` unless ``json=False``; ``defaults`` (such as
    ``check=fn``, what argument types cannot check) go to its parsed arguments."""
    p = parent.add_parser(name, help=help, description=description or help)
    p.set_defaults(func=func, **defaults)
    if json:
        add_json(p)
    return p


def mesh_shape(text: str) -> dict:
    """``data=2,model=4`` as an argparse type."""
    from replug_jax.sharding import parse_mesh

    try:
        return parse_mesh(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_flax_lm_args(p: argparse.ArgumentParser) -> None:
    """How an in-process Flax LM is loaded (``score``, ``generate``, ``ask``, ``serve``)."""
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="LM parameter and activation dtype; auto: bfloat16 on GPUs and TPUs, "
                        "float32 on a CPU (where bfloat16 is slower). Logits, log-softmax and "
                        "the mixture are float32 either way")
    p.add_argument("--mesh", type=mesh_shape, default=None, metavar="AXIS=SIZE,...",
                   help="shard the LM over a device mesh, e.g. model=8 (tensor parallel over "
                        "8 GPUs), data=2,model=4, or fsdp=2,model=4; axes data, fsdp, model "
                        "whose sizes multiply to the device count (every process's, in a "
                        "multi-host run). Default: one device")
    p.add_argument("--max-context", type=positive_int, default=2048,
                   help="LM context budget in tokens; documents are cut to fit")


def load_flax_lm(args):
    """The Flax LM ``--lm``/``--dtype``/``--mesh``/``--max-context`` describe (several
    processes join first when launched as such)."""
    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.sharding import initialize_distributed, make_mesh

    initialize_distributed()
    mesh = make_mesh(shape=args.mesh) if args.mesh else None
    return FlaxLM.load(args.lm, dtype=args.dtype, mesh=mesh, max_context=args.max_context)


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print machine-readable JSON instead of text")


def emit(args, obj, text: str) -> None:
    """``obj`` as one JSON line with ``--json``, else ``text``."""
    print(json.dumps(obj, ensure_ascii=False) if args.json else text)


def setup_jax() -> None:
    """Persistent compilation cache, so repeated runs skip XLA compilation."""
    import jax

    if jax.config.jax_compilation_cache_dir:  # already chosen by the caller (e.g. tests)
        return
    cache = os.environ.get("REPLUG_JAX_CACHE_DIR",
                           str(pathlib.Path.home() / ".cache" / "replug_jax" / "jax"))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def format_generation(r, title: str) -> str:
    """A generation with its note, its sources and λ, and its cost, as lines of text."""
    lines = [f"{title}: {r.text.strip()!r}"]
    if r.approximation:
        lines.append(f"  note: {r.approximation}")
    for src, w, text in zip(r.sources, r.weights, r.doc_texts):
        snippet = text if len(text) < 110 else text[:107] + "..."
        where = f" ({src['source_id']})" if src["source_id"] else ""
        lines.append(f"  λ={w:.3f}  #{src['id']}{where} {src['title']}: {snippet}")
    c = r.cost
    lines.append(f"  cost: {c['lm_calls']} LM rows, {c['input_tokens']} input + "
                 f"{c['output_tokens']} output tokens, LM {c['lm_seconds']:.2f}s, retrieval "
                 f"{c['retrieval_seconds']:.2f}s, wall {c['wall_seconds']:.2f}s"
                 + (f"; the server reused {c['cached_input_tokens']} cached prompt tokens"
                    if c.get("cached_input_tokens") else ""))
    return "\n".join(lines)
