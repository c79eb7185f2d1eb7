"""The rollout's decode layout (comppo_jax.train.decode_layout): its floor, how auto chooses, that
every layout samples what the training mesh does (8 fake CPU devices; 2 processes x 4; a train run
through the loop), and what the TPU compiler makes of it at Qwen3-4B's dims and 16K tokens."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from conftest import (
    WALL_CLOCK,
    cluster_tail,
    fake_devices_env,
    launch_script,
    on_local_cluster,
    require_libtpu,
    small_train_config,
    small_train_flags,
)

from comppo_jax import sharding
from comppo_jax.costs import chips, decode_floor
from comppo_jax.models import ConfigError, preset_model_config
from comppo_jax.models.loading import PRESET_DIR, load_config_file
from comppo_jax.planning import planner
from comppo_jax.train import decode_layout
from comppo_jax.train.validation import validate_config

QWEN3_4B = preset_model_config("qwen3_4b")
# The preset rollout: 4 prompts x 4 responses of 16K tokens after 512-token prompts, one slot per row.
PRESET_ROLLOUT = dict(
    num_prompts=4, samples=4, prompt_length=512, max_new_tokens=16384, page_size=64, decode_slots=None
)


def test_floor_is_the_weight_and_kv_share_read_per_token_step_plus_the_groups_latency():
    floor = decode_floor.decode_floor(QWEN3_4B, chips.CHIPS["v5p"], devices=8, tensor=4, **PRESET_ROLLOUT)
    c = QWEN3_4B
    weights = 2 * (
        c.num_layers
        * (
            c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
            + 3 * c.hidden_size * c.intermediate_size
        )
        + c.vocab_size * c.hidden_size
    )  # tied head, bf16
    norms = 2 * (c.num_layers * (2 * c.hidden_size + 2 * c.head_dim) + c.hidden_size)  # replicated
    assert floor.weight_bytes == pytest.approx(weights / 4 + norms)
    rows_per_replica, kv_heads_per_chip = 16 // 2, 8 // 4
    kv = rows_per_replica * (512 + 16384 / 2) * c.num_layers * 2 * kv_heads_per_chip * c.head_dim * 2
    assert floor.kv_bytes == pytest.approx(kv)
    assert (
        floor.collective_hops == (2 * c.num_layers + 1) * 2 * 3 + 3
    )  # ring all-reduces per layer and the embedding's, the logits' gather
    chip = chips.CHIPS["v5p"]
    assert floor.step_seconds == pytest.approx(
        (weights / 4 + norms + kv) / chip.hbm_bytes + floor.collective_hops * chip.hop_latency
    )
    assert floor.steps == 16384 and floor.seconds == pytest.approx(16384 * floor.step_seconds)
    # One chip per group: every chip reads all the weights, no collectives.
    alone = decode_floor.decode_floor(QWEN3_4B, chip, devices=8, tensor=1, **PRESET_ROLLOUT)
    assert alone.collective_hops == 0 and alone.weight_bytes == pytest.approx(weights + norms)


def test_8bit_pages_and_weights_lower_the_floor_by_the_bytes_they_save():
    chip = chips.CHIPS["v5p"]
    full = decode_floor.decode_floor(QWEN3_4B, chip, devices=8, tensor=4, **PRESET_ROLLOUT)
    pages = decode_floor.decode_floor(QWEN3_4B, chip, devices=8, tensor=4, kv_dtype="int8", **PRESET_ROLLOUT)
    both = decode_floor.decode_floor(
        QWEN3_4B, chip, devices=8, tensor=4, kv_dtype="int8", weight_dtype="int8", **PRESET_ROLLOUT
    )
    hd = QWEN3_4B.head_dim
    # A position's key or value in one kv head: hd bytes and a float32 scale, against 2 hd bytes.
    assert pages.kv_bytes == pytest.approx(full.kv_bytes * (hd + 4) / (2 * hd))
    assert pages.weight_bytes == full.weight_bytes
    # A byte per weight (and a float32 scale per output channel, under 1% more) against two.
    assert full.weight_bytes / 2 < both.weight_bytes < 1.01 * full.weight_bytes / 2
    assert both.step_seconds < pages.step_seconds < full.step_seconds
    assert both.memory_bytes < pages.memory_bytes < full.memory_bytes


def test_the_sampler_gets_8bit_weights_and_evaluations_the_compute_copy(tmp_path):
    """rollout.weight_dtype through the specs the loop resolves into the decode layout's programs:
    the sampler decodes with int8 matrices, evaluations (and the scoring pass, from the actor)
    read the compute dtype."""
    from comppo_jax.models import init_params, model_config
    from comppo_jax.train.specs import resolve

    cfg = small_train_config(tmp_path, rollout__kv_dtype="int8", rollout__weight_dtype="int8")
    config = model_config(cfg.model)
    spec = resolve(cfg, config)
    assert spec.rollout.experience.rollout.sampling_options()["kv_dtype"] == "int8"
    actor = init_params(config, jax.random.PRNGKey(0))
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    layout = decode_layout.for_run(spec.rollout, mesh, config, actor)
    sampler, evaluation = layout.reshard(actor), layout.evaluation_weights(actor)
    assert sampler["layers"]["q_proj"].dtype == np.int8 and "q_proj_scale" in sampler["layers"]
    assert jax.tree.structure(evaluation) == jax.tree.structure(actor)
    assert {leaf.dtype for leaf in jax.tree.leaves(evaluation)} == {np.dtype(config.dtype)}
    # The default keeps one copy: the actor in the compute dtype.
    plain = decode_layout.for_run(resolve(small_train_config(tmp_path), config).rollout, mesh, config, actor)
    assert plain.compute_reshard is None and plain.evaluation_weights is plain.reshard


def test_group_sizes_follow_the_heads_and_kv_heads_share_each_chips_pages():
    assert decode_floor.decode_group_sizes(QWEN3_4B, 8) == [1, 2, 4, 8]
    assert decode_floor.decode_group_sizes(QWEN3_4B, 64) == [
        1,
        2,
        4,
        8,
        16,
        32,
    ]  # 32 query heads; 16 and 32 repeat the 8 kv heads
    assert decode_floor.decode_group_sizes(dataclasses.replace(QWEN3_4B, num_heads=12, num_kv_heads=4), 16) == [1, 2, 4]
    assert [decode_floor.pool_heads_per_chip(QWEN3_4B, g) for g in (1, 2, 8, 16, 32)] == [8, 4, 1, 1, 1]


def test_auto_takes_the_fastest_layout_that_fits():
    candidates = decode_floor.floors(QWEN3_4B, chips.CHIPS["v5p"], 8, **PRESET_ROLLOUT)
    fastest = decode_floor.fastest(candidates, budget=None)
    assert fastest.seconds == min(c.seconds for c in candidates)
    # Without room for the fastest's weights and pages, the fastest of those that fit.
    budget = fastest.memory_bytes - 1
    fitting = [c for c in candidates if c.memory_bytes <= budget]
    assert fitting and decode_floor.fastest(candidates, budget).tensor == min(fitting, key=lambda c: c.seconds).tensor
    # Nothing fits: the layout that holds the least.
    assert decode_floor.fastest(candidates, budget=1).tensor == min(candidates, key=lambda c: c.memory_bytes).tensor


def test_rollout_mesh_tensor_is_validated_by_name(tmp_path):
    assert [decode_layout.parse_tensor(v) for v in ("auto", "train", "4", 2)] == ["auto", "train", 4, 2]
    cfg = small_train_config(tmp_path, rollout__mesh__tensor="four")
    with pytest.raises(ConfigError, match=r"rollout\.mesh\.tensor='four'.*auto, train or a positive number"):
        validate_config(cfg)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    shapes = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, "float32"), {"w": (4, 4)}, is_leaf=lambda x: isinstance(x, tuple)
    )
    with pytest.raises(ConfigError, match=r"rollout\.mesh\.tensor=3: .* here: 1 \(or auto, train\)"):
        decode_layout.make_decode_layout("3", mesh, QWEN3_4B, shapes, target=(None, None), rollout=PRESET_ROLLOUT)


def run_payload(script, *args, env) -> str:
    result = launch_script(script, *args, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stdout


@pytest.mark.slow
def test_every_layout_samples_as_the_training_mesh_on_eight_devices():
    env = fake_devices_env(8)
    assert "decode layouts ok" in run_payload("tests/rollout/decode_layouts.py", env=env)


@pytest.mark.slow
def test_every_layout_samples_as_the_training_mesh_on_two_processes():
    result = on_local_cluster([], script="tests/rollout/decode_layouts.py")
    assert result.returncode == 0 and result.stdout.count("decode layouts ok") == 2, cluster_tail(result)


@pytest.mark.slow
def test_a_run_decoding_in_its_own_layout_logs_what_the_training_mesh_run_logs(tmp_path):
    """rollout.mesh.tensor through train(): auto (on a CPU the mesh's tensor axis, 2 of the 4 devices,
    replicated twice) against decoding on the training mesh (fsdp 2 x tensor 2)."""
    env = fake_devices_env(4)
    rows = {}
    for layout in ("auto", "train"):
        run_dir = tmp_path / layout
        run_payload(
            "launch/train.py",
            *small_train_flags(run_dir, mesh__data=1, mesh__fsdp=2, mesh__tensor=2, rollout__mesh__tensor=layout),
            env=env,
        )
        rows[layout] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows["auto"]) == len(rows["train"]) >= 2
    for auto, train in zip(rows["auto"], rows["train"]):
        assert auto.keys() == train.keys()
        for name in auto:
            if name in WALL_CLOCK or isinstance(auto[name], (str, dict, list)):
                continue
            assert auto[name] == pytest.approx(train[name], rel=1e-4, abs=1e-5), name


# --- the TPU compiler's view (libtpu, ahead of time, as launch/plan.py) -------------------------


def plan_sampler(topology: str, tensor: str):
    """launch/plan.py's reshard and sample programs of configs/qwen3_4b.py at 16K in the decode
    layout `tensor`: 4 of its 36 layers (each layer compiles alike, and what is checked is per layer or
    against a floor of as many layers)."""
    require_libtpu()
    cfg = load_config_file(PRESET_DIR / "qwen3_4b.py")
    cfg.model.arch.num_layers = 4
    cfg.rollout.mesh.tensor = tensor
    return cfg, planner.plan(cfg, topology, prompt_length=512, steps=planner.SAMPLER_STEPS, log=lambda message: None)


def gathered_per_token_step(result) -> float:
    """All-gather bytes one chip receives per decode step, from the compiled sampler's HLO."""
    sampler = next(s for s in result.steps if s.step == "sample")
    return sampler.parts["decode"].collectives.get("all-gather", 0.0) / result.decode.floor.steps


@pytest.mark.slow
@pytest.mark.parametrize(
    "topology, group, against_training_mesh", [("v5p:2x2x2", "4", True), ("v5e:2x2", "auto", False)]
)
def test_tpu_decode_loop_gathers_no_weights_and_reads_near_its_floor(topology, group, against_training_mesh):
    cfg, decoded = plan_sampler(topology, group)
    assert decoded.decode.resharded
    weights = decoded.decode.floor.weight_bytes
    c, tensor = QWEN3_4B, decoded.decode.tensor
    layer = (
        2
        * (
            c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
            + 3 * c.hidden_size * c.intermediate_size
        )
        / tensor
    )
    if against_training_mesh:
        # The training mesh gathers every layer's fsdp-split weights at every token: the guard this layout
        # removes (once: a TPU compile of the sampler is ~70 s of CPU here).
        trained = planner.with_decode_layout(cfg, decoded, "train", prompt_length=512, log=lambda message: None)
        assert not trained.decode.resharded
        assert gathered_per_token_step(trained) > 0.5 * weights
    # What the decode loop gathers is at most the sampled logits (rows x vocabulary, float32), far below one
    # layer's weights.
    logits = 16 // decoded.decode.floor.replicas * c.vocab_size * 4
    assert gathered_per_token_step(decoded) <= logits < 0.25 * layer
    sampler = next(s for s in decoded.steps if s.step == "sample")
    per_layer = [
        x
        for x in sampler.decode_collectives
        if x.kind == "all-reduce"
        and x.group == tensor
        and x.bytes == 16 // (decoded.chips // tensor) * c.hidden_size * 2
    ]  # one token per row, bf16
    assert len(per_layer) >= 2  # the attention output's and the MLP's row-parallel projections
    assert max(x.bytes for x in sampler.decode_collectives if x.kind == "all-gather") <= logits
    # Predicted from the compiled decode loop, within 1.5x of the floor; the resharding program moves the weights once.
    times = {t.program: t.seconds for t in planner.step_times(decoded)}
    assert times["sample decode"] < 1.5 * decoded.decode.floor.seconds
    reshard = next(s for s in decoded.steps if s.step == "reshard")
    assert reshard.cost.collective_bytes > 0 and reshard.error is None
    assert np.isfinite(times["reshard"]) and times["reshard"] < 0.01 * times["sample decode"]
