"""Sampled responses kept with their per-token credit (comppo_jax.train.samples): which steps and
rows, what each array holds (checked against the estimators it comes from), the size bound, and
files that round-trip and, damaged, are named rather than fatal."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import small_train_config, stand_in_batch

from comppo_jax.credit import comp_gae, gae, retention_gate
from comppo_jax.data.tokenizers import CharTokenizer
from comppo_jax.models import model_config
from comppo_jax.runs.samples import load_samples, sample_path, save_samples
from comppo_jax.train.samples import keeps_samples, kept_positions, kept_responses, kept_rows
from comppo_jax.train.specs import resolve


def recorder_spec(cfg):
    """What the recorder keeps responses by, resolved from `cfg` as the train loop resolves it."""
    return resolve(cfg, model_config(cfg.model)).recorder


def kept(tmp_path, method="comppo", gate="attention", **overrides):
    cfg = small_train_config(tmp_path, method=method, gate=gate, **overrides)
    spec = recorder_spec(cfg)
    sampled, scored = stand_in_batch(cfg, spec.credit.recipe)
    return cfg, sampled, scored, kept_responses(spec, CharTokenizer(), 7, sampled, scored)


def test_steps_rows_and_tokens_kept():
    outputs = lambda every, count=4: type("Outputs", (), dict(sample_every=every, samples_per_step=count))
    assert [s for s in range(1, 7) if keeps_samples(outputs(0), s, evaluates=s % 3 == 0)] == [3, 6]
    assert [s for s in range(1, 7) if keeps_samples(outputs(2), s, evaluates=False)] == [2, 4, 6]
    assert [s for s in range(1, 6) if keeps_samples(outputs(0), s, evaluates=False, last=s == 5)] == [5]
    assert not any(keeps_samples(outputs(-1), s, True) or keeps_samples(outputs(1, 0), s, True) for s in range(5))
    assert kept_rows(16, 4).tolist() == [0, 5, 10, 15] and kept_rows(3, 4).tolist() == [0, 1, 2]
    assert kept_positions(5, 8).tolist() == [0, 1, 2, 3, 4]
    assert kept_positions(10, 4).tolist() == [0, 1, 8, 9] and kept_positions(10, 5).tolist() == [0, 1, 2, 8, 9]


def test_comppo_keeps_the_gate_its_statistics_values_and_both_advantages_as_the_estimators_give_them(tmp_path):
    cfg, sampled, scored, record = kept(tmp_path, outputs__samples_per_step=2)
    assert (record["step"], record["estimator"], record["gate"]) == (7, "comp_gae", "attention")
    assert [r["row"] for r in record["responses"]] == [0, 3]
    mask = sampled.host_mask
    comp, _ = comp_gae(sampled.reward_tokens, scored.batch.old_values, scored.kappa, mask, cfg.train.lam)
    standard, _ = gae(sampled.reward_tokens, scored.batch.old_values, mask, 1.0, cfg.train.lam)
    for response in record["responses"]:
        row, tokens, length = response["row"], response["tokens"], response["length"]
        assert set(tokens) == {"kappa", "H", "n", "c", "value", "comp_gae", "gae"}
        assert response["t"] == list(range(1, length + 1)) and length == mask[row].sum()
        assert "".join(response["pieces"]) == response["response"] == sampled.texts[row]
        np.testing.assert_allclose(tokens["kappa"], scored.rollout.kappa[row, :length], atol=1e-5)
        np.testing.assert_allclose(tokens["value"], scored.batch.old_values[row, :length], atol=1e-5)
        np.testing.assert_allclose(tokens["comp_gae"], comp[row, :length], atol=1e-5)
        np.testing.assert_allclose(tokens["gae"], standard[row, :length], atol=1e-5)
        # c_t is the concentration the gate came from (eq. kappa_attention inverted)
        np.testing.assert_allclose(retention_gate(np.asarray(tokens["c"], np.float32)), tokens["kappa"], atol=1e-4)
        assert tokens["n"] == scored.rollout.window_size[row, :length].tolist()
        assert response["verdict"] in ("correct", "incorrect") and response["prompt"] == f"prompt {row // 2}"
    assert record["kappa_range"] == pytest.approx([0.19536, 0.80464], abs=1e-4)


def test_a_control_keeps_the_gate_credit_read_ppo_the_comp_gae_it_did_not_use_and_grpo_its_own(tmp_path):
    _, sampled, scored, shuffled = kept(tmp_path, gate="shuffle")
    row = shuffled["responses"][1]
    length = row["length"]
    np.testing.assert_allclose(row["tokens"]["credit_kappa"], scored.kappa[row["row"], :length], atol=1e-5)
    assert not np.allclose(row["tokens"]["credit_kappa"], row["tokens"]["kappa"])
    cfg, sampled, scored, ppo = kept(tmp_path, method="ppo")
    assert ppo["estimator"] == "gae" and "credit_kappa" not in ppo["responses"][0]["tokens"]
    own, _ = comp_gae(sampled.reward_tokens, scored.batch.old_values, scored.rollout.kappa, sampled.host_mask, 0.95)
    np.testing.assert_allclose(ppo["responses"][0]["tokens"]["comp_gae"], own[0, :10], atol=1e-5)
    _, sampled, scored, grpo = kept(tmp_path, method="grpo")
    assert set(grpo["responses"][0]["tokens"]) == {"kappa", "H", "n", "c", "grpo"}
    np.testing.assert_allclose(grpo["responses"][0]["tokens"]["grpo"], scored.batch.advantages[0, :10], atol=1e-5)


def test_a_long_response_keeps_its_first_and_last_tokens_and_a_file_round_trips_with_null_for_nan(tmp_path):
    _, sampled, scored, record = kept(tmp_path, outputs__sample_tokens=4)
    first = record["responses"][0]
    assert first["t"] == [1, 2, 9, 10] and first["length"] == 10
    assert "".join(first["pieces"]) == sampled.texts[0][:2] + sampled.texts[0][-2:]
    assert record["responses"][-1]["t"] == [1, 2, 3]  # 3 tokens: all kept
    scored.batch.old_values[0, 1] = np.nan
    sampled.rewards[0] = np.nan  # a step the skipped-update guard catches
    record = kept_responses(recorder_spec(small_train_config(tmp_path)), CharTokenizer(), 9, sampled, scored)
    assert record["responses"][0]["tokens"]["value"][1] is None and record["responses"][0]["reward"] is None
    path = save_samples(str(tmp_path), record)
    assert path == sample_path(str(tmp_path), 9) and path.endswith("samples/step_000009.json")
    assert "NaN" not in open(path).read()
    (tmp_path / "samples" / "step_000003.json").write_text('{"step": 3, "respon')  # torn by a crash
    records, unreadable = load_samples(str(tmp_path))
    assert records == [json.loads(open(path).read())]
    assert len(unreadable) == 1 and "step_000003.json" in unreadable[0]


@pytest.mark.parametrize(
    "method, estimator, shown_beside",
    [("ppo", "vapo", "gae"), ("grpo", "ktae", None), ("grpo", "attention_anchor", None)],
)
def test_an_estimator_beyond_the_paper_keeps_the_advantages_it_gave_the_actor_and_the_run_page_reads_them(
    tmp_path, method, estimator, shown_beside
):
    from comppo_jax.eval.run_report import COMPARED, sample_problem

    _, _, scored, record = kept(tmp_path, method=method, credit__estimator=estimator)
    assert record["estimator"] == estimator and sample_problem(record) is None
    assert COMPARED[estimator] == shown_beside
    for response in record["responses"]:
        tokens, length = response["tokens"], response["length"]
        np.testing.assert_allclose(tokens[estimator], scored.batch.advantages[response["row"], :length], atol=1e-5)
        assert shown_beside is None or shown_beside in tokens
