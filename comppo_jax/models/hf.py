"""Hugging Face checkpoint import/export without torch: `config.json` + `*.safetensors`."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from comppo_jax.models.config import ConfigError, ModelConfig
from comppo_jax.models.transformer import param_shapes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# Buffers some exporters write that carry no parameters.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
_TOP_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, malformed or does not match the config."""


def tensor_layout(config: ModelConfig) -> Iterator[tuple[str, tuple[str, ...], int | None, tuple[int, ...], bool]]:
    """Yields (HF tensor name, params path, layer index or None, HF shape, transposed) per tensor.

    HF stores Linear weights [out, in]; params store them [in, out], so those are
    `transposed` (norm vectors and the embedding table are not).
    """
    shapes = param_shapes(config)
    for key, shape in shapes.items():
        if key == "layers":
            continue
        transposed = key == "lm_head"
        yield _TOP_NAMES[key], (key,), None, shape[::-1] if transposed else shape, transposed
    for key, shape in shapes["layers"].items():
        per_layer = shape[1:]
        transposed = len(per_layer) == 2
        for index in range(config.num_layers):
            yield f"model.layers.{index}.{_LAYER_NAMES[key]}", ("layers", key), index, per_layer[::-1], transposed


@contextlib.contextmanager
def _open_safetensors(file: str) -> Iterator[Any]:
    """`safe_open(file)` whose errors (truncated or corrupt file, bad header) become CheckpointError naming it."""
    try:
        with safe_open(file, framework="numpy") as f:
            yield f
    except SafetensorError as error:
        raise CheckpointError(
            f"{file} is not a readable safetensors file ({error}); re-download or re-export it"
        ) from None


def _read_hf_config(path: str) -> dict:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{config_path} not found: expected a Hugging Face checkpoint directory with config.json")
    try:
        with open(config_path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_path} is not valid JSON: {err}") from None


def _weight_files(path: str) -> dict[str, str]:
    """Maps each tensor name to the safetensors file holding it (single file or sharded index)."""
    index_path = os.path.join(path, INDEX_FILE)
    single_path = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path} has no 'weight_map' object")
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise CheckpointError(f"{file} (listed in {index_path}) not found")
        return files
    if os.path.isfile(single_path):
        with _open_safetensors(single_path) as f:
            return {name: single_path for name in f.keys()}
    raise CheckpointError(f"no weights in {path}: expected {SINGLE_FILE} or {INDEX_FILE} with its shards")


def _stored_shapes(files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in sorted(set(files.values())):
        with _open_safetensors(file) as f:
            for name in f.keys():
                if files.get(name) == file:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    missing_from_files = sorted(set(files) - set(shapes))
    if missing_from_files:
        raise CheckpointError(
            f"tensor {missing_from_files[0]!r} is listed in the index but absent from {files[missing_from_files[0]]}"
        )
    return shapes


def from_hf(path: str, dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """Loads a Qwen3 / Llama HF checkpoint directory into (ModelConfig, params).

    Reads `config.json` (transformers 4.x or 5.x layout) and `model.safetensors` or the
    sharded `model.safetensors.index.json`. Every tensor name and shape is checked before
    any data is read, so a bad checkpoint raises `CheckpointError` naming the tensor and
    nothing is half-loaded. `dtype` ("float32" | "bfloat16" | None = as declared) sets the
    params' dtype.
    """
    config = ModelConfig.from_hf_config(_read_hf_config(path), dtype=dtype)
    files = _weight_files(path)
    stored = _stored_shapes(files)
    expected = {
        name: (target, index, shape, transposed) for name, target, index, shape, transposed in tensor_layout(config)
    }
    # A tied checkpoint may still carry the (identical) lm_head copy.
    optional = {_TOP_NAMES["lm_head"]} if config.tie_word_embeddings else set()
    missing = sorted(set(expected) - set(stored))
    if missing:
        raise CheckpointError(f"tensor {missing[0]!r} is missing from {path} ({len(missing)} missing in total)")
    extra = sorted(name for name in set(stored) - set(expected) - optional if not _IGNORED.match(name))
    if extra:
        raise CheckpointError(
            f"unexpected tensor {extra[0]!r} in {path} ({len(extra)} unexpected in total) for {config.hf_architecture}"
        )
    for name, (_, _, shape, _) in expected.items():
        if stored[name] != shape:
            raise CheckpointError(f"tensor {name!r} in {files[name]} has shape {stored[name]}, expected {shape}")

    np_dtype = _NUMPY_DTYPES[config.dtype]
    arrays = jax.tree.map(
        lambda shape: np.empty(shape, np_dtype), param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)
    )
    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with _open_safetensors(file) as f:
            for name in names:
                target, index, _, transposed = expected[name]
                tensor = f.get_tensor(name)
                tensor = tensor.T if transposed else tensor
                destination = arrays
                for key in target[:-1]:
                    destination = destination[key]
                if index is None:
                    destination[target[-1]] = tensor.astype(np_dtype)
                else:
                    destination[target[-1]][index] = tensor
    return config, jax.tree.map(jnp.asarray, arrays)


def to_hf(config: ModelConfig, params: dict, path: str, max_shard_bytes: int | None = None) -> None:
    """Writes params as a transformers checkpoint (`config.json` + safetensors) into `path`.

    With `max_shard_bytes`, tensors are split over `model-0000i-of-0000n.safetensors` files
    with a `model.safetensors.index.json`, as transformers does for large models.
    """
    import transformers

    expected_shapes = param_shapes(config)
    actual_shapes = jax.tree.map(lambda a: tuple(a.shape), params)
    if actual_shapes != expected_shapes:
        raise CheckpointError(f"params do not match the config: got shapes {actual_shapes}, expected {expected_shapes}")
    os.makedirs(path, exist_ok=True)
    hf_config = transformers.AutoConfig.for_model(config.architecture, **config.to_hf_kwargs())
    hf_config.architectures = [config.hf_architecture]
    # transformers 5 renamed `torch_dtype` to `dtype`.
    dtype_field = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    setattr(hf_config, dtype_field, config.dtype)
    hf_config.save_pretrained(path)

    host = jax.tree.map(np.asarray, jax.device_get(params))
    tensors = {}
    for name, target, index, _, transposed in tensor_layout(config):
        array = host
        for key in target:
            array = array[key]
        array = array if index is None else array[index]
        tensors[name] = np.ascontiguousarray(array.T if transposed else array)

    shards = _shard(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def to_peft(config: ModelConfig, adapters: dict, path: str, *, base_model: str, revision: str | None = None) -> None:
    """Writes LoRA adapters ({"layers": {"q_proj_lora_a": [N, in, r], ...}}, comppo_jax.models.lora)
    as a PEFT adapter directory: adapter_config.json (r, lora_alpha = config.lora_alpha, the
    target modules, `base_model` as base_model_name_or_path and, for a hub id, its `revision`) and
    adapter_model.safetensors with
    PEFT's names, lora_A [r, in] and lora_B [out, r] per layer and module, e.g.
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight. Loads with
    `peft.PeftModel.from_pretrained(<the base>, path)`."""
    layers = jax.tree.map(np.asarray, jax.device_get(adapters["layers"]))
    tensors, modules, ranks = {}, [], set()
    for name, lora_a in layers.items():
        if not name.endswith("_lora_a"):
            continue
        weight = name[: -len("_lora_a")]
        module = _LAYER_NAMES[weight].removesuffix(".weight")
        modules.append(module.split(".")[-1])
        ranks.add(lora_a.shape[-1])
        for index in range(config.num_layers):
            prefix = f"base_model.model.model.layers.{index}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(lora_a[index].T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(layers[weight + "_lora_b"][index].T)
    if len(ranks) != 1:
        raise CheckpointError(
            f"expected LoRA adapters of one rank, got ranks {sorted(ranks)} ({len(modules)} adapted modules)"
        )
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, PEFT_WEIGHTS), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": ranks.pop(),
        "lora_alpha": config.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "modules_to_save": None,
        **({"revision": revision} if revision else {}),
    }
    with open(os.path.join(path, PEFT_CONFIG), "w") as f:
        json.dump(adapter_config, f, indent=2)


def _shard(tensors: dict[str, np.ndarray], max_shard_bytes: int | None) -> list[dict[str, np.ndarray]]:
    if max_shard_bytes is None:
        return [tensors]
    shards: list[dict[str, np.ndarray]]
    current: dict[str, np.ndarray]
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        if current and size + tensor.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += tensor.nbytes
    return shards + [current]


__all__ = ["from_hf", "to_hf", "to_peft", "tensor_layout", "CheckpointError", "ConfigError"]
