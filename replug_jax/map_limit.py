"""Keep long runs under Linux's limit on a process's memory mappings.

XLA's CPU backend maps every compiled kernel into memory regions of its own (a few per
fusion; one transformer scoring program holds hundreds), and ``jax.jit`` keeps every
executable it has compiled. A run that scores many shapes (length buckets × batch sizes ×
KV-reuse widths: an LSR pool of ten thousand pairs) can reach ``vm.max_map_count`` (65,530
by default), where LLVM fails with "Cannot allocate memory" and the process dies mid-run.
:func:`relieve` drops JAX's in-memory caches when the process nears that limit; the
persistent compilation cache (:func:`replug_jax.cli.common.setup_jax`) makes the programs
needed again cheap to load. The programs also hold memory (over a MiB each on a CPU: a pool
run held 13 GiB at 94,000 mappings), so a limit raised above the default does not raise the
point where they are dropped. Elsewhere (no ``/proc``) it does nothing.
"""

from __future__ import annotations

import logging
import pathlib

log = logging.getLogger(__name__)

_MAPS = pathlib.Path("/proc/self/maps")
_LIMIT = pathlib.Path("/proc/sys/vm/max_map_count")
DEFAULT_LIMIT = 65_530  # Linux's default vm.max_map_count


def map_count_and_limit() -> tuple[int, int] | None:
    """(mappings this process holds, the kernel's limit), or None where unknown."""
    try:
        limit = int(_LIMIT.read_text())
        with open(_MAPS, "rb") as f:
            return sum(1 for _ in f), limit
    except (OSError, ValueError):
        return None


def relieve(threshold: float = 0.6) -> bool:
    """Clear JAX's compilation caches if this process holds more than ``threshold`` of the
    mappings the kernel allows (or of the default limit, if that is lower); True when it
    did."""
    seen = map_count_and_limit()
    if seen is None or seen[0] <= threshold * min(seen[1], DEFAULT_LIMIT):
        return False
    import jax

    log.warning("%d of %d memory mappings in use (vm.max_map_count): clearing JAX's compiled "
                "programs; the persistent compilation cache reloads those needed again",
                *seen)
    jax.clear_caches()
    return True
