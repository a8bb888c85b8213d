"""A synthetic datastore of any size: a passage store and clustered embeddings, streamed.

Embeddings imitate what dense retrievers produce: unit vectors concentrated around many topics,
with an intrinsic dimension far below the ambient one (a 64-dimensional latent space mapped
into D dimensions by a random orthonormal map, plus a little isotropic noise). Uniform random
vectors would make every approximate index look terrible and real ones do not behave like that
(see ENVIRONMENT.md). Queries are drawn from the same distribution.

Usage::

    python -m benches.synthetic --n 4000000 --out /data/synth4m   # passages.arrow + emb.npy
    replug index build --corpus /data/synth4m/passages.arrow \\
        --embeddings /data/synth4m/emb.npy --factory IVF4096,PQ48 --out /data/synth4m/idx
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

LATENT = 64


class Generator:
    """Seeded clustered embeddings: ``vectors(lo, hi)`` is deterministic for any row range."""

    def __init__(self, dim: int = 384, topics: int = 20000, seed: int = 0,
                 kind: str = "latent"):
        """``kind="latent"``: topics in a 64-d latent space (the default above); ``"tight"``:
        ``topics`` tight clusters in all D dimensions whose members are nearly equidistant
        from each other (isotropic spread 0.05 / √D per axis), the data that is hard for PQ."""
        if kind not in ("latent", "tight"):
            raise ValueError(f"kind must be latent or tight, got {kind!r}")
        rng = np.random.default_rng(seed)
        self.dim, self.seed, self.kind = dim, seed, kind
        self.centers = rng.normal(size=(topics, LATENT if kind == "latent" else dim)
                                  ).astype(np.float32)
        self.basis = np.linalg.qr(rng.normal(size=(dim, LATENT)))[0].T.astype(np.float32)

    def _draw(self, rng, n: int) -> np.ndarray:
        topic = rng.integers(len(self.centers), size=n)
        if self.kind == "tight":
            c = self.centers[topic] / np.linalg.norm(self.centers[topic], axis=1, keepdims=True)
            x = c + 0.05 * rng.normal(size=(n, self.dim)).astype(np.float32)
            return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
        z = self.centers[topic] + 0.35 * rng.normal(size=(n, LATENT)).astype(np.float32)
        x = z @ self.basis + 0.02 * rng.normal(size=(n, self.dim)).astype(np.float32)
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    def vectors(self, lo: int, hi: int, block: int = 65536) -> np.ndarray:
        """Rows ``lo..hi-1``, generated per fixed block so any range is reproducible."""
        out = []
        for b in range(lo // block, -(-hi // block)):
            rows = self._draw(np.random.default_rng((self.seed, b)), block)
            a, c = max(lo, b * block), min(hi, (b + 1) * block)
            out.append(rows[a - b * block:c - b * block])
        return np.concatenate(out)

    def queries(self, n: int) -> np.ndarray:
        return self._draw(np.random.default_rng((self.seed, 1 << 40)), n)


def passages(n: int):
    from replug_jax.retrieval.corpus import Passage

    words = ("retrieval", "augmented", "language", "model", "passage", "datastore", "dense",
             "index", "shard", "query", "token", "ensemble")
    for i in range(n):
        body = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12))
        yield Passage(i, f"Synthetic passage {i}: {body}.", f"Doc {i // 8}", str(i // 8),
                      0, 0)


def write_datastore(out: pathlib.Path, n: int, dim: int = 384, seed: int = 0,
                    progress: bool = True) -> dict:
    """``out/passages.arrow`` (+ ``.json``) and ``out/emb.npy`` ``[n, dim]`` float32."""
    from tqdm.auto import tqdm

    from replug_jax.fileio import atomic_path
    from replug_jax.retrieval.store import write_store

    out.mkdir(parents=True, exist_ok=True)
    meta = write_store(passages(n), out / "passages.arrow", progress=progress)
    gen = Generator(dim, seed=seed)
    with atomic_path(out / "emb.npy", suffix=".npy") as tmp:
        emb = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n, dim))
        step = 1 << 18
        for lo in tqdm(range(0, n, step), desc="embeddings", disable=not progress):
            emb[lo:min(n, lo + step)] = gen.vectors(lo, min(n, lo + step))
            emb.flush()
        del emb
    return meta


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, required=True, help="number of passages")
    ap.add_argument("--dim", type=int, default=384, help="embedding dimension (default 384)")
    ap.add_argument("--seed", type=int, default=0, help="generator seed")
    ap.add_argument("--out", type=pathlib.Path, required=True, help="output folder")
    args = ap.parse_args(argv)
    meta = write_datastore(args.out, args.n, args.dim, args.seed)
    print(f"{meta['n']} passages and {args.n} x {args.dim} embeddings -> {args.out}")


if __name__ == "__main__":
    main()
