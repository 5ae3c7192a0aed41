"""Device profiles: what the cost model knows of an accelerator, as data.

Ceilings are what a device reaches on the simplest programs, measured as ``bench`` measures them
(a square matmul, an element-wise copy), not datasheet peaks; the efficiencies say what share of
a ceiling each part of a step reaches, and the fixed costs what a step and each of its layers
cost beyond their roofline (kernel launches, small ops). Every number below names its source.
The H200's ceilings and attention efficiencies come from single kernels and single steps; its
other numbers are fitted to the step trace of a real run (benchmarks/simulate_trace.py), whose
whole run, replayed on the simulator, checks them; the other end-to-end H200 runs in
benchmarks/RESULTS.md are kept out of the fit, for validation
(``benchmarks/simulate_validate.py --h200``). ``cpu`` measures its
ceilings when the profile is made, on this machine, and its efficiencies were fitted to real
CPU steps by ``benchmarks/simulate_validate.py --calibrate``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """One simulated device (each device of a tensor-parallel group is one of these).

    ``platform``: which defaults the engine resolves as on that device (``"gpu"``: bfloat16,
    the Pallas attention backend, 8192-token chunks; ``"cpu"``: float32, xla, 512).
    """

    name: str
    platform: str
    memory_bytes: float  # device memory: the KV pool is sized from it, less the weights
    jax_memory_fraction: float  # of it, what JAX lets the engine allocate (its preallocation)
    matmul_flops: float  # FLOP/s ceiling of a large bfloat16 / float16 matmul
    matmul_flops_f32: float  # the same in float32
    memory_bw: float  # bytes/s ceiling of a large copy (read + written)
    interconnect_bw: float  # bytes/s one device sends to its ring neighbour (all-reduce)
    matmul_eff: float  # a step's weight matmuls, share of matmul_flops when compute-bound
    memory_eff: float  # reading the weights (and logits), share of memory_bw when memory-bound
    attention_flops_eff: float  # paged attention, share of matmul_flops when compute-bound
    attention_bw_eff: float  # paged attention reading K and V, share of memory_bw
    launch_s: float  # fixed cost of every step beyond its roofline (kernel launches)
    allreduce_latency_s: float  # fixed cost of one all-reduce
    dispatch_s: float = 0.0  # host (not device) time of dispatching a step's programs
    attention_seq_s: float = 0.0  # attention's cost per real sequence and layer beyond its bytes
    layer_s: float = 0.0  # fixed cost of every layer of a step (its kernels' launches, small ops)
    source: str = ""
    device_kind: str = ""  # as JAX names the real device (the kernels' tuning tables' key)

    def usable_memory(self, tp: int) -> float:
        """The memory one device of ``tp`` lets the engine allocate: what JAX's allocator
        reports as its limit on a GPU; on a CPU the host's, shared by its devices."""
        usable = self.memory_bytes * self.jax_memory_fraction
        return usable / tp if self.platform == "cpu" else usable

    def flops(self, dtype) -> float:
        """The matmul ceiling in ``dtype``."""
        return self.matmul_flops_f32 if jnp.dtype(dtype) == jnp.float32 else self.matmul_flops


# RESULTS.md, "GPU: first runs on an H200": 8192³ bf16 matmul 649 and 660 TFLOP/s in the two
# runs, float32 373 and 359; device-to-device copy 3.69 and 3.57 TB/s. Their means:
_H200_MATMUL, _H200_MATMUL_F32, _H200_COPY = 654.5e12, 366e12, 3.63e12
# The GPU session of 2026-12-04 (shared/gpu/h200-2026-12-04, commit fb80bae). Measured alone:
# the ragged kernel on the mixed batch (4 prefill chunks of 1024 after 1024 cached + 64 decodes,
# qwen3-0.6b's attention) 99.7 TFLOP/s = 0.152 of the matmul ceiling (kernels.json); the decode
# kernel inside the engine's decode steps (steps.log's op profiles: qwen3-0.6b and llama-3-8b,
# 64 and 128 sequences at context 2048) read K and V at 2.52-2.61 TB/s, 0.695-0.718 of the copy
# ceiling, mean 0.707.
_H200_ATTN_FLOPS, _H200_ATTN_BW = 0.152, 0.707
# Fitted (benchmarks/simulate_trace.py --fit) to the device times of the 2,591 steps of the
# peer_llama run that its trace gives (benchmarks/data/h200_peer_llama.jsonl.gz: llama-3-8b,
# 2,000 ShareGPT prompts) and to step_roofline.py's six steps of both models (steps.log), each
# group of steps weighing the same: the weight matmuls' FLOP efficiency, the cost per sequence
# and layer of attention beyond its bytes, a layer's fixed cost, and the weight-streaming
# efficiency of steps in a run; the same steps replayed back to back stream their weights at
# H200_REPLAYED_MEMORY_EFF (fitted with the rest; not the simulator's: it simulates runs). The
# per-step launch cost cannot be told from the per-layer cost on one model's steps: it is 0.
_H200_FIT = dict(matmul_eff=0.9427, memory_eff=0.623, attention_seq_s=3.883e-07,
                 layer_s=2.268e-05, launch_s=0.0)
H200_REPLAYED_MEMORY_EFF = 1.038
# The same run's host time per tick, 1.51 ms with overlap, is the scheduler's work and the
# dispatch of the step's programs; the simulated engine's host time per tick on that workload
# here (the scheduler alone) is 0.18 ms (printed by --calibrate-h200): the rest, 1.33 ms, is the
# dispatch. A different host CPU ran it, so this is an estimate.
_H200_DISPATCH = 1.33e-3

H200 = DeviceProfile(
    name="h200", platform="gpu",
    memory_bytes=141e9,  # NVIDIA H200 SXM datasheet: 141 GB HBM3e
    jax_memory_fraction=0.75,  # JAX preallocates 75 % of a GPU (XLA_PYTHON_CLIENT_MEM_FRACTION)
    matmul_flops=_H200_MATMUL, matmul_flops_f32=_H200_MATMUL_F32, memory_bw=_H200_COPY,
    interconnect_bw=450e9,  # datasheet: NVLink 900 GB/s per GPU, both directions together
    attention_flops_eff=_H200_ATTN_FLOPS, attention_bw_eff=_H200_ATTN_BW, **_H200_FIT,
    allreduce_latency_s=10e-6,  # assumed: a small NCCL all-reduce over NVLink
    dispatch_s=_H200_DISPATCH, device_kind="NVIDIA H200",
    source="ceilings measured on an H200 (RESULTS.md, 2026-11-29); attention kernels measured "
           "and the rest fitted to the step trace of a real run (2026-12-04); dispatch cost from "
           "the device_idle run",
)

# H100 SXM datasheet: 80 GB HBM3, 3.35 TB/s, the same 989 TFLOP/s dense bf16 and NVLink as the
# H200. No H100 was measured: its ceilings are the datasheet's scaled by the H200's measured /
# datasheet ratios (654.5 / 989 for matmuls, 3.63 / 4.8 for copies), every efficiency and fixed
# cost is the H200's.
H100 = dataclasses.replace(
    H200, name="h100", memory_bytes=80e9, memory_bw=3.35e12 * _H200_COPY / 4.8e12,
    device_kind="NVIDIA H100 80GB HBM3",
    source="H100 datasheet scaled by the H200's measured / datasheet ratios; the H200's "
           "efficiencies and fixed costs")

# Fitted by `python benchmarks/simulate_validate.py --calibrate` on the project's 2-core
# machine: 279 real SmolLM2 steps (float32) of a run, each timed from its dispatch to its
# tokens, against the 438 GFLOP/s and 7.5 GB/s ceilings measured in the same process; per-step
# error median 11 %, p90 20 % (benchmarks/RESULTS.md, "Simulated accelerator"). SmolLM2's CPU
# steps are compute-bound: the memory efficiency sits at its bound (2, a read-only stream
# against a copy's read + written bytes), barely constrained. The dispatch (1.1 ms measured)
# overlaps the step on a CPU and is inside the timed steps, so the profile has none of its own.
_CPU_FIT = dict(matmul_eff=0.6764, memory_eff=2.0, attention_flops_eff=0.2972,
                attention_bw_eff=0.7257, launch_s=1.832e-3)


def measured_profile(dtype) -> DeviceProfile:
    """The default device's ceilings measured now, as ``bench`` measures them, with every
    efficiency 1 and no launch or dispatch cost: the starting point of a calibration."""
    import jax

    from minijax_serve.executor import ceilings

    flops = ceilings.matmul_peak_flops(dtype, ceilings.default_matmul_size())
    copy = ceilings.copy_bandwidth(ceilings.default_copy_mib())
    return DeviceProfile(
        name="measured", platform=jax.default_backend(), memory_bytes=0.0,
        jax_memory_fraction=1.0, matmul_flops=flops,
        matmul_flops_f32=flops, memory_bw=copy, interconnect_bw=copy, matmul_eff=1.0,
        memory_eff=1.0, attention_flops_eff=1.0, attention_bw_eff=1.0, launch_s=0.0,
        allreduce_latency_s=0.0, device_kind=jax.devices()[0].device_kind)


@functools.cache
def cpu_profile() -> DeviceProfile:
    """This machine's CPU: the float32 matmul and copy ceilings measured now (once per process),
    with the efficiencies fitted on the project's machine."""
    import os

    measured = measured_profile(jnp.float32)
    return dataclasses.replace(
        measured, name="cpu", platform="cpu",
        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"),
        interconnect_bw=measured.memory_bw / 2,  # CPU devices share the host's memory
        **_CPU_FIT,
        source="float32 matmul and copy ceilings measured at start; efficiencies fitted to real "
               "SmolLM2 steps on the project's machine")


def device_profile(name: str) -> DeviceProfile:
    """The profile named ``name``: ``"h200"``, ``"h100"`` or ``"cpu"`` (measured now)."""
    if name == "cpu":
        return cpu_profile()
    profiles = {"h200": H200, "h100": H100}
    if name not in profiles:
        raise ValueError(f"simulate must be one of h200, h100, cpu, got {name!r}")
    return profiles[name]
