"""Bounded staleness: which policy generates each batch, checkpoints of the batches in flight, and
runs at staleness 1 and 2 that resume bitwise."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import WALL_CLOCK, assert_same_checkpoint_state, fake_devices_env, small_train_config

from comppo_jax.train import loop
from comppo_jax.train.staleness import RolloutQueue, generating_version


def test_batch_n_is_generated_after_update_max_0_n_minus_1_minus_k():
    assert [generating_version(n, 0) for n in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [generating_version(n, 1) for n in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [generating_version(n, 2) for n in range(1, 6)] == [0, 0, 0, 1, 2]


class FakeStage:
    """Records what the queue asks of the rollout stage: a policy is the actor's version as a string."""

    def __init__(self):
        self.calls, self.next_prompt = [], 0

    def start(self, step, policy, version, key, prompts=None):
        if prompts is None:
            prompts, self.next_prompt = [self.next_prompt], self.next_prompt + 1
        self.calls.append(("start", step, policy, version))
        return SimpleNamespace(step=step, policy=policy, version=version, prompts=prompts)

    def finish(self, started, key, *, first):
        self.calls.append(("finish", started.step))
        return SimpleNamespace(
            step=started.step, version=started.version, policy=started.policy, prompts=started.prompts
        )


def run_queue(staleness, steps, last_step, queue=None):
    """Takes batches `steps`; the actor after update v is "v" (its snapshot "copy of v")."""
    queue = queue or RolloutQueue(
        FakeStage(), staleness, last_step, jax.random.PRNGKey(0), lambda actor: f"copy of {actor}"
    )
    taken = [queue.take(step, str(step - 1), first=step == steps[0]) for step in steps]
    return queue, taken


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_the_queue_starts_batch_n_with_that_policy_before_update_n_minus_k_and_finishes_it_at_step_n(staleness):
    queue, taken = run_queue(staleness, range(1, 7), last_step=6)
    assert [batch.version for batch in taken] == [generating_version(n, staleness) for n in range(1, 7)]
    # Staleness 0: the actor itself, started and finished in its own step (the synchronous loop).
    assert [batch.policy for batch in taken] == [
        str(v) if staleness == 0 else f"copy of {v}" for v in (b.version for b in taken)
    ]
    assert [batch.prompts for batch in taken] == [[n - 1] for n in range(1, 7)]  # the stream in batch order
    starts = [call for call in queue.stage.calls if call[0] == "start"]
    assert [call[1] for call in starts] == list(range(1, 7)) and not queue.pending  # none past the last step
    if staleness:  # batch n + k is started right after batch n is finished, before update n
        calls = queue.stage.calls
        for n in range(2, 7 - staleness):
            assert calls.index(("start", n + staleness, f"copy of {n - 1}", n - 1)) == calls.index(("finish", n)) + 1


@pytest.mark.parametrize("staleness", [1, 2])
def test_a_queue_restored_from_what_a_checkpoint_saves_continues_as_the_straight_one(staleness):
    _, straight = run_queue(staleness, range(1, 7), last_step=6)
    first, _ = run_queue(staleness, range(1, 4), last_step=6)
    state, meta = first.saved("3")
    assert len(state["behaviour"]) == staleness  # fixed by k: the checkpoint's structure does not change
    assert [entry["step"] for entry in meta["in_flight"]] == list(range(4, 4 + staleness))
    assert [entry["version"] for entry in meta["in_flight"]] == [
        generating_version(n, staleness) for n in range(4, 4 + staleness)
    ]
    stage = FakeStage()
    stage.next_prompt = first.stage.next_prompt  # the prompt stream's checkpointed position
    resumed = RolloutQueue(stage, staleness, 6, jax.random.PRNGKey(0), lambda actor: f"copy of {actor}")
    resumed.restore(json.loads(json.dumps(meta["in_flight"])), state["behaviour"])
    _, rest = run_queue(staleness, range(4, 7), last_step=6, queue=resumed)
    assert [vars(b) for b in rest] == [vars(b) for b in straight[3:]]
    # Near the end fewer batches are in flight; the saved policies are padded to k.
    last_state, last_meta = run_queue(staleness, range(1, 7), last_step=6)[0].saved("6")
    assert len(last_state["behaviour"]) == staleness and last_meta["in_flight"] == []


def metric_rows(run):
    return [
        {k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK}
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "staleness, settings",
    [
        (1, dict(rollout__dynamic_sampling=True, train__eval_every=2)),
        (2, dict(train__proximal="recompute", gate_refresh="epoch")),
    ],
)
def test_a_stale_run_resumed_from_a_mid_run_checkpoint_equals_the_straight_run_bitwise(tmp_path, staleness, settings):
    # Steps 1..5 (a critic warm-up step, then 4 actor updates), a checkpoint after each.
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    config = lambda run, **more: small_train_config(
        run, steps=4, rollout__staleness=staleness, checkpoint__keep_last=10, **settings, **more
    )
    loop.train(config(straight))
    rows = metric_rows(straight)
    assert [row["staleness"] for row in rows] == [min(staleness, n - 1) for n in range(1, 6)]
    if settings.get("train__proximal") == "recompute":
        # Batch 1 is on-policy: the proximal log-probs recompute the behaviour's (another program: rounding apart).
        assert rows[0]["importance_weight/max"] == pytest.approx(1.0, abs=1e-5)
        assert all(row["importance_weight/mean"] > 0 for row in rows)
    # The run as if it had stopped after step 2: checkpoints 3.. and the summary gone, then resumed.
    shutil.copytree(straight, resumed)
    for step in (3, 4, 5):
        shutil.rmtree(resumed / "checkpoints" / str(step))
    (resumed / "summary.json").unlink()
    loop.train(config(resumed, resume=True))
    assert metric_rows(resumed) == rows
    assert_same_checkpoint_state(straight, resumed, 5)


SEPARATE = dict(
    steps=3,
    rollout__prompts_per_step=4,
    train__minibatch_size=4,
    train__eval_every=2,
    mesh__data=2,
    mesh__fsdp=2,
    mesh__tensor=1,
    rollout__staleness=1,
    checkpoint__keep_last=10,
)


def launch(run, *, processes=1, devices=8, sigterm_after_rows=None, **overrides):
    """launch/train.py on `devices` fake CPU devices: one process, or `processes` x devices / processes
    (launch/local_cluster.py, rerun after a gloo timeout, optionally sent SIGTERM once metrics.jsonl
    has `sigterm_after_rows` rows)."""
    import signal

    from conftest import cluster_tail, launch_script, on_local_cluster, small_train_flags

    flags = small_train_flags(run, **{**SEPARATE, **overrides})
    if processes > 1:
        result = on_local_cluster(
            flags,
            processes=processes,
            devices_per_process=devices // processes,
            signal_after_rows=sigterm_after_rows,
            signum=signal.SIGTERM if sigterm_after_rows is not None else None,
            metrics=run / "metrics.jsonl",
        )
        assert result.returncode == 0, cluster_tail(result)
        return result.stdout
    assert sigterm_after_rows is None, "a signal is sent to multi-process runs only"
    result = launch_script("launch/train.py", *flags, env=fake_devices_env(devices))
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout + result.stderr


@pytest.mark.slow
def test_a_run_with_its_own_rollout_devices_resumed_mid_run_equals_the_straight_run_bitwise(tmp_path):
    # 8 devices: the rollout stage decodes on 4, the learner trains on the other 4 (data 2 x fsdp 2, which 8
    # devices would refuse).
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launch(straight, mesh__rollout_devices=4)
    shutil.copytree(straight, resumed)
    for step in (3, 4):
        shutil.rmtree(resumed / "checkpoints" / str(step))
    (resumed / "summary.json").unlink()
    launch(resumed, mesh__rollout_devices=4, resume=True)
    assert metric_rows(resumed) == metric_rows(straight) and [row["staleness"] for row in metric_rows(straight)] == [
        0,
        1,
        1,
        1,
    ]
    assert_same_checkpoint_state(straight, resumed, 4)


def one_and_two_processes(tmp_path, one_process: dict, two_processes: dict):
    """(one, two, layout): the run launched on one process and on two (`launch`'s extra arguments
    each), both on data 2 (across the processes) x tensor 2 from one warm start, whose logged rows
    are asserted equal, staleness 1 from the second step."""
    one, two = tmp_path / "one", tmp_path / "two"
    layout = dict(mesh__fsdp=1, mesh__tensor=2, warm_start__cache_dir=str(tmp_path / "warm_start"))
    launch(one, **one_process, **layout)
    launch(two, processes=2, **two_processes, **layout)
    assert metric_rows(one) == metric_rows(two) and [row["staleness"] for row in metric_rows(two)] == [0, 1, 1, 1]
    return one, two, layout


@pytest.mark.slow
def test_two_processes_with_their_own_rollout_devices_equal_one_process_and_resume_after_sigterm_bitwise(tmp_path):
    # 2 processes x 4 devices (2 rollout + 2 training each) against 1 process x 8 (4 + 4), from one
    # warm start (its own numerics depend on the process layout). Training on data 2 (across the
    # processes) x tensor 2 (within each), as on a pod: every all-reduce has two participants, so
    # gloo's order and the in-process order sum alike (a 4-way data x fsdp sum rounds differently).
    one, two, layout = one_and_two_processes(tmp_path, dict(mesh__rollout_devices=4), dict(mesh__rollout_devices=2))
    assert_same_checkpoint_state(one, two, 4)

    # The 2-process run stopped by SIGTERM once a step is logged (its batch in flight checkpointed), then resumed.
    stopped = tmp_path / "stopped"
    output = launch(stopped, processes=2, mesh__rollout_devices=2, sigterm_after_rows=1, **layout)
    assert "saved at" in output and not (stopped / "summary.json").exists(), output[-3000:]
    launch(stopped, processes=2, mesh__rollout_devices=2, resume=True, **layout)
    assert metric_rows(stopped) == metric_rows(two)
    assert_same_checkpoint_state(two, stopped, 4)


@pytest.mark.slow
def test_a_stale_batch_whose_importance_weights_are_not_finite_is_skipped_and_named(tmp_path, monkeypatch):
    from comppo_jax.train import learner
    from comppo_jax.train.guards import NonFiniteError

    stats = learner.policy_token_stats

    def poisoned(*args, **kwargs):  # the proximal pass only: NaN log-probs on the first row
        log_probs, entropy = stats(*args, **kwargs)
        return log_probs.at[0].set(np.nan), entropy

    monkeypatch.setattr(learner, "policy_token_stats", poisoned)
    config = small_train_config(
        tmp_path, steps=4, rollout__staleness=1, train__proximal="recompute", train__max_skipped_updates=2
    )
    with pytest.raises(
        NonFiniteError, match=r"step 2: 2 consecutive updates skipped for non-finite values, last in importance weights"
    ):
        loop.train(config)
    rows = metric_rows(tmp_path)
    assert [row["nonfinite"].split(",")[0] for row in rows] == ["importance weights"] * 2 and [
        row["skipped_updates"] for row in rows
    ] == [1, 2]


def test_a_multi_process_split_into_unequal_halves_is_refused_before_anything_loads(tmp_path, monkeypatch):
    from comppo_jax.models import ConfigError
    from comppo_jax.sharding import make_mesh
    from comppo_jax.train import decode_layout

    config = small_train_config(tmp_path, mesh__rollout_devices=1)
    mesh = make_mesh(config.mesh)  # 1 training device here; 2 rollout devices below
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(
        ConfigError, match=r"a multi-process run needs as many rollout devices as training devices \(2 vs 1\)"
    ):
        decode_layout.check_config(config, mesh, [jax.devices()[0]] * 2)


@pytest.mark.slow
def test_two_processes_sharing_their_devices_at_staleness_1_take_turns_and_equal_one_process(tmp_path):
    # On shared devices the generation runs before the update is dispatched: XLA:CPU may run two
    # independent programs in either order, and two processes ordering their collectives
    # differently deadlock (a gloo timeout without the wait).
    # 4 devices: data 2 (across the processes) x tensor 2 (within each).
    one_and_two_processes(tmp_path, dict(devices=4), dict(devices=4))


@pytest.mark.parametrize("separate", [False, True])
def test_on_shared_devices_a_started_generation_is_computed_before_start_returns(tmp_path, monkeypatch, separate):
    """The wait that keeps two processes' collectives in one order (the slow test above shows the
    run; this one fails at once when the wait is removed). On its own devices it is only dispatched."""
    import jax.numpy as jnp

    from comppo_jax.sharding import make_mesh
    from comppo_jax.train import rollout_stage

    cfg = small_train_config(tmp_path)
    slow = jax.jit(lambda x: jax.lax.fori_loop(0, 400, lambda i, y: jnp.tanh(y @ y), x))  # about a second here
    monkeypatch.setattr(rollout_stage, "generate", lambda *args, **kwargs: slow(jnp.ones((384, 384)) / 384))
    monkeypatch.setattr(
        rollout_stage, "encode_prompts", lambda tokenizer, chosen: (np.zeros((1, 1), np.int32), np.ones((1, 1), bool))
    )
    decode = SimpleNamespace(
        reshard=lambda params: params, replicated=lambda key: key, mesh=make_mesh(cfg.mesh), separate=separate
    )
    stage = rollout_stage.RolloutStage(
        cfg,
        decode.mesh,
        None,
        SimpleNamespace(eos_token_id=2, pad_token_id=0),
        ([None] * 8, []),
        None,
        decode,
        lambda: None,
        None,
        None,
        prompt_position=(0, 0),
        stop=None,
        compiling=lambda what: None,
        show_progress=False,
    )
    slow(jnp.ones((384, 384))).block_until_ready()  # compiled before the timed call
    started = stage.start(1, {}, 0, jax.random.PRNGKey(0))
    assert started.generation.is_ready() != separate
