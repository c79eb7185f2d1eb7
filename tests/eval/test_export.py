"""Exporting LoRA adapters and merged weights: PEFT loads the adapters on a transformers Qwen3 and
Llama and computes our logits, transformers loads the merged weights, and launch/export.py takes
a LoRA run's directory to both (and refuses `peft` for a full fine-tuning run)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import launch_script, right_padded_batch, small_train_flags

from comppo_jax.models import forward, from_hf, lora, to_hf
from comppo_jax.models.hf import to_peft

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def hf_logits(model, tokens, mask):
    with torch.no_grad():
        return model(
            torch.from_numpy(tokens.astype(np.int64)), attention_mask=torch.from_numpy(mask.astype(np.int64))
        ).logits.numpy()


def our_logits(params, config, tokens, mask):
    return np.asarray(forward(params, config, jnp.asarray(tokens), jnp.asarray(mask)).logits)


def trained(config, spec, seed=1):
    """Adapters with B far from zero (as after training), so a wrong name or transpose shows."""
    adapters = lora.init_adapters(config, spec, jax.random.PRNGKey(seed))
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 100))
    return {
        "layers": {
            name: 0.2 * jax.random.normal(next(keys), x.shape) if name.endswith("_lora_b") else x
            for name, x in adapters["layers"].items()
        }
    }


@pytest.mark.parametrize("architecture,targets", [("qwen3", tuple(lora.TARGETS)), ("llama", ("q", "v", "down"))])
def test_peft_loads_our_adapters_and_the_merged_export_loads_in_transformers(
    hf_checkpoint, tmp_path, architecture, targets
):
    path, _ = hf_checkpoint(architecture, architecture == "qwen3")
    config, base = from_hf(path)
    config = config.replace(lora_alpha=8.0)
    adapted = lora.join(base, trained(config, lora.LoraConfig(rank=4, alpha=8.0, targets=targets)))
    tokens, mask = right_padded_batch()
    ours = our_logits(adapted, config, tokens, mask)
    assert np.abs(ours - our_logits(base, config, tokens, mask))[mask].max() > 0.1  # the adapters matter

    to_peft(config, lora.trainable(adapted), str(tmp_path / "adapters"), base_model=path)
    saved = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["lora_alpha"] == 8.0 and saved["base_model_name_or_path"] == path
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager"), str(tmp_path / "adapters")
    ).eval()
    np.testing.assert_allclose(hf_logits(model, tokens, mask)[mask], ours[mask], atol=1e-4, rtol=1e-4)

    to_hf(config, lora.merged(adapted, config), str(tmp_path / "merged"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged"), attn_implementation="eager"
    ).eval()
    np.testing.assert_allclose(hf_logits(merged, tokens, mask)[mask], ours[mask], atol=1e-4, rtol=1e-4)


def export(*args):
    return launch_script("launch/export.py", *args)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny warm-started CompPO run with rank-4 adapters on q and v (its base is its own)."""
    run = tmp_path_factory.mktemp("lora_run")
    result = launch_script(
        "launch/train.py",
        *small_train_flags(run, model__lora__rank=4, model__lora__targets="q,v", train__actor_lr=1e-2),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run


@pytest.mark.slow
def test_a_lora_run_exports_to_peft_with_its_own_base_and_to_merged_hf_weights(lora_run, tmp_path):
    from comppo_jax.eval.restore import restore_policy

    restored = restore_policy(str(lora_run), step="latest")
    config = restored.model_config
    assert set(lora.trainable(restored.params)["layers"]) == {
        "q_proj_lora_a",
        "q_proj_lora_b",
        "v_proj_lora_a",
        "v_proj_lora_b",
    }
    tokens, mask = right_padded_batch(vocab=config.vocab_size)
    ours = our_logits(restored.params, config, tokens, mask)
    assert (
        np.abs(ours - our_logits(lora.base(restored.params), config, tokens, mask))[mask].max() > 1e-3
    )  # the run moved the adapters

    peft_out, hf_out = tmp_path / "peft", tmp_path / "hf"
    result = export(f"--run={lora_run}", "--step=latest", f"--out={peft_out}", "--format=peft")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the base the adapters were trained on" in result.stdout
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(peft_out / "base"), attn_implementation="eager", dtype=torch.float32
    )
    model = peft.PeftModel.from_pretrained(base, str(peft_out)).eval()
    np.testing.assert_allclose(hf_logits(model, tokens, mask)[mask], ours[mask], atol=1e-4, rtol=1e-4)

    result = export(f"--run={lora_run}", "--step=latest", f"--out={hf_out}")
    assert result.returncode == 0, result.stderr[-3000:]
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_out), attn_implementation="eager", dtype=torch.float32
    ).eval()
    np.testing.assert_allclose(hf_logits(merged, tokens, mask)[mask], ours[mask], atol=1e-4, rtol=1e-4)

    result = export(f"--run={lora_run}", f"--out={hf_out}")  # not empty now: nothing is overwritten
    assert result.returncode != 0 and "exists and is not empty" in result.stderr


@pytest.mark.slow
def test_a_full_fine_tuning_run_exports_hf_and_says_why_not_peft(tmp_path):
    run = tmp_path / "full"
    result = launch_script("launch/train.py", *small_train_flags(run, steps=1, train__critic_warmup_steps=0))
    assert result.returncode == 0, result.stderr[-3000:]
    result = export(f"--run={run}", f"--out={tmp_path / 'peft'}", "--format=peft")
    assert result.returncode != 0 and "full fine-tuning run" in result.stderr and "--format=hf" in result.stderr
    assert not (tmp_path / "peft").exists()
    result = export(f"--run={run}", f"--out={tmp_path / 'hf'}")
    assert result.returncode == 0, result.stderr[-3000:]
    config, params = from_hf(str(tmp_path / "hf"))
    assert not lora.has_adapters(params) and config.num_layers == 4
