"""The engine with ``attention_backend="pallas"`` (the kernels in interpret mode on CPU): token for
token HuggingFace's greedy output, with chunked prefill, mixed steps and decode steps; and the
GPU defaults' steps (Pallas, unrolled layers) free of device-side branches."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import pytest

from minijax_serve import Engine, EngineConfig, SamplingParams
from minijax_serve.attention.backends import check_hopper
from minijax_serve.attention.registry import attention_backend, check_page_size, pallas_kernels_run
from minijax_serve.executor.forward_batch import empty_forward_batch, pack, sampling_size
from minijax_serve.executor.step_functions import forward_step, logprobs_step, sample_step
from pallas_kernels.ragged_paged_attention import check_shapes
from tests.scheduler.test_chunked_prefill import run_arrivals
from tests.engine.test_engine import assert_idle_and_clean

NEW = 24  # the length of the conftest's HF references


# (family, page size, chunk, backend, unified steps, short and long prompts: how many of the
# tiny ones)
PALLAS_CASES = [("llama", 16, 32, "pallas", False, 4, 6), ("qwen3", 1, 8, "pallas", True, 4, 6),
                ("qwen3", 16, 32, "pallas_mgpu", True, 2, 2)]


@pytest.mark.parametrize("family,page_size,chunk,backend,unified,num_short,num_long",
                         PALLAS_CASES)
def test_pallas_engine_matches_hf(family, page_size, chunk, backend, unified, num_short, num_long,
                                  tiny_dir, tiny_prompts, tiny_greedy_refs):
    """Llama: head_dim 16, MHA; Qwen3: head_dim 64, GQA 3 (padded to 4 in the Triton kernels).
    The long prompts arrive while the short ones decode. Unified steps (the accelerators'
    default): decode tokens and chunks in one ragged step, decode-only steps on the ragged
    kernel too (on the decode kernel with pallas_mgpu); else prefill steps and decode steps
    apart, these on the decode kernel. The
    Mosaic GPU kernel runs in float32 in its interpreter (on a GPU it takes bfloat16), a second
    or so a call here: fewer prompts."""
    engine = Engine(tiny_dir[family], attention_backend=backend, page_size=page_size,
                    chunked_prefill_size=chunk, enable_mixed_chunk=unified,
                    skip_tokenizer_init=True,
                    max_total_tokens=1024, max_running_requests=4, max_prefill_tokens=64,
                    min_token_bucket=8, min_seq_bucket=4, min_kv_bucket=64)
    assert engine.attention_backend == backend
    short, long = tiny_prompts[:num_short], tiny_prompts[-num_long:]
    refs = tiny_greedy_refs[family][:num_short] + tiny_greedy_refs[family][-num_long:]
    outs = run_arrivals(engine, short, long, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    stats = engine.stats()
    assert (stats["mixed_steps"] > 0) == unified
    assert stats["chunked_steps"] > 0 and stats["decode_steps"] > 0
    split = not unified or backend == "pallas_mgpu"  # its ragged kernel decodes slower
    assert any(shape.decode for shape in engine.runner.step_shapes) == split
    assert_idle_and_clean(engine)


def test_pallas_config_errors():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="triton")
    with pytest.raises(ValueError, match="page_size"):  # the registry's check, before loading
        check_page_size(EngineConfig(attention_backend="pallas", page_size=12).attention_backend, 12)
    for page_size in (4, 128):
        with pytest.raises(ValueError, match="'pallas_mgpu' needs page_size to be 8, 16, 32 or 64"):
            check_page_size("pallas_mgpu", page_size)
    with pytest.raises(ValueError, match="'pallas_mgpu' needs page_size to be 8, 16, 32 or 64"):
        Engine("no-such-model", attention_backend="pallas_mgpu", page_size=4)
    with pytest.raises(ValueError, match="head_dim"):
        check_shapes(num_heads=4, kv_heads=2, head_dim=80)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        check_shapes(num_heads=6, kv_heads=4, head_dim=64)
    assert EngineConfig().resolved_attention_backend("gpu") == "pallas"
    assert EngineConfig().resolved_attention_backend("cpu") == "xla"
    assert EngineConfig(attention_backend="pallas").resolved_attention_backend("cpu") == "pallas"
    assert pallas_kernels_run()  # the probe behind "auto" on GPUs (here: interpreted)


def test_auto_backend_falls_back_where_the_kernels_cannot_run(monkeypatch):
    """On a GPU, "auto" takes the kernels only for shapes they support; "pallas" raises."""
    monkeypatch.setattr("minijax_serve.attention.registry.pallas_kernels_run", lambda: True)
    monkeypatch.setattr("minijax_serve.attention.backends.jax.default_backend", lambda: "gpu")
    model = SimpleNamespace(num_heads=8, num_kv_heads=2, head_dim=64)
    assert attention_backend(EngineConfig(), model, "gpu") == "pallas"
    assert attention_backend(EngineConfig(page_size=12), model, "gpu") == "xla"
    odd = SimpleNamespace(num_heads=8, num_kv_heads=2, head_dim=80)
    assert attention_backend(EngineConfig(), odd, "gpu") == "xla"
    with pytest.raises(ValueError, match="head_dim"):
        attention_backend(EngineConfig(attention_backend="pallas"), odd, "gpu")
    assert attention_backend(EngineConfig(attention_backend="xla"), model, "gpu") == "xla"
    mgpu = EngineConfig(attention_backend="pallas_mgpu")  # asked for: never a fallback
    with pytest.raises(ValueError, match=r"capability 9.0 \(Hopper\) or more, got cpu"):
        attention_backend(mgpu, model, "gpu", jnp.bfloat16)  # this machine's device
    hopper = SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
    ampere = SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100")
    with pytest.raises(ValueError, match="got NVIDIA A100"):
        check_hopper(ampere)
    monkeypatch.setattr("minijax_serve.attention.backends.jax.devices", lambda: [hopper])
    assert attention_backend(mgpu, model, "gpu", jnp.bfloat16) == "pallas_mgpu"
    assert attention_backend(mgpu, model, "cpu", jnp.float32) == "pallas_mgpu"  # interpreted
    split = dataclasses.replace(mgpu, tensor_parallel_size=2)
    assert attention_backend(split, model, "gpu", jnp.bfloat16) == "pallas_mgpu"
    with pytest.raises(ValueError, match="cannot run on several devices at once"):
        attention_backend(split, model, "cpu", jnp.float32)  # its interpreter
    with pytest.raises(ValueError, match="bfloat16 or float16 on a GPU"):
        attention_backend(mgpu, model, "gpu", jnp.float32)
    with pytest.raises(ValueError, match="head_dim to be a multiple of 64"):
        attention_backend(mgpu, SimpleNamespace(num_heads=8, num_kv_heads=2, head_dim=32),
                          "gpu", jnp.bfloat16)
    monkeypatch.setattr("minijax_serve.attention.registry.pallas_kernels_run", lambda: False)
    assert attention_backend(EngineConfig(), model, "gpu") == "xla"
    # a simulated GPU resolves as a GPU would, whether the kernels run on this machine or not
    for here in ("gpu", "cpu"):
        monkeypatch.setattr("minijax_serve.attention.backends.jax.default_backend", lambda: here)
        assert attention_backend(EngineConfig(simulate="h200"), model, "gpu") == "pallas"
        assert attention_backend(EngineConfig(simulate="cpu"), model, "cpu") == "xla"


def _primitives(jaxpr) -> set[str]:
    """Primitive names in ``jaxpr`` and the jaxprs nested in it, Pallas kernels' bodies excluded
    (their loops and branches run inside one GPU kernel)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, jcore.ClosedJaxpr):
                    names |= _primitives(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    names |= _primitives(sub)
    return names


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_gpu_defaults_leave_no_device_side_branch_in_a_step(layer_loop, tiny_dir):
    """On a GPU, XLA makes the host wait for the device at every ``cond`` (switch) and every
    ``while`` whose trip count is not static. With the GPU defaults (Pallas, unrolled layers)
    neither a decode nor a prefill model program holds one (nor its prompt-logprobs variant),
    nor does any sampler (greedy or not, penalised or not) or the logprobs program; the CPU's
    scan picks each layer's weights with a switch."""
    engine = Engine(tiny_dir["qwen3"], attention_backend="pallas", layer_loop=layer_loop,
                    skip_tokenizer_init=True, max_total_tokens=256, max_running_requests=4,
                    max_prefill_tokens=32, min_token_bucket=32, min_seq_bucket=4)
    runner = engine.runner
    shapes = engine.buckets.all_shapes()
    assert {s.decode for s in shapes} == {True, False}  # decode steps are programs of their own
    scoring = [s._replace(prompt_logprobs=True) for s in shapes if not s.decode]
    for shape in shapes + scoring:
        forward = functools.partial(forward_step, runner.graphdef, runner.param_tree, "pallas",
                                    layer_loop, runner.mesh, shape, runner.max_logprobs)
        packed = pack(empty_forward_batch(shape))
        targets = (jnp.zeros(shape.num_tokens, jnp.int32),) if shape.prompt_logprobs else ()
        names = _primitives(jax.make_jaxpr(forward)(
            runner.params, runner.k_pool, runner.v_pool, runner.kv_scales, runner.token_buf, packed,
            *targets).jaxpr)
        assert "pallas_call" in names
        if layer_loop == "unroll":
            assert not names & {"cond", "while"}, (shape, names & {"cond", "while"})
        else:
            assert "cond" in names
    logits = jnp.zeros((4, engine.model_config.vocab_size), jnp.float32)
    front = jnp.zeros((sampling_size(4),), jnp.int32)
    adjust = [jnp.zeros(runner.counts_shape.shape, jnp.int32),  # token counts, logit bias rows
              jnp.zeros(runner.bias_shape.shape, jnp.float32)]
    mask = [jnp.zeros((4, (logits.shape[1] + 31) // 32), jnp.int32)]  # grammars' token bits
    for greedy, truncated in ((True, True), (False, True), (False, False)):
        for penalized in (False, True):
            for constrained in (False, True):
                sampler = functools.partial(sample_step, 4, greedy, truncated, penalized,
                                            constrained, runner.replicated)
                names = _primitives(jax.make_jaxpr(sampler)(
                    runner.token_buf, logits, front, *(adjust if penalized else []),
                    *(mask if constrained else [])).jaxpr)
                assert not names & {"cond", "while"}, (greedy, truncated, penalized, names)
    names = _primitives(jax.make_jaxpr(functools.partial(
        logprobs_step, runner.max_logprobs, runner.replicated))(logits, jnp.zeros(4, jnp.int32)).jaxpr)
    assert not names & {"cond", "while"}, names


def test_unrolled_layers_give_the_scans_tokens(tiny_dir, tiny_prompts):
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9,
                             seed=7)] * 3
    outs = {}
    for loop in ("scan", "unroll"):
        engine = Engine(tiny_dir["llama"], layer_loop=loop, skip_tokenizer_init=True,
                        max_total_tokens=1024, max_running_requests=4, min_token_bucket=16,
                        min_seq_bucket=4)
        assert engine.runner.layer_loop == loop
        outs[loop] = [o.token_ids for o in engine.generate(tiny_prompts[3:9], params)]
        assert_idle_and_clean(engine)
    assert outs["scan"] == outs["unroll"]


def test_layer_loop_config():
    assert EngineConfig().resolved_layer_loop("cpu") == "scan"
    assert EngineConfig().resolved_layer_loop("gpu") == "unroll"
    assert EngineConfig(layer_loop="scan").resolved_layer_loop("gpu") == "scan"
    with pytest.raises(ValueError, match="layer_loop"):
        EngineConfig(layer_loop="loop")
