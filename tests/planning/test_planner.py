"""launch/plan.py's engine: the tiny config's train step compiled for abstract TPU slices (needs libtpu)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import require_libtpu

from comppo_jax.models import model_config, param_shapes
from comppo_jax.models.loading import PRESET_DIR, load_config_file
from comppo_jax.planning import overlap, planner

PROMPT = 24


def tiny_config():
    """configs/tiny.py with ZeRO-3 over every chip, widened so that each weight's shard is a whole
    number of TPU (8, 128) tiles: the compiler's argument bytes then have no tile padding."""
    cfg = load_config_file(PRESET_DIR / "tiny.py")
    cfg.mesh.update(data=1, fsdp=-1, tensor=1)
    cfg.model.arch.update(hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=2, head_dim=64)
    return cfg


def actor_minibatch_bytes(cfg, chips: int) -> int:
    """Bytes per chip of the minibatch fields the actor step reads (jit drops the unused ones), by hand."""
    rows = cfg.train.minibatch_size // chips
    response = cfg.rollout.max_new_tokens
    length = PROMPT + response
    per_row = (
        length * (4 + 1)  # tokens int32, attention_mask bool
        + 4  # prompt_lengths int32
        + response * (4 + 1 + 3 * 4)  # response tokens int32, mask bool, old / ref log-probs and advantages float32
    )
    return rows * per_row + 4 * 4  # + the four float32 knobs (learning rate, clip, KL coefficient, grad clip)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1"])
def test_tiny_actor_step_compiles_for_tpu_and_its_arguments_are_the_analytic_count(topology):
    require_libtpu()
    cfg = tiny_config()
    cfg.train.packing = False  # the padded minibatch's fields, counted by hand
    result = planner.plan(cfg, topology, prompt_length=PROMPT, steps=("actor",), log=lambda message: None)
    assert result.attention == "splash"  # what a TPU run picks, not this host's CPU fallback
    (actor,) = result.steps
    assert result.chips == 4 and actor.error is None
    config = model_config(cfg.model)
    params = sum(
        int(np.prod(shape)) for shape in jax.tree.leaves(param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    )
    moments = 2  # AdamW's mu and nu, float32 like the master params
    analytic = params * 4 * (1 + moments) / result.chips + actor_minibatch_bytes(cfg, result.chips)
    assert actor.arguments == pytest.approx(analytic, rel=0.01)
    assert result.state["actor"] == pytest.approx(params * 4 / result.chips, rel=0.01)
    assert 0 < actor.temp and 0 < actor.code and 0 < actor.peak <= result.hbm and actor.conservative <= result.hbm
    assert planner.verdict(actor, result.hbm) == "fits"
    assert "v5" in planner.format_plan(result)


def test_out_of_memory_messages_become_one_line():
    seen = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (22.91G) "
        "exceeds available HBM (15.75G)."
    )  # qwen3_4b at 16K on v5e:4x4 with materialized attention and logits
    assert planner._does_not_fit(seen) == "does not fit (needs 22.91G for HLO temporaries alone, 15.75G HBM)"
    message = (
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
        "Used 57.27G of 15.75G hbm. Exceeded hbm capacity by 41.52G."
    )
    assert planner._does_not_fit(message) == "does not fit (needs 57.27G of 15.75G HBM)"
    assert (
        planner._does_not_fit("RESOURCE_EXHAUSTED: Exceeded hbm capacity by 3.1G")
        == "does not fit (exceeds HBM by 3.1G)"
    )


def test_unknown_topology_and_step_are_named():
    with pytest.raises(ValueError, match="'tpu9'"):
        planner.topology_devices("tpu9:2x2")
    with pytest.raises(ValueError, match="backward"):
        planner.plan(tiny_config(), "v5e:2x2", prompt_length=PROMPT, steps=("backward",))
    require_libtpu()
    with pytest.raises(ValueError, match="'v5e:3x3'"):
        planner.topology_devices("v5e:3x3")


@pytest.mark.slow
def test_offloading_idle_state_frees_its_hbm_and_the_plan_counts_the_transfers():
    require_libtpu()
    results = {}
    for offload in (False, True):
        cfg = tiny_config()
        cfg.train.offload_idle = offload
        results[offload] = planner.plan(
            cfg, "v5e:2x2", prompt_length=PROMPT, steps=("actor",), log=lambda message: None
        )
    (kept,), (offloaded,) = results[False].steps, results[True].steps
    state = results[True].state
    # The actor's epochs hold the rollout batch without the critic's features (the critic's epochs ran first).
    assert state["actor_batch"] < state["rollout_batch"]
    assert offloaded.resident == kept.resident - state["reference"] - state["actor_batch"]
    assert offloaded.peak == kept.peak - state["reference"] - state["actor_batch"]
    assert results[False].host_bytes == results[False].transfer_bytes == 0
    assert results[True].host_bytes == state["actor_opt"] + state["reference"]
    # 2 epochs: the batch goes to the host once, and comes back a minibatch at a time for each of
    # the critic's epochs (with the features) and the actor's (without).
    epochs = 2 * (state["rollout_batch"] + state["actor_batch"])
    assert (
        results[True].transfer_bytes == 2 * (state["actor_opt"] + state["reference"]) + state["rollout_batch"] + epochs
    )
    assert "host transfers" in planner.format_plan(results[True]) and "host transfers" not in planner.format_plan(
        results[False]
    )


@pytest.mark.slow
def test_a_full_copy_critic_is_planned_as_a_second_model():
    """PPO's usual critic beside the standard head: its state is the policy's trunk again (AdamW
    moments twice that), and its value pass is a full forward, as the compiled HLO's FLOPs show."""
    require_libtpu()
    results = {}
    for kind in ("standard", "full"):
        cfg = tiny_config()
        cfg.method, cfg.critic.kind = "ppo", kind
        cfg.train.packing = False  # every row's tokens computed: the FLOPs below count them
        results[kind] = planner.plan(
            cfg, "v5e:2x2", prompt_length=PROMPT, steps=("values", "critic"), log=lambda message: None
        )
    full, standard = results["full"], results["standard"]
    config = model_config(tiny_config().model)
    count = lambda tree: sum(
        int(np.prod(shape)) for shape in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple))
    )
    trunk = count(param_shapes(config)) - count(param_shapes(config).get("lm_head", ()))
    assert full.state["critic"] == pytest.approx((trunk + config.hidden_size + 1) * 4 / full.chips, rel=0.01)
    assert full.state["critic_opt"] == pytest.approx(2 * full.state["critic"], rel=0.01)
    assert standard.state["critic"] < full.state["critic"] / 100
    values = {kind: next(s for s in result.steps if s.step == "values") for kind, result in results.items()}
    cfg = tiny_config()
    tokens = (
        cfg.rollout.prompts_per_step
        * cfg.rollout.samples_per_prompt
        * (PROMPT + cfg.rollout.max_new_tokens)
        / full.chips
    )
    trunk_matmuls = overlap.matmul_params(config) - config.hidden_size * config.vocab_size
    assert values["full"].cost.flops >= 2 * trunk_matmuls * tokens  # a whole forward pass per value pass
    assert values["standard"].cost.flops < values["full"].cost.flops / 100
    assert all(planner.verdict(step, result.hbm) == "fits" for result in results.values() for step in result.steps)


@pytest.mark.slow
def test_the_packed_learner_compiles_for_tpu_and_computes_what_its_rows_hold():
    """train.packing: the scoring pass and the actor step compiled on packed rows of the long-tailed
    lengths a real run has, with the attention that skips other segments' key blocks; fewer rows,
    fewer FLOPs, and closer to the real tokens' FLOPs than the padded programs."""
    require_libtpu()
    results = {}
    for packing in (False, True):
        cfg = tiny_config()
        cfg.rollout.max_new_tokens = 488  # rows of 512 tokens: several key blocks of the kernels
        cfg.train.packing = packing
        results[packing] = planner.plan(cfg, "v5e:2x2", prompt_length=PROMPT, steps=("score", "actor"), log=print)
    padded, packed = results[False], results[True]
    assert all(step.error is None for result in results.values() for step in result.steps)
    for name in ("score", "actor"):
        (rows, efficiency, real) = packed.learner_rows[name]
        (padded_rows, padded_efficiency, padded_real) = padded.learner_rows[name]
        assert rows < padded_rows and efficiency > padded_efficiency and real > padded_real
        padded_flops, packed_flops = (
            next(s.cost.flops for s in result.steps if s.step == name) for result in (padded, packed)
        )
        assert packed_flops < 0.8 * padded_flops, name
    learner, real = planner.learner_against_real_tokens(packed)
    padded_learner, padded_real = planner.learner_against_real_tokens(padded)
    assert real == pytest.approx(padded_real, rel=0.05)  # the same tokens, whichever layout computes them
    assert learner < padded_learner and learner / real < padded_learner / padded_real
    assert "real tokens alone" in planner.format_summary(packed)


@pytest.mark.slow
def test_a_multi_turn_sampler_keeps_its_engine_state_between_turns_and_answers_each_extra_turn():
    """rollout.environment: the sampler's first round leaves the engine state (the page pool with it) on device,
    and the host's answer (`resume`), compiled with that state donated, runs max_turns - 1 times a step."""
    require_libtpu()
    cfg = tiny_config()
    cfg.rollout.update(environment="calculator", max_turns=4)
    result = planner.plan(cfg, "v5e:2x2", prompt_length=PROMPT, steps=("sample", "resume"), log=lambda message: None)
    sample, resume = result.steps
    assert (sample.step, resume.step, sample.error, resume.error) == ("sample", "resume", None, None)
    assert result.runs["resume"] == 3
    assert sample.outputs >= result.page_pool  # the state stays: its pool is an output, not a temporary
    assert resume.arguments == pytest.approx(sample.outputs, rel=0.01)
    assert resume.outputs < 0.01 * resume.arguments  # donated: written in place
    times = {t.program: t for t in planner.step_times(result)}
    assert times["resume"].runs == 3 and times["sample decode"].runs == 1
    # Each of the four rounds may run as long as a one-turn loop: the cost model takes that worst case.
    cfg.rollout.environment = ""
    single = planner.plan(cfg, "v5e:2x2", prompt_length=PROMPT, steps=("sample",), log=lambda message: None)
    one_turn = {t.program: t for t in planner.step_times(single)}["sample decode"]
    assert times["sample decode"].seconds == pytest.approx(4 * one_turn.seconds, rel=0.05)
