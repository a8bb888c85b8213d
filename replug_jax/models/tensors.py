"""Checkpoint tensors read lazily and mapped onto parameters block by block.

A :class:`LazyTensor` is one tensor of a safetensors file, read whole or one block at a time
(``safe_open(...).get_slice``); a :class:`Transform` maps a checkpoint tensor onto a parameter
(``unchanged``, ``transposed`` for PyTorch ``Linear`` kernels, ``column_block`` for GPT-2's
fused ``c_attn``) and says which block of the source holds a block of the parameter, so a
sharded load reads only what its devices hold (:mod:`replug_jax.models.weights`).
"""

from __future__ import annotations

import abc
import pathlib

import numpy as np

from replug_jax.models.registry import WeightsError


class LazyTensor:
    """One tensor of a safetensors file, read on demand: whole (``t()``) or a block
    (``t[slices]``, through ``safe_open(...).get_slice``: only that block is read)."""

    def __init__(self, path: pathlib.Path, name: str, shape: tuple[int, ...]):
        self.path, self.name, self.shape = path, name, shape

    def __getitem__(self, index) -> np.ndarray:
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="numpy") as f:
                return np.asarray(f.get_slice(self.name)[index])
        except Exception as err:
            raise WeightsError(f"{self.path}: cannot read tensor {self.name!r}, the file is "
                               f"truncated or corrupt ({err})") from err

    def __call__(self) -> np.ndarray:
        return self[tuple(slice(None) for _ in self.shape)]


def lazy_safetensors(path: pathlib.Path) -> dict[str, LazyTensor]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return {name: LazyTensor(path, name, tuple(f.get_slice(name).get_shape()))
                    for name in f.keys()}
    except Exception as err:  # SafetensorError, OSError, ...
        raise WeightsError(f"{path}: cannot read safetensors file, it is truncated or "
                           f"corrupt ({err})") from err


class Transform(abc.ABC):
    """A checkpoint tensor -> parameter map that also says which block of the source a block
    of the parameter comes from, so a sharded load reads only that block."""

    @abc.abstractmethod
    def __call__(self, w: np.ndarray) -> np.ndarray:
        """The whole parameter from the whole source tensor."""

    @abc.abstractmethod
    def shape(self, source_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The parameter's shape from the source's."""

    @abc.abstractmethod
    def source_index(self, index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
        """The source block holding the parameter's block ``index`` (of a parameter of
        ``shape``)."""

    def block(self, source_block: np.ndarray) -> np.ndarray:
        """The parameter's block from the source block :meth:`source_index` names."""
        return self(source_block)


class _Unchanged(Transform):
    def __call__(self, w):
        return w

    def shape(self, source_shape):
        return tuple(source_shape)

    def source_index(self, index, shape):
        return index


class _Transposed(Transform):
    """PyTorch ``Linear`` ``[out, in]`` <-> our ``[in, out]`` kernels (its own inverse)."""

    def __call__(self, w):
        return np.ascontiguousarray(w.T)

    def shape(self, source_shape):
        return tuple(reversed(source_shape))

    def source_index(self, index, shape):
        return tuple(reversed(index))


class column_block(Transform):
    """Columns ``[part·width, (part+1)·width)`` of the last axis (GPT-2's fused ``c_attn``
    split into q, k, v)."""

    def __init__(self, part: int, width: int):
        self.part, self.width = part, width

    def __call__(self, w):
        return np.ascontiguousarray(w[..., self.part * self.width:(self.part + 1) * self.width])

    def shape(self, source_shape):
        return (*source_shape[:-1], self.width)

    def source_index(self, index, shape):
        last = index[-1]
        start, stop, _ = last.indices(shape[-1])
        offset = self.part * self.width
        return (*index[:-1], slice(offset + start, offset + stop))

    def block(self, source_block):
        return source_block  # source_index already took the columns


unchanged = _Unchanged()
transposed = _Transposed()
