"""What ``replug compile-check`` compiles for, readable without JAX (the command line reads
the defaults before anything heavy loads): the sizes of a paper-scale run (:class:`Shapes`),
and NVIDIA GPUs to compile for without one (``--target h100x8``).

XLA compiles for a GPU it cannot see through the CUDA PJRT plugin (``pip install
'replug-jax[gpu]'``: ``jax[cuda12]``) and a *target description*, the device properties its
compiler reads (compute capability, SMs, shared memory, L2, clock, memory). The descriptions
here are written from each device's published properties (NVIDIA's datasheets and the CUDA
programming guide's compute-capability tables; memory as ``nvidia-smi`` reports it) and
handed to ``jax.experimental.topologies.get_topology_desc(platform="cuda", ...)``, so a CPU
machine compiles for 8 × H100 as MaxText's ``train_compile.py`` does for TPU topologies.

Two XLA options are set on every such compile (:data:`COMPILE_OPTIONS`), because without a
device they fail for reasons that are not the program's: CUB's radix sort (sort and top-k)
asks the CUDA runtime for a device, and a Triton GEMM autotuned without one can exceed shared
memory at compile time, which would read as "does not fit". With them off, sort and matmuls
compile through XLA's own emitters and cuBLAS: the memory is the program's, the kernels may
differ from those autotuned on the device.
"""

from __future__ import annotations

import dataclasses
import re

COMPILE_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False,
                   "xla_gpu_enable_triton_gemm": False}


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One device's published properties (per SM where it says so)."""

    name: str  # as the driver reports it (jax's device_kind)
    compute_capability: tuple[int, int]
    sms: int
    fp32_cores_per_sm: int
    shared_memory_per_sm: int  # bytes
    shared_memory_per_block_optin: int  # bytes
    l2_bytes: int
    boost_ghz: float
    memory_bytes: int  # nvidia-smi's total
    bandwidth_bytes_per_s: float
    bf16_tflops: float  # dense tensor-core peak

    def target_config(self) -> str:
        """The GpuTargetConfigProto (text format) XLA compiles against."""
        major, minor = self.compute_capability
        return "\n".join([
            "gpu_device_info {",
            "  threads_per_block_limit: 1024", "  threads_per_warp: 32",
            "  shared_memory_per_block: 49152",
            f"  shared_memory_per_core: {self.shared_memory_per_sm}",
            "  threads_per_core_limit: 2048", f"  core_count: {self.sms}",
            f"  fpus_per_core: {self.fp32_cores_per_sm}",
            "  block_dim_limit_x: 2147483647", "  block_dim_limit_y: 65535",
            "  block_dim_limit_z: 65535",
            f"  memory_bandwidth: {int(self.bandwidth_bytes_per_s)}",
            f"  l2_cache_size: {self.l2_bytes}", f"  clock_rate_ghz: {self.boost_ghz}",
            f"  device_memory_size: {self.memory_bytes}",
            f"  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}",
            f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
            "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536",
            "}",
            'platform_name: "CUDA"',
            "dnn_version_info { major: 9 minor: 8 }",
            f'device_description_str: "{self.name}"', ""])


GPUS = {
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 233_472, 232_448, 52_428_800,
                    1.98, 81_559 << 20, 3.35e12, 989.4),
    "h200": GpuSpec("NVIDIA H200", (9, 0), 132, 128, 233_472, 232_448, 52_428_800, 1.98,
                    143_771 << 20, 4.8e12, 989.4),
    "a100": GpuSpec("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 167_936, 166_912, 41_943_040,
                    1.41, 81_920 << 20, 2.039e12, 312.0),
}


def parse_target(target: str) -> tuple[GpuSpec, int]:
    """``"h100x8"`` -> (the H100's spec, 8 devices); one line naming the choices if not."""
    m = re.fullmatch(r"([a-z]\d+)x(\d+)", target.strip().lower())
    if not m or m[1] not in GPUS or int(m[2]) < 1:
        raise ValueError(f"--target {target!r}: name a GPU and a device count, one of "
                         f"{', '.join(f'{g}xN' for g in GPUS)} (e.g. h100x8)")
    return GPUS[m[1]], int(m[2])


def gpu_devices(target: str) -> list:
    """The devices of ``target`` (one host of N GPUs), described to XLA through the CUDA
    plugin on a machine that has none."""
    spec, count = parse_target(target)
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(
            platform="cuda", topology_name="", topology=f"1x1x{count}",
            target_config=spec.target_config()).devices)
    except Exception as err:  # noqa: BLE001 — the plugin missing, or a description refused
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"cannot describe {count} x {spec.name} ({text}): install the CUDA "
                         "plugin with `pip install 'replug-jax[gpu]'` (jax[cuda12], no GPU "
                         "needed), and run with JAX_PLATFORMS=cpu where there is no GPU "
                         "(`replug compile-check --target` sets it)") from None


def chips() -> dict[str, tuple[float, float, float]]:
    """device_kind -> (GiB, bf16 TFLOP/s, GB/s), as compile-check's chip table holds them."""
    return {g.name: (g.memory_bytes / (1 << 30), g.bf16_tflops, g.bandwidth_bytes_per_s / 1e9)
            for g in GPUS.values()}


# what each size is, for --help
HELP = {
    "lm_batch": "LM sequences per program: queries x k documents",
    "context": "tokens per LM sequence (prefill: context - new-tokens of prompt)",
    "new_tokens": "tokens decoded after the prefill",
    "prefix_len": "KV reuse: tokens of a document prefix",
    "suffix_len": "KV reuse: tokens after the prefix (query and continuation)",
    "lsr_batch": "LSR: queries per step",
    "lsr_docs": "LSR: documents per query (the paper's k = 20)",
    "query_len": "LSR: query tokens",
    "doc_len": "LSR and refresh: passage tokens",
    "corpus": "passages in the datastore, split along N over the devices",
    "topk_queries": "queries per exact top-k search",
    "k": "documents the top-k returns",
    "encode_batch": "passages per refresh encode step (rounded up to the devices)",
}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The sizes of a run: the LM's batch of sequences, its context, the tokens decoded, the
    KV-reuse prefix (document) and suffix (query and continuation) lengths; the LSR batch,
    documents per query and lengths; the corpus rows and the exact top-k's queries and k."""

    lm_batch: int = 32
    context: int = 2048
    new_tokens: int = 128
    prefix_len: int = 128
    suffix_len: int = 256
    lsr_batch: int = 64
    lsr_docs: int = 20
    query_len: int = 128
    doc_len: int = 128
    corpus: int = 21_000_000
    topk_queries: int = 64
    k: int = 20
    encode_batch: int = 512
