"""The running process: the wall time of a block (:class:`Timer`), and long runs kept under
Linux's limit on a process's memory mappings, their memory kept from drifting up.

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

Between those clearings a run's resident memory still grew (9 → 13 GiB in 20 minutes of
pool scoring): glibc's malloc keeps the pages of freed XLA buffers in its arenas. Calling
``malloc_trim(0)`` on the running process returned 3.6 of its 10.5 GiB at once, so
:func:`relieve` also returns freed heap pages to the system, at most every ``trim_every_s``
seconds (a call takes ~30 ms). Without glibc (musl, macOS) that part does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import pathlib
import time

log = logging.getLogger(__name__)

_MAPS = pathlib.Path("/proc/self/maps")
_LIMIT = pathlib.Path("/proc/sys/vm/max_map_count")
DEFAULT_LIMIT = 65_530  # Linux's default vm.max_map_count
_last_trim = float("-inf")  # time.monotonic() of the last malloc_trim


def map_count_and_limit() -> tuple[int, int] | None:
    """(mappings this process holds, the kernel's limit), or None where unknown."""
    try:
        limit = int(_LIMIT.read_text())
        with open(_MAPS, "rb") as f:
            return sum(1 for _ in f), limit
    except (OSError, ValueError):
        return None


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (looked up once:
    ``find_library`` runs helper programs)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def trim_heap(every_s: float = 30.0) -> bool:
    """Return the heap pages malloc holds free to the system (``malloc_trim(0)``), unless it
    last did so under ``every_s`` seconds ago; True when it did."""
    global _last_trim
    now = time.monotonic()
    if now - _last_trim < every_s or (trim := _malloc_trim()) is None:
        return False
    _last_trim = now
    trim(0)
    return True


def relieve(threshold: float = 0.6, trim_every_s: float = 30.0) -> bool:
    """Clear JAX's compilation caches if this process holds more than ``threshold`` of the
    mappings the kernel allows (or of the default limit, if that is lower), True when it did;
    and return freed heap pages to the system (:func:`trim_heap`)."""
    trim_heap(trim_every_s)
    seen = map_count_and_limit()
    if seen is None or seen[0] <= threshold * min(seen[1], DEFAULT_LIMIT):
        return False
    import jax

    log.warning("%d of %d memory mappings in use (vm.max_map_count): clearing JAX's compiled "
                "programs; the persistent compilation cache reloads those needed again",
                *seen)
    jax.clear_caches()
    return True


class Timer:
    """``with Timer() as t: ...`` then ``t.seconds``: wall time of a block (``perf_counter``)."""

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
