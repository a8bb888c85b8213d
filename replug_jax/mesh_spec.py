"""Mesh specifications as text (``"data=2,model=4"``), parsed without JAX so that a config
can be read and checked where JAX is not loaded (:mod:`replug_jax.sharding` builds the mesh)."""

from __future__ import annotations

DATA, FSDP, MODEL = "data", "fsdp", "model"
MESH_AXES = (DATA, FSDP, MODEL)


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}``; axes are ``data``, ``fsdp`` and
    ``model``, each at most once, each a positive integer."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, size = part.partition("=")
        name = name.strip()
        if not eq or name not in MESH_AXES or name in out:
            raise ValueError(f"mesh {text!r}: expected axis=size pairs such as "
                             f"'data=2,model=4' with axes from {', '.join(MESH_AXES)}, each "
                             "at most once")
        try:
            out[name] = int(size)
        except ValueError:
            raise ValueError(f"mesh {text!r}: size of {name!r} is not an integer") from None
        if out[name] < 1:
            raise ValueError(f"mesh {text!r}: size of {name!r} must be at least 1")
    if not out:
        raise ValueError(f"mesh {text!r}: no axes given (e.g. 'model=8')")
    return out


def format_mesh(shape) -> str:
    return ",".join(f"{k}={v}" for k, v in dict(shape).items())
