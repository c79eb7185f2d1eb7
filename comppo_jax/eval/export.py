"""A training run's checkpoint as files other tools serve: Hugging Face weights or PEFT adapters.

    export_run("runs/tiny_lora", "best", "exported/", "hf")    # merged safetensors + config.json + tokenizer
    export_run("runs/tiny_lora", "best", "adapters/", "peft")  # adapter_config.json + adapter_model.safetensors

`hf` loads with `transformers.AutoModelForCausalLM.from_pretrained(out)` (and vLLM): a LoRA run's
adapters merged into its base, in the compute dtype. `peft` loads with
`peft.PeftModel.from_pretrained(base, out)`: the adapters alone, on the base named in
adapter_config.json. That is `model.path` when the run trained on it as loaded; a base the run
made itself (warm-started, or random) is written beside them under `out/base` in `hf` format, so
the adapters always come with the weights they were trained on. A full fine-tuning run has no
adapters and exports `hf` only.

The checkpoint is restored onto one device of this machine (verified against its digests; a LoRA
run's base against base.json), whatever mesh the run trained on.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from comppo_jax import hub, sharding, storage
from comppo_jax.data.tokenizers import load_tokenizer
from comppo_jax.eval.restore import restored_actor
from comppo_jax.models import ConfigError, lora, model_config, to_hf
from comppo_jax.models.hf import to_peft
from comppo_jax.models.lora import LoraConfig
from comppo_jax.train.checkpoint import RunCheckpoints
from comppo_jax.train.outputs import load_run_config
from comppo_jax.train.update import cast_params

FORMATS = ("hf", "peft")


def export_run(run_dir: str, step: str | int, out: str, format: str = "hf") -> list[str]:
    """Writes checkpoint `step` (latest, best or N) of the run in `run_dir` to `out` as `format`
    (module docstring); returns what it wrote, one line each."""
    if format not in FORMATS:
        raise ConfigError(f"--format={format!r}: expected one of {', '.join(FORMATS)}")
    cfg = load_run_config(run_dir)
    adapters = LoraConfig.of(cfg.model)
    if format == "peft" and not adapters.enabled:
        raise ConfigError(
            f"{run_dir} is a full fine-tuning run (model.lora.rank=0): it has no adapters to export as PEFT; "
            "export its weights with --format=hf"
        )
    if storage.names(out):
        raise FileExistsError(f"{out} exists and is not empty: choose another --out, or remove it")
    config = model_config(cfg.model)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.AXES)
    checkpoints = RunCheckpoints(run_dir, read_only=True)
    try:
        step = checkpoints.resolve_step(step)
        params = restored_actor(
            cfg, checkpoints, step, mesh, config
        )  # adapters in the master dtype on the compute-dtype base
    finally:
        checkpoints.close()
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    with storage.local_folder(out) as folder:  # safetensors and save_pretrained write local files
        return [f"step {step} of {run_dir}", *_write_export(cfg, config, params, tokenizer, format, out, folder)]


def _write_export(cfg, config, params, tokenizer, format: str, out: str, folder: str) -> list[str]:
    """Writes the export into the local `folder` (which becomes `out`); says what it wrote."""
    adapters = LoraConfig.of(cfg.model)
    written = []
    if format == "hf":
        to_hf(config, cast_params(lora.merged(params, config), config.dtype), folder)
        written.append(
            f"{out}: {'merged ' if adapters.enabled else ''}weights ({config.dtype}), config.json"
            + _tokenizer_files(tokenizer, folder)
        )
        return written
    own_base = (
        not cfg.model.path or cfg.warm_start.steps
    )  # the run made its base (warm start or random init): it goes along
    # where the adapters' base will be: the exported copy, else model.path as the run named it (a hub id stays one)
    base_model, revision = (str(storage.path(out) / "base"), None) if own_base else _as_named(cfg.model.path)
    to_peft(config, lora.trainable(params), folder, base_model=base_model, revision=revision)
    written.append(
        f"{out}: adapter_config.json, adapter_model.safetensors (rank {adapters.rank}, alpha {adapters.alpha}, "
        f"{', '.join(adapters.targets)})" + _tokenizer_files(tokenizer, folder)
    )
    if own_base:
        to_hf(config, lora.base(params), storage.join(folder, "base"))
        written.append(
            f"{base_model}: the base the adapters were trained on (the run's own, not model.path), weights and "
            f"config.json" + _tokenizer_files(tokenizer, storage.join(folder, "base"))
        )
    return written


def _as_named(model_path: str) -> tuple[str, str | None]:
    """(base_model_name_or_path, revision) of model.path as an adapter config names it: a local directory
    absolute, a hub id split from its pinned commit (PEFT takes the revision apart), a bucket path as is."""
    if hub.is_hub_id(model_path):
        return hub.split_hub_id(model_path)
    return (str(storage.path(model_path)) if os.path.exists(model_path) else model_path), None


def _tokenizer_files(tokenizer, out: str) -> str:
    """Saves a Hugging Face tokenizer's files into `out`; says what was written."""
    if not hasattr(tokenizer, "tokenizer"):
        return " (no tokenizer files: the run uses the character tokenizer, which Hugging Face does not know)"
    tokenizer.tokenizer.save_pretrained(out)
    return ", tokenizer files"
