"""The per-chip cost model read from optimized HLO (comppo_jax.costs.hlo_cost) and the plan's step time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import require_libtpu

from comppo_jax.costs import chips, hlo_cost
from comppo_jax.models import model_config
from comppo_jax.models.loading import PRESET_DIR, load_config_file
from comppo_jax.planning import overlap, planner


def compiled_text(fn, *shapes):
    compiled = jax.jit(fn).lower(*[jax.ShapeDtypeStruct(s, d) for s, d in shapes]).compile()
    return compiled.as_text(), compiled.cost_analysis()


def test_a_scanned_matmul_counts_every_iteration_where_xla_counts_one():
    def layers(w, x):
        return jax.lax.scan(lambda x, w1: (jnp.tanh(x @ w1), None), x, w)[0]

    text, xla = compiled_text(layers, ((10, 256, 256), jnp.float32), ((64, 256), jnp.float32))
    one = 2 * 64 * 256 * 256
    cost = hlo_cost.program_cost(text)
    assert cost.flops == pytest.approx(10 * one, rel=1e-6) and cost.flops_fp32 == cost.flops
    assert xla["flops"] == pytest.approx(one, rel=0.01)  # why the walker exists
    assert cost.unknown_loops == ()


def test_loop_free_flops_match_xla_cost_analysis():
    def block(x, wq, wk, w_up):
        q = (x @ wq).reshape(4, 128, 8, 64)  # [B, L, H, d]
        k = (x @ wk).reshape(4, 128, 2, 64)
        grouped = jnp.einsum("blhgd,bmhd->bhglm", q.reshape(4, 128, 2, 4, 64), k)  # GQA scores
        return grouped.sum() + (x @ w_up).sum()

    text, xla = compiled_text(
        block,
        ((512, 512), jnp.bfloat16),
        ((512, 512), jnp.bfloat16),
        ((512, 128), jnp.bfloat16),
        ((512, 2048), jnp.bfloat16),
    )
    cost = hlo_cost.program_cost(text)
    analytic = 2 * 512 * 512 * 512 + 2 * 512 * 512 * 128 + 2 * 4 * 8 * 128 * 128 * 64 + 2 * 512 * 512 * 2048
    assert cost.flops == pytest.approx(analytic, rel=1e-6)
    assert cost.flops == pytest.approx(xla["flops"], rel=0.05)  # XLA adds the elementwise work
    assert cost.hbm_bytes > 0


def test_a_data_dependent_loop_takes_its_count_from_its_named_scope():
    def decode(w, x, steps):
        def body(state):
            x, i = state
            return jnp.tanh(x @ w), i + 1

        with jax.named_scope("decode_here"):  # the bound is an argument: known only at run time
            return jax.lax.while_loop(lambda s: s[1] < steps, body, (x, jnp.int32(0)))[0]

    text, _ = compiled_text(decode, ((128, 128), jnp.float32), ((16, 128), jnp.float32), ((), jnp.int32))
    one = 2 * 16 * 128 * 128
    unknown = hlo_cost.program_cost(text)
    assert unknown.flops == pytest.approx(one) and len(unknown.unknown_loops) == 1
    counted = hlo_cost.program_cost(text, loop_trips={"decode_here": 7})
    assert counted.flops == pytest.approx(7 * one) and counted.unknown_loops == ()


def test_a_cond_counts_its_costlier_branch_or_the_given_rate():
    def admit(w, x, flag):
        with jax.named_scope("admit_here"):
            return jax.lax.cond(flag, lambda x: x @ w @ w, lambda x: x, x)

    text, _ = compiled_text(admit, ((128, 128), jnp.float32), ((16, 128), jnp.float32), ((), jnp.bool_))
    both = 2 * 2 * 16 * 128 * 128
    assert hlo_cost.program_cost(text).flops == pytest.approx(both)
    assert hlo_cost.program_cost(text, branch_rates={"admit_here": 0.25}).flops == pytest.approx(both / 4)


def test_in_place_updates_and_sliced_operands_move_their_slices_not_the_buffer():
    def write_rows(buffer, rows):
        def step(buffer, i):
            row = jax.lax.dynamic_index_in_dim(rows, i, keepdims=False) * 2.0
            return jax.lax.dynamic_update_index_in_dim(buffer, row, i, 0), None

        return jax.lax.scan(step, buffer, jnp.arange(64))[0]

    text, _ = compiled_text(write_rows, ((64, 4096), jnp.float32), ((64, 4096), jnp.float32))
    buffer = 64 * 4096 * 4
    # Each of the 64 steps reads a row and writes a row; a whole-buffer count would be 64 x 2 buffers.
    assert hlo_cost.program_cost(text).hbm_bytes < 8 * buffer


def test_roofline_is_the_slower_of_compute_and_memory_plus_the_collectives():
    chip = chips.Chip("test", bf16_flops=100.0, fp32_flops=50.0, hbm_bytes=10.0, ici_bytes=2.0, host_bytes=1.0)
    compute_bound = hlo_cost.ProgramCost(200.0, 50.0, 10.0, 4.0, {"all-reduce": 4.0})
    assert hlo_cost.roofline_seconds(compute_bound, chip) == pytest.approx(2.0 + 1.0 + 2.0)
    memory_bound = hlo_cost.ProgramCost(100.0, 0.0, 50.0, 0.0, {})
    assert hlo_cost.roofline_seconds(memory_bound, chip) == pytest.approx(5.0)


def test_each_collective_pays_its_ring_steps_in_hop_latency():
    chip = chips.Chip("test", 100.0, 100.0, 10.0, 2.0, 1.0, hop_latency=0.5)
    assert hlo_cost.roofline_seconds(
        hlo_cost.ProgramCost(0.0, 0.0, 10.0, 4.0, {}, collective_hops=6.0), chip
    ) == pytest.approx(1 + 2 + 3)
    reduce = hlo_cost._parse_instruction(
        "%ar = f32[8,16]{1,0} all-reduce(%x), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add"
    )
    assert hlo_cost._collective_cost(reduce, {}, 8).collective_hops == 2 * (4 - 1)
    # jax 0.10's mesh form of replica groups: the product of the axes named.
    gather = hlo_cost._parse_instruction(
        "%ag = f32[2,8]{0,1} all-gather(%x), channel_id=1, "
        "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={1}"
    )
    assert hlo_cost._group_size(gather.attributes, 8) == 4
    assert hlo_cost._collective_cost(gather, {}, 8).collective_hops == 3


def test_a_layer_weight_sliced_inside_a_nested_fusion_is_read_as_its_slice():
    """The decode step's fused matmul: the stacked [N, ...] weight goes into an inner fusion that
    dynamic-slices it; only one layer's slice is read."""
    text = """HloModule m

%slice_layer (p0: bf16[36,512,256], p1: s32[]) -> bf16[512,256] {
  %p0 = bf16[36,512,256]{2,1,0} parameter(0)
  %p1 = s32[]{:T(128)} parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,512,256]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,512,256}
  ROOT %b = bf16[512,256]{1,0} bitcast(%ds)
}

%matmul (q0: bf16[8,512], q1: bf16[36,512,256], q2: s32[]) -> f32[8,256] {
  %q0 = bf16[8,512]{1,0} parameter(0)
  %q1 = bf16[36,512,256]{2,1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %w = bf16[512,256]{1,0} fusion(%q1, %q2), kind=kLoop, calls=%slice_layer
  ROOT %c = f32[8,256]{1,0} convolution(%q0, %w), dim_labels=bf_io->bf
}

%outer (r0: bf16[8,512], r1: bf16[36,512,256], r2: s32[]) -> f32[8,256] {
  %r0 = bf16[8,512]{1,0} parameter(0)
  %r1 = bf16[36,512,256]{2,1,0} parameter(1)
  %r2 = s32[] parameter(2)
  ROOT %f = f32[8,256]{1,0} fusion(%r0, %r1, %r2), kind=kOutput, calls=%matmul
}

ENTRY %main (x: bf16[8,512], w: bf16[36,512,256], i: s32[]) -> f32[8,256] {
  %x = bf16[8,512]{1,0} parameter(0)
  %w = bf16[36,512,256]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %y = f32[8,256]{1,0} fusion(%x, %w, %i), kind=kOutput, calls=%outer
}
"""
    layer = 512 * 256 * 2
    expected = 8 * 512 * 2 + layer + 4 + 8 * 256 * 4  # x, one layer's slice, the index, the output
    assert hlo_cost.program_cost(text).hbm_bytes == pytest.approx(expected)


def test_decode_attention_counts_the_kv_of_its_live_rows_not_its_tile_padding():
    call = hlo_cost._parse_instruction(
        '%ragged_paged_attention.1 = bf16[8,4,128]{2,1,0} custom-call(%q, %pool), custom_call_target="tpu_custom_call"'
    )
    shapes = {"q": ("bf16", (8, 4, 128)), "pool": ("bf16", (100, 64, 4, 128))}
    full = hlo_cost._paged_kv_bytes(call, shapes, context=1000.0)
    assert full == 8 * 1000 * 4 * 128 * 2
    assert hlo_cost._paged_kv_bytes(call, shapes, context=1000.0, rows=1) == full / 8
    assert (
        hlo_cost._attention_flops(call, shapes, 1000.0, rows=1) == hlo_cost._attention_flops(call, shapes, 1000.0) / 8
    )


def test_every_topology_the_plan_accepts_has_published_peaks():
    assert set(planner.HBM_GIB) <= set(chips.CHIPS)
    for chip in chips.CHIPS.values():
        assert min(chip.bf16_flops, chip.fp32_flops, chip.hbm_bytes, chip.ici_bytes, chip.host_bytes) > 0
        assert chip.fp32_flops <= chip.bf16_flops


def test_model_flops_are_6n_per_trained_token_plus_the_rollout():
    cfg = load_config_file(PRESET_DIR / "qwen3_4b.py")
    config = model_config(cfg.model)
    n = overlap.matmul_params(config)
    assert 3.5e9 < n < 4.5e9  # Qwen3-4B: 4.0B parameters, tied embeddings
    one_epoch = planner.model_flops(
        config, prompts=4, rows=16, prompt_length=512, response=4096, epochs=1, reference=False
    )
    two_epochs = planner.model_flops(
        config, prompts=4, rows=16, prompt_length=512, response=4096, epochs=2, reference=False
    )
    tokens = 16 * (512 + 4096)
    # One more epoch adds a forward and backward: 6N per token plus attention.
    assert 6 * n * tokens < two_epochs - one_epoch < 6 * n * tokens * 1.5
    # Skipping the behaviour pass (GRPO with the sampler's log-probs) takes one forward off.
    no_behaviour = planner.model_flops(
        config, prompts=4, rows=16, prompt_length=512, response=4096, epochs=1, reference=False, behaviour=False
    )
    assert 2 * n * tokens < one_epoch - no_behaviour < 2 * n * tokens * 1.5
    # gate_refresh=epoch: a forward without the vocabulary projection per refresh.
    refreshed = planner.model_flops(
        config, prompts=4, rows=16, prompt_length=512, response=4096, epochs=2, reference=False, gate_refreshes=1
    )
    body = n - config.hidden_size * config.vocab_size
    assert 2 * body * tokens < refreshed - two_epochs < 2 * body * tokens * 1.5


# ---------------------------------------------------------------------------------------------
# The plan's programs, compiled for TPU slices (needs libtpu).


def tiny(**arch):
    cfg = load_config_file(PRESET_DIR / "tiny.py")
    cfg.mesh.update(data=1, fsdp=2, tensor=-1)
    cfg.model.arch.update(num_heads=8, num_kv_heads=4, head_dim=32, **arch)
    cfg.train.packing = False  # rows of a fixed length: the tokens a program computes scale exactly
    return cfg


def program(cfg, name, topology="v5e:2x2", prompt_length=24):
    result = planner.plan(cfg, topology, prompt_length=prompt_length, steps=(name,), log=lambda message: None)
    (step,) = result.steps
    assert step.error is None and step.cost.flops > 0 and step.cost.hbm_bytes > 0
    assert step.cost.unknown_loops == () and step.cost.unknown_kernels == ()
    return result, step


@pytest.mark.slow
def test_actor_flops_grow_linearly_in_tokens_and_layers_and_halve_with_twice_the_tensor_axis():
    require_libtpu()
    wide = dict(hidden_size=256, intermediate_size=1024, vocab_size=1024)  # shards of whole (8, 128) tiles
    _, base = program(tiny(**wide), "actor")
    longer = tiny(**wide)
    longer.rollout.max_new_tokens = 2 * longer.rollout.max_new_tokens + 24  # twice the tokens per row
    _, twice_tokens = program(longer, "actor")
    assert twice_tokens.cost.flops / base.cost.flops == pytest.approx(2.0, rel=0.15)
    _, twice_layers = program(tiny(num_layers=8, **wide), "actor")
    # The layers are nearly all of it; the vocabulary head is not repeated.
    assert 1.7 < twice_layers.cost.flops / base.cost.flops <= 2.0
    _, tensor_4 = program(tiny(**wide), "actor", topology="v5e:2x4")  # fsdp 2 x tensor 4 against the base's 2 x 2
    assert tensor_4.cost.flops / base.cost.flops == pytest.approx(0.5, rel=0.15)


@pytest.mark.slow
def test_decode_bytes_grow_with_the_context_and_the_plan_prints_the_step_time():
    require_libtpu()
    short_result, short = program(tiny(), "sample")
    longer = tiny()
    longer.rollout.max_new_tokens *= 4
    _, long = program(longer, "sample")
    per_step = lambda step, cfg: step.parts["decode"].hbm_bytes / cfg.rollout.max_new_tokens
    assert per_step(long, longer) > 1.1 * per_step(short, tiny())
    assert short.parts["prefill"].flops > 0 and short.parts["decode"].flops > 0
    text = planner.format_plan(short_result)
    assert "sample decode" in text and "sample prefill" in text and "MFU" in text
    summary = planner.step_summary(short_result)
    assert summary.seconds > 0 and 0 < summary.mfu < 1 and summary.uncounted == ()
