"""The roofline cost model of one step of the built-in decoder on a :class:`DeviceProfile`.

Per layer, on each device of a tensor-parallel group of ``tp``:

* weight matmuls: ``2 · T · P`` FLOPs over the padded new tokens ``T`` (the compiled bucket
  computes its padding too) against ``P · b`` bytes of weights, ``P`` the layer's matrices'
  parameters on one device (q, k, v, o split by heads, gate, up, down by the intermediate size;
  KV heads replicated when tp exceeds them) and ``b`` the weights' bytes (1 for FP8 weights); its time is the larger
  of FLOPs / (matmul ceiling · matmul_eff) and bytes / (copy ceiling · memory_eff);
* attention over the real lengths (the kernels are ragged): ``4 · heads · head_dim`` FLOPs per
  query-key pair (a sequence of ``q`` new tokens ending at ``k`` keys has ``q·k − q(q−1)/2``)
  against the K and V of its ``k`` keys read and of its ``q`` new tokens written (in the KV
  cache's dtype: a byte an element for FP8); the larger of
  FLOPs / (ceiling · attention_flops_eff) and bytes / (copy ceiling · attention_bw_eff), plus
  ``attention_seq_s`` per real sequence (a kernel's work per sequence beyond its bytes: a short
  context is read less efficiently than a long one);
* the profile's ``layer_s``: a layer's fixed cost (its kernels' launches and small ops);
* with tp > 1, two all-reduces of the ``T × hidden`` activations (after o and down), each
  ``latency + 2 (tp − 1) / tp · bytes / interconnect``, a ring's.

Per step: the LM head over the sequences' last tokens (every token's with prompt logprobs, and
in a speculative verify step, whose sequences' ``k + 1`` new tokens each sample: its attention
is a short ragged prefill's, its matmuls and head those of ``k + 1`` tokens per sequence), as a
matmul of one device's share of the vocabulary (split by tp); with tp > 1, the all-reduce of the
embedded ``T × hidden`` tokens and the all-gather of the float32 logits (``latency + (tp − 1) /
tp · bytes / interconnect``; a greedy step without logprobs gathers only each device's argmax
where tp divides the vocabulary: two latencies, values and ids); the sampler and the logprobs
program each read the float32 logits once; and the profile's fixed launch cost, ``launch_s``.

The cost depends on a step's sequences only through a few sums (:class:`StepLoad`), so a step
recorded as those sums (a measured trace, ``simulate/calibration.py``) is costed as the
simulator costs it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from minijax_serve.models.config import ModelConfig
from minijax_serve.simulate.profiles import DeviceProfile


class StepLoad(NamedTuple):
    """What the cost model reads of a step: its padded new tokens, the real sequences' count
    and sums over them, and the LM head's rows."""

    num_tokens: int  # padded new tokens (the compiled bucket's)
    seqs: int  # real sequences (at least one new token)
    new_tokens: int  # their new tokens, summed
    keys: int  # their KV lengths at the step's end, summed
    pairs: int  # their visible (query, key) pairs, summed
    logit_rows: int  # rows of the LM head


def step_load(num_tokens: int, q_lens: np.ndarray, kv_lens: np.ndarray,
              logit_rows: int) -> StepLoad:
    """The load of a step of ``num_tokens`` padded new tokens whose sequences have ``q_lens``
    new tokens each, ending at ``kv_lens`` keys (padding sequences: 0 new tokens)."""
    q = np.asarray(q_lens, np.int64)
    k = np.asarray(kv_lens, np.int64)
    return StepLoad(num_tokens, int((q > 0).sum()), int(q.sum()), int(k.sum()),
                    int((q * k - q * (q - 1) // 2).sum()), logit_rows)


class StepCost(NamedTuple):
    """Seconds of one simulated step, and its parts (the layers' parts summed over layers)."""

    total_s: float
    matmul_s: float
    attention_s: float
    allreduce_s: float
    head_s: float  # embedding and logits collectives, LM head, sampler, logprobs
    launch_s: float  # fixed costs: the step's launch and every layer's


class CostModel:
    """Step times of ``cfg`` in ``dtype`` on ``tp`` devices of ``profile`` (each KV head held by
    ``kv_replicas`` of them). ``quantization`` ("fp8", "fp8_w8a8"): the layers' matrices are
    read as a byte per weight (their per-column scales, under 0.1 % of those bytes, are left
    out) and multiplied at ``dtype``'s rate: FP8 x FP8 on Hopper's FP8 units, twice the
    bfloat16 rate, is not modelled until a GPU measures it. ``kv_dtype``: the pools' element
    type (default ``dtype``; FP8: a byte an element)."""

    def __init__(self, profile: DeviceProfile, cfg: ModelConfig, dtype, tp: int = 1,
                 kv_replicas: int = 1, quantization: str | None = None, kv_dtype=None):
        if not isinstance(cfg, ModelConfig):
            raise ValueError("simulate needs model_config= a ModelConfig (its hidden_size and "
                             "intermediate_size cost the steps), got " + type(cfg).__name__)
        self.profile, self.cfg, self.tp = profile, cfg, tp
        self.itemsize = b = jnp.dtype(dtype).itemsize
        self.weight_itemsize = 1 if quantization is not None else b
        kv_itemsize = jnp.dtype(dtype if kv_dtype is None else kv_dtype).itemsize
        h, kv = cfg.hidden_size, cfg.kv_size * kv_replicas
        # K and V's projections repeated kv_replicas times when tp exceeds the KV heads
        repeated = 2 * h * cfg.kv_size * (kv_replicas - 1)
        self.layer_params = (cfg.layer_matrix_params() + repeated) / tp
        self.kv_bytes_per_token = 2 * kv / tp * kv_itemsize  # K and V of one token in one layer
        self.attn_flops_per_key = 4 * cfg.num_heads / tp * cfg.head_dim
        self.act_bytes_per_token = h * b
        self.head_params = h * -(-cfg.vocab_size // tp)  # one device's columns
        self.flops = profile.flops(dtype)

    def _roofline(self, flops: float, bytes_: float, flops_eff: float, bw_eff: float) -> float:
        p = self.profile
        return max(flops / (self.flops * flops_eff), bytes_ / (p.memory_bw * bw_eff))

    def step(self, num_tokens: int, q_lens: np.ndarray, kv_lens: np.ndarray,
             logit_rows: int, logprobs: bool = False, greedy: bool = False) -> StepCost:
        """The cost of a step of ``num_tokens`` padded new tokens, whose sequences have
        ``q_lens`` new tokens each, ending at ``kv_lens`` keys; the LM head runs on
        ``logit_rows`` rows (the padded sequences, or every token for prompt logprobs);
        ``greedy``: every sequence samples greedily."""
        return self.cost(step_load(num_tokens, q_lens, kv_lens, logit_rows), logprobs, greedy)

    def cost(self, load: StepLoad, logprobs: bool = False, greedy: bool = False) -> StepCost:
        """The cost of a step of ``load`` (:meth:`step`'s, from the sums it reads)."""
        p, L = self.profile, self.cfg.num_layers
        num_tokens, logit_rows = load.num_tokens, load.logit_rows
        matmul = self._roofline(2.0 * num_tokens * self.layer_params,
                                self.layer_params * self.weight_itemsize, p.matmul_eff,
                                p.memory_eff)
        kv_bytes = float(load.keys + load.new_tokens) * self.kv_bytes_per_token
        attention = self._roofline(self.attn_flops_per_key * float(load.pairs), kv_bytes,
                                   p.attention_flops_eff, p.attention_bw_eff)
        attention += load.seqs * p.attention_seq_s
        allreduce = collectives = 0.0  # one all-reduce of the activations; the step's other two
        logits_bytes = 4.0 * logit_rows * self.cfg.vocab_size
        if self.tp > 1:
            share = (self.tp - 1) / self.tp
            allreduce = p.allreduce_latency_s + 2 * share * num_tokens * self.act_bytes_per_token \
                / p.interconnect_bw
            gathered = not greedy or logprobs or self.cfg.vocab_size % self.tp
            gather = (p.allreduce_latency_s + share * logits_bytes / p.interconnect_bw
                      if gathered else 2 * p.allreduce_latency_s)  # else each device's argmax
            collectives = allreduce + gather
        head = self._roofline(2.0 * logit_rows * self.head_params, self.head_params * self.itemsize,
                              p.matmul_eff, p.memory_eff)
        head += collectives + (1 + logprobs) * logits_bytes / (p.memory_bw * p.memory_eff)
        fixed = p.launch_s + L * p.layer_s
        total = L * (matmul + attention + 2 * allreduce) + head + fixed
        return StepCost(total, L * matmul, L * attention, 2 * L * allreduce, head, fixed)
