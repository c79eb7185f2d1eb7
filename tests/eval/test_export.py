"""Exporting LoRA adapters and merged weights: PEFT loads the adapters on a transformers Qwen3 and
Llama and computes our logits, transformers loads the merged weights, and launch/export.py takes
a LoRA run's directory to both (and refuses `peft` for a full fine-tuning run). `--out` gets a
whole export or nothing: two exports to one folder at once, SIGTERM part way, a full disk."""

from __future__ import annotations

import json
import os
import pathlib
import stat
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import full_disk, launch_quick, launch_script, right_padded_batch, small_train_flags

from comppo_jax import storage
from comppo_jax.eval import export as export_module
from comppo_jax.models import forward, from_hf, lora, to_hf
from comppo_jax.models.hf import to_peft


def hf_libraries():
    """(torch, transformers, peft), imported by the tests that use them: not at collection, where every
    worker would pay for them."""
    import torch

    return torch, pytest.importorskip("transformers"), pytest.importorskip("peft")


def hf_logits(model, tokens, mask):
    torch, _, _ = hf_libraries()
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

    _, transformers, peft = hf_libraries()
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


def export(*args, fresh=False):
    return launch_script("launch/export.py", *args, fresh=fresh)


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
    torch, transformers, peft = hf_libraries()
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


def beside(out) -> list[str]:
    """What the folder holding `out` holds (an export's partial folder would show here)."""
    return sorted(os.listdir(out.parent))


@pytest.mark.slow
def test_two_exports_to_one_folder_at_once_one_succeeds_and_the_folder_holds_it_whole(lora_run, tmp_path):
    out = tmp_path / "exported"
    with ThreadPoolExecutor(2) as pool:  # both processes start together (fresh interpreters): both find `out` new
        results = list(
            pool.map(lambda step: export(f"--run={lora_run}", f"--step={step}", f"--out={out}", fresh=True), (2, 3))
        )
    assert sorted(result.returncode for result in results) == [0, 1], [result.stderr[-2000:] for result in results]
    (winner, step), (loser, _) = sorted(zip(results, (2, 3)), key=lambda pair: pair[0].returncode)
    assert winner.stdout.startswith(f"step {step} of ")
    error = loser.stderr.splitlines()[0]
    assert f"{out} is no longer new or empty" in error or f"{out} exists and is not empty" in error, loser.stderr
    assert beside(out) == ["exported"] and sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    for path in (out, out / "model.safetensors"):  # safetensors writes 0600: a server as another user reads it
        assert path.stat().st_mode & 0o044 == (out / "config.json").stat().st_mode & 0o044, path

    from comppo_jax.eval.restore import restore_policy

    _, exported = from_hf(str(out))
    for saved in (2, 3):
        restored = restore_policy(str(lora_run), step=saved)
        merged = lora.merged(restored.params, restored.model_config)
        same = jax.tree.all(jax.tree.map(lambda a, b: np.allclose(a, b, atol=1e-6), exported, merged))
        assert same == (saved == step), f"step {saved}"  # the winner's weights, not the other's


def test_of_two_exports_put_in_place_at_once_one_gets_the_folder_and_the_other_leaves_nothing(tmp_path):
    out = tmp_path / "exported"
    out.mkdir()  # an empty folder is taken as a new one is
    both_written = threading.Barrier(2)

    def put_in_place(name: str) -> Exception | None:
        try:
            with (
                export_module._StopSignals() as signals,
                export_module._export_folder(str(out), signals, name) as folder,
            ):
                written = pathlib.Path(folder) / "config.json"
                written.write_text(name)
                written.chmod(0o600)  # as safetensors writes its files
                both_written.wait()
        except FileExistsError as error:
            return error
        return None

    with ThreadPoolExecutor(2) as pool:
        errors = dict(zip(("a", "b"), pool.map(put_in_place, ("a", "b"))))
    (winner,) = [name for name, error in errors.items() if error is None]
    (error,) = [error for error in errors.values() if error is not None]
    assert str(error).startswith(f"{out} is no longer new or empty: another export")
    assert os.listdir(tmp_path) == ["exported"] and os.listdir(out) == ["config.json"]
    assert (out / "config.json").read_text() == winner
    # Readable by a server running as another user, as a new file and folder are under the umask.
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((out / "config.json").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask


def exporter_stopped_while_writing_the_base(tmp_path) -> str:
    """A script that runs launch/export.py (with its arguments) and sends itself SIGTERM when the
    adapters are written and the base is next: a stop that on a plain write left adapters naming a
    base that is not there."""
    driver = tmp_path / "stopped_export.py"
    driver.write_text(
        textwrap.dedent(
            """
            import os, runpy, signal, sys
            import comppo_jax.eval.export as export

            write = export.to_hf

            def stopped(config, params, path, *args, **kwargs):
                os.kill(os.getpid(), signal.SIGTERM)
                return write(config, params, path, *args, **kwargs)

            export.to_hf = stopped
            sys.argv[0] = "launch/export.py"
            runpy.run_path("launch/export.py", run_name="__main__")
            """
        )
    )
    return str(driver)


@pytest.mark.slow
def test_sigterm_part_way_through_a_peft_export_leaves_nothing_and_says_so(lora_run, tmp_path):
    out = tmp_path / "adapters"
    flags = (f"--run={lora_run}", "--step=3", f"--out={out}", "--format=peft")
    result = launch_script(exporter_stopped_while_writing_the_base(tmp_path), *flags)
    assert result.returncode != 0 and result.stderr.splitlines()[0] == (
        f"error: ExportError: SIGTERM received: the export was stopped; nothing was written to {out}"
    ), result.stderr[-3000:]
    assert beside(out) == ["stopped_export.py"]  # no `out`, no partial folder beside it

    result = export(*flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors", "base"]


@pytest.mark.slow
def test_a_full_disk_during_an_export_names_out_and_the_cause_leaves_nothing_and_a_rerun_succeeds(lora_run, tmp_path):
    out = tmp_path / "adapters"
    flags = (f"--run={lora_run}", f"--out={out}", "--format=peft")
    with full_disk(free_bytes=500_000):  # the adapters fit, the 3 MB base does not
        result = export("--step=3", *flags)
    assert result.returncode != 0, result.stdout
    error = result.stderr.splitlines()[0]
    assert error.startswith(f"error: ExportError: export to {out} failed: ") and "File too large" in error, error
    assert error.endswith(f"nothing was written to {out}")
    assert beside(out) == []

    result = export("--step=last", *flags)  # the word other tools may use for latest
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("step 3 of ") and (out / "base" / "model.safetensors").exists()


@pytest.mark.slow
def test_a_step_that_names_no_checkpoint_lists_the_accepted_words(lora_run, tmp_path):
    result = export(f"--run={lora_run}", "--step=newest", f"--out={tmp_path / 'out'}")
    assert result.returncode != 0 and result.stderr.splitlines()[0] == (
        f"error: ValueError: step 'newest' is none of latest (or last), best or a saved step number; saved steps "
        f"under {lora_run}/checkpoints: [2, 3]"
    )


def test_an_out_that_is_a_file_is_refused_before_anything_is_read(tmp_path):
    out = tmp_path / "exported"
    out.write_text("not a folder")
    result = launch_quick("launch/export.py", f"--run={tmp_path / 'not_read'}", f"--out={out}")
    assert result.returncode != 0 and result.stderr.splitlines()[0] == (
        f"error: FileExistsError: {out} is a file: --out names the folder to export into (new or empty)"
    )


def test_on_a_bucket_an_export_claims_out_and_a_failed_one_leaves_nothing(bucket):
    out = storage.join(bucket, "exported")
    with export_module._StopSignals() as signals, export_module._export_folder(out, signals, "step 2 of A") as folder:
        (pathlib.Path(folder) / "config.json").write_text("{}")
        with pytest.raises(FileExistsError, match=r"exported is taken by another export \(step 2 of A, pid "):
            with export_module._export_folder(out, signals, "step 3 of B"):
                pass
        assert storage.names(out) == [export_module.CLAIM]  # what a reader sees until the upload ends
    assert storage.names(out) == ["config.json"]

    failed = storage.join(bucket, "failed")
    with pytest.raises(export_module.ExportError, match=f"export to {failed} failed: OSError: no space"):
        with export_module._StopSignals() as signals, export_module._export_folder(failed, signals, "step 2") as folder:
            (pathlib.Path(folder) / "config.json").write_text("{}")
            raise OSError("no space")
    assert storage.names(failed) == []
