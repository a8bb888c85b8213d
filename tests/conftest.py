"""Test-wide settings: offline hub, 8 simulated CPU devices, persistent compilation cache."""

import os
import pathlib

# Must precede the first `import jax` anywhere in the test session.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

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
