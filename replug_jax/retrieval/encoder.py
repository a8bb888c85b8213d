"""Batched, bucketed, resumable text encoding with the BERT retriever (paper §3.1, Eq. 1).

Texts are tokenised, sorted by length inside each block, and padded to one of a few length
buckets with a fixed batch size, so ``jit`` compiles once per bucket and never per batch. On
GPUs and TPUs each batch is split over every local device (one jitted step over a ``("data",)``
mesh of the process's devices). Corpus embeddings go to a ``.npy`` memmap block by block; a
small progress file records the finished blocks, so an interrupted run resumes where it stopped
and produces byte-identical output.
"""

from __future__ import annotations

import copy
import json
import pathlib
import threading
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from replug_jax.fileio import write_json_atomic
from replug_jax.models import DEFAULT_RETRIEVER, RetrieverModel, load_retriever
from replug_jax.models.bert import embed, embeds_normalized
from replug_jax.models.params import split_params, to_module
from replug_jax.remote import is_remote, local_copy
from replug_jax.retrieval.embeddings import encoding_bar
from replug_jax.retrieval import fitted_tau

# Padding lengths. Finer steps than powers of two: on 2 CPU cores the demo corpus encodes in
# 27 s with these against 38 s with (16, 32, 64, ..., 512), for a few more compilations.
BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def default_batch_size() -> int:
    """8 on CPU (measured: 19 s for the demo corpus against 27 s at 32, since small batches
    stay in cache), 64 on accelerators."""
    return 8 if jax.default_backend() == "cpu" else 64


def _local_mesh(devices) -> jax.sharding.Mesh | None:
    """A ``("data",)`` mesh over ``devices`` (default: every local device on GPU/TPU; one
    device on CPU, where several devices are simulated on the same cores and buy nothing)."""
    if devices is None:
        devices = jax.local_devices() if jax.default_backend() != "cpu" else jax.local_devices()[:1]
    if len(devices) <= 1:
        return None
    return jax.sharding.Mesh(np.array(devices), ("data",),
                             axis_types=(jax.sharding.AxisType.Auto,))


class Retriever:
    """Tokenizer + BERT encoder + pooling, with ``encode_queries`` / ``encode_passages``.

    ``similarity="cosine"`` (the paper's Eq. 1, default) L2-normalises every embedding so that
    inner products are cosines; ``"dot"`` keeps raw pooled vectors (the official code).
    """

    def __init__(self, model: RetrieverModel, *, similarity: str = "cosine",
                 max_length: int = 512, batch_size: int | None = None, devices=None,
                 query_max_length: int | None = None, query_truncation: str = "left",
                 retrieval_temperature: float | None = None):
        if similarity not in ("cosine", "dot"):
            raise ValueError(f"similarity must be 'cosine' or 'dot', got {similarity!r}")
        if query_truncation not in ("left", "right"):
            raise ValueError(f"query_truncation must be 'left' or 'right', got "
                             f"{query_truncation!r}")
        self.model = model
        self.similarity = similarity
        self.max_length = min(max_length, model.config.max_position)
        # Queries keep their last tokens by default: for a language-modelling query (the text
        # before the continuation) the end is what matters.
        self.query_max_length = min(query_max_length or self.max_length,
                                    model.config.max_position)
        self.query_truncation = query_truncation
        if retrieval_temperature is not None and not retrieval_temperature > 0:
            raise ValueError(f"the retrieval temperature must be > 0, got "
                             f"{retrieval_temperature}")
        # The τ of λ = softmax(s / τ) fitted for this retriever on dev data (replug.json), which
        # Replug uses unless told otherwise; None: no fitted value, REPLUG's τ = 1 applies.
        self.retrieval_temperature = retrieval_temperature
        self.retrieval_temperature_source = ("given to the retriever"
                                             if retrieval_temperature is not None else None)
        self.mesh = _local_mesh(devices)
        self._device = None  # one device other than the default (see on_devices)
        # a separate query encoder (two towers, see load); None: this encoder embeds both
        self.query_tower: Retriever | None = None
        n_dev = 1 if self.mesh is None else self.mesh.devices.size
        batch_size = batch_size or default_batch_size()
        self.batch_size = -(-batch_size // n_dev) * n_dev  # a multiple of the device count
        longest = max(self.max_length, self.query_max_length)
        self.buckets = tuple(b for b in BUCKETS if b < longest) + (longest,)
        self.truncated = 0  # texts cut to max_length since creation
        self._replicated = None  # the loaded weights on every device of the mesh
        # other parameters (a refresh's snapshot, a training state) placed on the devices
        # once per parameter object, not once per batch or block: (params, placed) pairs
        self._placed: list[tuple[object, object]] = []
        self._placed_lock = threading.Lock()
        graphdef, template, self.params = split_params(model.encoder)
        self.normalize = normalize = embeds_normalized(similarity, model.normalize)
        pooling = model.pooling

        @jax.jit
        def _encode(params, ids_BL, mask_BL):
            return embed(to_module(graphdef, template, params), ids_BL, mask_BL,
                         pooling=pooling, normalize=normalize)

        self._encode = _encode

    @classmethod
    def load(cls, source: str = DEFAULT_RETRIEVER, **kwargs) -> "Retriever":
        """A retriever from any source; a folder exported from an LSR run brings its
        ``replug.json`` (similarity, the sequence lengths it was trained with and, once
        fitted, its retrieval temperature), which ``kwargs`` may still override."""
        source = str(local_copy(source)) if is_remote(source) else source
        settings_path = pathlib.Path(source) / "replug.json"
        passages = None
        if settings_path.is_file():
            trained = json.loads(settings_path.read_text())
            kwargs = {"similarity": trained["similarity"],
                      "max_length": trained["doc_max_length"],
                      "query_max_length": trained["query_max_length"],
                      "retrieval_temperature": (fitted_tau.in_settings(trained) or {}).get(
                          "temperature"), **kwargs}
            passages = trained.get("passage_encoder")
        if passages is None:
            out = cls(load_retriever(source), **kwargs)
        else:
            # two towers (a retriever whose query tower alone was trained): the folder is the
            # query encoder, the passage encoder lives in its subfolder
            out = cls(load_retriever(str(pathlib.Path(source) / passages)), **kwargs)
            out.query_tower = cls(load_retriever(source), **kwargs)
        if out.retrieval_temperature is not None and settings_path.is_file() and \
                out.retrieval_temperature == (fitted_tau.in_settings(trained) or {}).get(
                    "temperature"):
            out.retrieval_temperature_source = "the retriever's replug.json"
        return out

    @classmethod
    def for_index(cls, directory: str | pathlib.Path, source: str | None = None):
        """The query encoder an index was built with (recorded in its manifest; ``source``
        overrides the weights, not the pooling or similarity) and the index, loaded and
        checked against it: ``(retriever, index)``. A τ fitted on dev data with this index and
        query encoder (``replug fit-tau``, :mod:`~replug_jax.retrieval.fitted_tau`) becomes
        the retriever's."""
        from replug_jax.retrieval.faiss_index import Index

        enc = Index.info(directory)["encoder"]
        retriever = cls.load(source or enc.get("source", DEFAULT_RETRIEVER),
                             similarity=enc.get("similarity", "cosine"),
                             max_length=enc.get("max_length", 512))
        index = Index.load(directory, expect_encoder=retriever.identity)
        from replug_jax.retrieval import fitted_tau

        stored = fitted_tau.read(directory, retriever.identity)
        if stored is not None:  # fitted for this query encoder, corpus and an LM: it applies
            retriever.retrieval_temperature, retriever.retrieval_temperature_source = stored
        return retriever, index

    @property
    def dim(self) -> int:
        return self.model.config.hidden_size

    @property
    def identity(self) -> dict:
        """The passage encoder's identity (what an index built with it records), and the
        query tower's source and fingerprint when it has its own."""
        out = {"source": self.model.source, "fingerprint": self.model.fingerprint,
               "pooling": self.model.pooling, "similarity": self.similarity,
               "max_length": self.max_length}
        if self.query_tower is not None:
            out.update(query_source=self.query_tower.model.source,
                       query_fingerprint=self.query_tower.model.fingerprint)
        return out

    def tokenize(self, texts: Sequence[str], max_length: int | None = None,
                 side: str = "right") -> list[list[int]]:
        """Token ids with special tokens, cut to ``max_length`` (default: the passages')
        keeping the start (``side="right"``) or the end (``"left"``); cuts are counted and
        warned about."""
        limit = max_length or self.max_length
        tok = self.model.tokenizer
        ids = tok(list(texts), add_special_tokens=True, truncation=False,
                  verbose=False)["input_ids"]
        out, cut = [], 0
        for seq in ids:
            if len(seq) > limit:  # keep [CLS] and the final [SEP]
                seq = seq[: limit - 1] + seq[-1:] if side == "right" else \
                    seq[:1] + seq[len(seq) - limit + 1:]
                cut += 1
            out.append(seq)
        if cut:
            self.truncated += cut
            warnings.warn(f"{cut} text(s) longer than the encoder's maximum of "
                          f"{limit} tokens were truncated", stacklevel=3)
        return out

    def tokenize_fixed(self, texts: Sequence[str], length: int, side: str = "right"
                       ) -> tuple[np.ndarray, np.ndarray]:
        """Fixed-length ``[N, length]`` ids and mask (what a jitted training step takes), cut
        exactly as :meth:`tokenize` cuts them."""
        ids = self.tokenize(texts, length, side)
        ids_NL = np.full((len(ids), length), self.model.config.pad_token_id, np.int32)
        mask_NL = np.zeros((len(ids), length), np.int32)
        for i, seq in enumerate(ids):
            ids_NL[i, :len(seq)] = seq
            mask_NL[i, :len(seq)] = 1
        return ids_NL, mask_NL

    def _bucket(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def encode_ids(self, ids: list[list[int]], params=None,
                   on_batch: Callable[[int], None] | None = None) -> np.ndarray:
        """``[N, D]`` float32 embeddings of pre-tokenised texts, in input order.

        ``params`` (a nested dict like :attr:`params`) overrides the loaded weights, e.g. to
        embed with a training snapshot. ``on_batch(rows)`` is called after every batch (for
        progress bars)."""
        state = self.params if params is None else self._on_devices(params)
        if self.mesh is not None:
            rows_sharding = jax.sharding.NamedSharding(self.mesh,
                                                       jax.sharding.PartitionSpec("data"))
            everywhere = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            if params is None:  # the loaded weights are replicated once, then reused
                if self._replicated is None:
                    self._replicated = jax.device_put(state, everywhere)
                state = self._replicated
        elif self._device is not None and params is None:
            if self._replicated is None:
                self._replicated = jax.device_put(state, self._device)
            state = self._replicated
        out = np.zeros((len(ids), self.dim), np.float32)
        order = np.argsort([len(s) for s in ids], kind="stable")
        pad = self.model.config.pad_token_id
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            length = self._bucket(max(len(ids[r]) for r in rows))
            batch = np.full((self.batch_size, length), pad, np.int32)
            mask = np.zeros((self.batch_size, length), np.int32)
            for j, r in enumerate(rows):
                batch[j, :len(ids[r])] = ids[r]
                mask[j, :len(ids[r])] = 1
            mask[len(rows):, 0] = 1  # filler rows: one token, so pooling stays finite
            if self.mesh is None and self._device is None:
                batch, mask = jnp.asarray(batch), jnp.asarray(mask)
            elif self.mesh is None:
                batch, mask = jax.device_put((batch, mask), self._device)
            else:
                batch, mask = jax.device_put((batch, mask), rows_sharding)
            emb = self._encode(state, batch, mask)
            out[rows] = np.asarray(emb)[: len(rows)]  # device -> host
            if on_batch is not None:
                on_batch(len(rows))
        return out

    def on_devices(self, devices) -> "Retriever":
        """The same encoder (weights, tokenizer, compiled function) running on ``devices``:
        an index refresh given its own share of the devices
        (``LSRConfig.retrieval.refresh_devices``)."""
        other = copy.copy(self)
        other.mesh = _local_mesh(list(devices))
        n_dev = 1 if other.mesh is None else other.mesh.devices.size
        other.batch_size = -(-self.batch_size // n_dev) * n_dev
        other._replicated, other._placed = None, []
        other._placed_lock = threading.Lock()
        if other.mesh is None:
            other._device = list(devices)[0]
        return other

    def _on_devices(self, params):
        """``params`` on the encoding devices (replicated over the mesh, or the default
        device), placed once per parameter object: a refresh's thousands of batches reuse
        one copy instead of uploading the weights with each. The two most recent objects are
        kept (a background refresh and the training step's queries alternate)."""
        with self._placed_lock:
            for held, placed in self._placed:
                if held is params:
                    return placed
            target = (jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
                      if self.mesh is not None else self._device or jax.local_devices()[0])
            placed = jax.device_put(params, target)
            self._placed = [(params, placed)] + self._placed[:1]
            return placed

    def encode(self, texts: Sequence[str], params=None,
               on_batch: Callable[[int], None] | None = None) -> np.ndarray:
        return self.encode_ids(self.tokenize(texts), params, on_batch)

    def encode_queries(self, texts: Sequence[str], params=None) -> np.ndarray:
        """Query embeddings: cut to ``query_max_length`` from the ``query_truncation`` side;
        by the query tower when there is one (``params``, given, are a query tower's)."""
        if self.query_tower is not None and params is None:
            return self.query_tower.encode_queries(texts)
        return self.encode_ids(self.tokenize(texts, self.query_max_length,
                                             self.query_truncation), params)

    def encode_passages(self, texts: Sequence[str], params=None) -> np.ndarray:
        return self.encode(texts, params)

    def encode_to_file(self, texts: Sequence[str], path: str | pathlib.Path, *,
                       block_size: int = 1024, params=None, progress: bool = True,
                       on_block: Callable[[int], None] | None = None) -> np.ndarray:
        """Embed ``texts`` into the ``.npy`` memmap ``path``, resuming an interrupted run.

        The sidecar ``<path>.progress.json`` lists finished blocks; it is removed when every
        block is done. ``on_block(i)`` is called after block ``i`` is flushed (for tests and
        progress hooks). Returns the read-only memmap.
        """
        path = pathlib.Path(path)
        progress_path = path.with_name(path.name + ".progress.json")
        n = len(texts)
        if n == 0:
            raise ValueError("nothing to encode: the text list is empty")
        identity = {"n": n, "dim": self.dim, "block_size": block_size, **self.identity}
        done: set[int] = set()
        if path.exists() and progress_path.exists():
            state = json.loads(progress_path.read_text())
            if state.get("identity") == identity:
                done = set(state["done"])
            else:
                path.unlink()
        elif path.exists():
            arr = np.load(path, mmap_mode="r")
            if arr.shape == (n, self.dim):
                return arr  # complete from an earlier run
            path.unlink()
        if not path.exists():
            done = set()
            self._write_progress(progress_path, identity, done)  # before the data file
            np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, self.dim))
        out = np.load(path, mmap_mode="r+")
        blocks = range(0, (n + block_size - 1) // block_size)
        bar = encoding_bar(n, progress)
        bar.update(sum(min(block_size, n - b * block_size) for b in done))
        for b in blocks:
            if b in done:
                continue
            lo, hi = b * block_size, min(n, (b + 1) * block_size)
            out[lo:hi] = self.encode(texts[lo:hi], params, on_batch=bar.update)
            out.flush()
            done.add(b)
            self._write_progress(progress_path, identity, done)
            if on_block is not None:
                on_block(b)
        bar.close()
        del out
        progress_path.unlink()
        return np.load(path, mmap_mode="r")

    @staticmethod
    def _write_progress(path: pathlib.Path, identity: dict, done: set[int]) -> None:
        write_json_atomic({"identity": identity, "done": sorted(done)}, path)
