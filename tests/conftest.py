"""Test-wide settings: offline hub, 8 simulated CPU devices, persistent compilation cache."""

import gc
import os
import pathlib

# Must precede the first `import jax` anywhere in the test session.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# With libtpu installed (the tpu-compile extra) every JAX process takes libtpu's lockfile;
# tests that start processes, and compile-check beside them, must not wait on it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no cloud metadata server to ask here
# Always 8 (a count set outside is replaced): the mesh tests assume it and never skip.
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if not f.startswith("--xla_force_host_platform_device_count")]
    + ["--xla_force_host_platform_device_count=8"])

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# The property tests draw the same cases on every run (CI's included), so a failure is
# reproducible and a green run stays green; HYPOTHESIS_PROFILE=explore draws new ones.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

from replug_jax.process import map_count_and_limit  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
_CACHE = os.environ.get("REPLUG_JAX_CACHE_DIR", str(ROOT / ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """``../shared/data``; tests needing it skip with a reason when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"evaluation data folder {SHARED_DATA} is absent (only the project's "
                    "development machines have ../shared/data)")
    return SHARED_DATA


def _rss_mib() -> float:
    """The process's resident memory (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _drop_compiled_programs() -> None:
    jax.clear_caches()
    gc.collect()


# Each compiled CPU program maps its code in several regions: a long module (test_experiments
# compiles thousands of programs) nears the kernel's default limit of 65,530 maps, past which
# XLA aborts (replug_jax.process). Compiled programs are dropped after any test that leaves
# more than this many.
MAX_MAPS = 16_384


@pytest.fixture(autouse=True)
def _bound_memory_maps():
    yield
    seen = map_count_and_limit()
    if seen is not None and seen[0] > MAX_MAPS:
        _drop_compiled_programs()


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs(request):
    """Each test module's compiled programs and the models its fixtures held are freed when it
    ends. One pytest process runs every module; without this it kept every compiled program
    (about 1.5 MiB each on the CPU, hypothesis tests compile hundreds of shapes), grew to
    12.8 GiB by the sharded-LM tests and aborted inside XLA there (CI: a segmentation fault at
    the same test). Freed programs' memory is reused by the next module's; the persistent
    compilation cache makes a later recompilation a disk read.
    ``REPLUG_TEST_RSS_LOG=<file>`` appends each module's resident memory before and after."""
    log = os.environ.get("REPLUG_TEST_RSS_LOG")
    before = _rss_mib() if log else 0.0
    yield
    _drop_compiled_programs()
    if log:
        with open(log, "a") as out:
            out.write(f"{request.module.__name__}\t{before:.0f}\t{_rss_mib():.0f}\n")


@pytest.fixture(scope="module")
def served():
    """The packaged SmolLM2 behind our FastAPI server, in a thread on 127.0.0.1."""
    import threading
    import time

    import uvicorn

    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.serve.app import create_app
    from tests._models import packaged_or_skip
    from tests.helpers import free_port

    packaged_or_skip("smollm2")
    lm = FlaxLM.load("smollm2", max_context=512)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(lm, "smollm2"), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    yield lm, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
