"""Long runs stay under vm.max_map_count: JAX's compiled programs are dropped near the limit,
and scoring goes on with the same numbers."""

import sys

import jax
import numpy as np
import pytest

from tests._models import tiny_lm
from replug_jax import process

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@linux
def test_counts_this_process_maps_against_the_kernel_limit():
    count, limit = process.map_count_and_limit()
    assert 0 < count < limit
    assert not process.relieve(threshold=1.0)  # nowhere near


def _fake_limit(tmp_path, monkeypatch, limit: int):
    path = tmp_path / "max_map_count"
    path.write_text(f"{limit}\n")
    monkeypatch.setattr(process, "_LIMIT", path)


@linux
def test_near_the_limit_compiled_programs_are_dropped(tmp_path, monkeypatch):
    f = jax.jit(lambda x: x * 2 + 1)
    f(np.float32(1.0))
    assert f._cache_size() == 1
    _fake_limit(tmp_path, monkeypatch, 10**9)  # a raised limit: the default one still counts
    assert not process.relieve() and f._cache_size() == 1
    monkeypatch.setattr(process, "DEFAULT_LIMIT", 10)
    assert process.relieve() and f._cache_size() == 0
    f(np.float32(1.0))
    monkeypatch.undo()
    count, _ = process.map_count_and_limit()
    _fake_limit(tmp_path, monkeypatch, count)  # every mapping the "kernel" allows is in use
    assert process.relieve()
    assert f._cache_size() == 0
    assert float(f(np.float32(2.0))) == 5.0  # compiled again when next needed


def test_without_proc_nothing_happens(tmp_path, monkeypatch):
    monkeypatch.setattr(process, "_LIMIT", tmp_path / "absent")
    assert process.map_count_and_limit() is None
    assert not process.relieve()


@linux
def test_scoring_under_map_pressure_gives_the_same_log_probs(tmp_path, monkeypatch):
    lm = tiny_lm(0)
    rng = np.random.default_rng(0)
    doc = [1] + list(rng.integers(3, 49000, size=40))
    prefixes = [doc + list(rng.integers(3, 49000, size=n)) for n in (3, 9, 17)]
    conts = [list(rng.integers(3, 49000, size=n)) for n in (4, 2, 7)]
    want = lm.score_token_ids(prefixes, conts)
    count, _ = process.map_count_and_limit()
    _fake_limit(tmp_path, monkeypatch, count // 2)  # every call now clears the caches
    clear, cleared = jax.clear_caches, []
    monkeypatch.setattr(jax, "clear_caches", lambda: (cleared.append(1), clear())[1])
    got = lm.score_token_ids(prefixes, conts)
    assert cleared  # and the programs were compiled anew
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=1e-6, rtol=0)


def _rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(process._malloc_trim() is None, reason="glibc's malloc_trim")
def test_freed_heap_pages_go_back_to_the_system(monkeypatch):
    monkeypatch.setattr(process, "_last_trim", float("-inf"))
    chunks = [bytearray(50_000) for _ in range(4000)]  # 200 MB of heap below the mmap size
    for c in chunks:
        c[::4096] = b"x" * len(c[::4096])  # touched: resident
    keep = chunks[-1]  # holds the heap's top: free() alone cannot give the rest back
    del chunks
    before = _rss_mib()
    assert process.trim_heap(every_s=30.0)
    assert before - _rss_mib() > 100
    assert not process.trim_heap(every_s=30.0)  # again within 30 s: nothing
    assert process.trim_heap(every_s=0.0)
    del keep


def test_a_timer_measures_the_wall_time_of_its_block():
    import time

    with process.Timer() as t:
        time.sleep(0.05)
    assert 0.05 <= t.seconds < 5.0
