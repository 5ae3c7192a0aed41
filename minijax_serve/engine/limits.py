"""The limits an engine takes from its device when the configuration leaves them open: the KV
pool, the requests running at once, the prefill budget and chunk, and the step's composition.

On an accelerator (SGLang's rules, ``python/sglang/srt``: ``server_args.py`` and
``model_executor/model_runner.py``):

* the pool is ``mem_fraction_static`` of the device's free memory once the weights are placed,
  whatever ``max_running_requests`` and the context are;
* ``max_running_requests`` follows from the pool: ``pool / context × 512`` clamped to
  [2048, 4096], and at most half the pool's tokens (SGLang's request pool and its
  ``max_total_num_tokens // 2``); admission, not this cap, then bounds the batch. With
  speculative decoding, divided by k + 1: a verify step computes the logits of every token it
  carries (k + 1 a request), so its largest bucket keeps a decode step's rows (4,096 × 5 rows
  of a 128k vocabulary in float32 would be 10.5 GB of logits, and verify_rows' p and q as much
  again, beside a pool sized to leave 15 %);
* the chunk by the device's memory, as SGLang's tiers: 2,048 tokens under 35 GiB, 4,096 under
  60, 8,192 under 160 (H100, H200), 16,384 above (B200, MI300); ``max_prefill_tokens`` 16,384;
* every step is one ragged batch: the running requests' decode tokens and as many prompt tokens
  as the chunk leaves (:attr:`Limits.mixed`).

Each running request's slot also has a row of token counts and one of logit bias (the
penalties' and ``logit_bias``'s, allocated with the first request that needs them: 8 bytes a
vocabulary entry, on every device). Their bytes come out of the free memory before the pool is
sized (``row_bytes``): Llama-3-8B's 4,097 rows on an H200 are 4.2 GB, which the step's
activations and sampler would otherwise find taken when the first penalised request arrives.

On a CPU the host's memory is the user's whole machine: the pool takes at most 4 GiB (vLLM's CPU
build's default KV space) or what ``max_running_requests`` × the context needs, whichever is
smaller (and never more than ``mem_fraction_static`` of the free memory). XLA's CPU compiler has
no bfloat16 scatter or dot: a 16-bit pool is converted to float32 and back in every step, so its
step needs twice the pool's bytes beside it (benchmarks/RESULTS.md, issue 46 part 5); the budget
counts them. Processes on one host (tensor parallelism over processes) each take their budget.
"""

from __future__ import annotations

from typing import NamedTuple

from minijax_serve.config import EngineConfig

GIB = 1 << 30
CPU_KV_BUDGET_BYTES = 4 * GIB
CPU_MAX_RUNNING = 64
CPU_CHUNK = 512
CPU_MAX_PREFILL = 4096
CPU_MIXED = False  # measured: benchmarks/RESULTS.md, "The unified step on the CPU"
ACCELERATOR_MAX_PREFILL = 16384  # SGLang's max_prefill_tokens
# SGLang's chunk by the device's memory: (below this many GiB, tokens); else the last
ACCELERATOR_CHUNKS = ((35, 2048), (60, 4096), (160, 8192), (None, 16384))
RUNNING_PER_CONTEXT, MIN_RUNNING, MAX_RUNNING = 512, 2048, 4096  # SGLang's request pool


class DeviceMemory(NamedTuple):
    """What sizing reads of the device (a simulated one: its profile)."""

    platform: str  # "cpu", "gpu" or "tpu"
    total_bytes: float  # one device's memory (the chunk's tier); on a CPU the host's
    free_bytes: float  # what one device's pool may take, the weights placed
    host_devices: int = 1  # on a CPU: this process's devices, whose pools share the host


class Limits(NamedTuple):
    """The limits an engine runs by, each the configuration's or sized from the device."""

    pool_tokens: int
    max_running_requests: int
    chunked_prefill_size: int | None  # None: off
    max_prefill_tokens: int
    mixed: bool  # decode tokens ride along with prompt tokens in one step
    pool_rule: str  # how the pool was sized
    bytes_per_token: float  # of the pool, on one device

    def describe(self) -> str:
        """The startup line's account of the limits."""
        chunk = "off" if self.chunked_prefill_size is None else self.chunked_prefill_size
        gib = self.pool_tokens * self.bytes_per_token / GIB
        return (f"KV pool {self.pool_tokens} tokens ({gib:.2f}"
                f" GiB per device; {self.pool_rule}), max_running_requests "
                f"{self.max_running_requests}, chunked_prefill_size {chunk}, max_prefill_tokens "
                f"{self.max_prefill_tokens}, steps {'unified' if self.mixed else 'prefill or decode'}")


def slot_row_bytes(vocab_size: int) -> int:
    """A slot's rows on every device: an int32 token count and a float32 logit bias a
    vocabulary entry (the model runner's ``token_counts`` and ``logit_bias``)."""
    return 8 * vocab_size


def accelerator_chunk(total_bytes: float) -> int:
    """SGLang's chunk for a device of ``total_bytes``."""
    for below_gib, tokens in ACCELERATOR_CHUNKS:
        if below_gib is None or total_bytes < below_gib * GIB:
            return tokens
    raise AssertionError("unreachable")


def running_from_pool(pool_tokens: int, context_length: int) -> int:
    """SGLang's ``max_running_requests`` for a pool of ``pool_tokens`` and a context."""
    requests = min(max(int(pool_tokens / context_length * RUNNING_PER_CONTEXT), MIN_RUNNING),
                   MAX_RUNNING)
    return max(1, min(requests, pool_tokens // 2))


def resolve_limits(config: EngineConfig, memory: DeviceMemory, bytes_per_token: float,
                   context_length: int, itemsize: int, row_bytes: float = 0.0) -> Limits:
    """The limits of ``config`` on a device of ``memory`` whose pool holds ``bytes_per_token``
    per token (one device's share); the KV dtype is ``itemsize`` bytes; ``row_bytes``: what a
    running request's slot holds on a device beside its KV (its penalty and bias rows), for
    ``max_running_requests`` + 1 slots (the scratch row)."""
    cpu = memory.platform == "cpu"
    ps = config.page_size
    if config.chunked_prefill_size is None:
        chunk = CPU_CHUNK if cpu else accelerator_chunk(memory.total_bytes)
        chunk = max(ps, chunk // ps * ps)
    else:
        chunk = None if config.chunked_prefill_size == -1 else config.chunked_prefill_size
    mixed = config.enable_mixed_chunk
    if mixed is None:
        mixed = chunk is not None and (CPU_MIXED if cpu else True)
    max_prefill = config.max_prefill_tokens or (CPU_MAX_PREFILL if cpu else ACCELERATOR_MAX_PREFILL)
    running = config.max_running_requests
    if cpu:  # whatever sizes the pool: SGLang's rule from the pool is for accelerators
        running = running or CPU_MAX_RUNNING
    free = max(memory.free_bytes, 0.0) * config.mem_fraction_static
    # the rows of as many requests as the pool may let run: the cap when it is known, else the
    # most SGLang's rule gives (MAX_RUNNING); given back below once the cap is known
    reserved = row_bytes * ((running or MAX_RUNNING) + 1)
    free = max(free - reserved, 0.0)
    if config.max_total_tokens:
        pool, rule = config.max_total_tokens, "max_total_tokens"
    elif cpu:
        # a 16-bit float pool: a step's float32 copies beside it (FP8 pools, uint8, update in place)
        host_bytes = bytes_per_token * (3 if itemsize == 2 else 1)
        options = {"4 GiB, the CPU's default budget":
                   CPU_KV_BUDGET_BYTES / (host_bytes * max(1, memory.host_devices)),
                   f"max_running_requests × context = {running} × {context_length}":
                   running * context_length,
                   f"{config.mem_fraction_static} of the free memory": free / host_bytes}
        rule = min(options, key=options.get)
        pool = int(options[rule])
    else:
        pool, rule = int(free / bytes_per_token), f"{config.mem_fraction_static} of the free memory"
    pool = max(ps, pool // ps * ps)
    if running is None:
        running = running_from_pool(pool, context_length)
        if config.speculative_method is not None:
            running = max(1, running // (config.num_speculative_tokens + 1))
        if not config.max_total_tokens and not cpu:  # the rows of requests that cannot run
            spare = row_bytes * (MAX_RUNNING - running)
            pool = max(ps, int((free + spare) / bytes_per_token) // ps * ps)
    return Limits(pool, running, chunk, max_prefill, mixed, rule, bytes_per_token)
