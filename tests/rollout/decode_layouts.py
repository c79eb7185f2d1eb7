"""Every decode layout samples what the training mesh does: one process with 8 fake CPU devices, or a
launch/local_cluster.py payload (2 processes x 4). Prints "decode layouts ok" when every layout's
greedy and sampled rows equal the training mesh's: tokens identical, log-probs within 1e-5 (fp32)."""

import jax
import numpy as np
from mesh_policy import sharded_policy  # this folder's sibling module (its docstring says why)

from comppo_jax import cli, sharding
from comppo_jax.rollout import generate
from comppo_jax.train import decode_layout

LAYOUTS = (
    "auto",
    "1",
    "4",
)  # heads 4, kv heads 2: groups of 1, 2 (auto, on a CPU: the mesh's tensor axis) or 4 of the 8 devices


def main(argv):
    del argv
    config, mesh, params = sharded_policy()
    rng = np.random.default_rng(0)  # the same prompts on every process
    prompts = rng.integers(10, 64, (4, 7)).astype(np.int32)
    mask = rng.random((4, 7)) > 0.3
    mask[:, 3] = True
    shapes = dict(num_prompts=4, samples=2, prompt_length=7, max_new_tokens=10, page_size=4, decode_slots=None)

    def sample(value, temperature):
        layout = decode_layout.make_decode_layout(value, mesh, config, params, target=(None, None), rollout=shapes)
        with jax.set_mesh(mesh):
            sampler = layout.reshard(params)
            with jax.set_mesh(layout.mesh):
                generation = generate(
                    sampler,
                    config,
                    prompts,
                    mask,
                    jax.random.PRNGKey(1),
                    max_new_tokens=10,
                    temperature=temperature,
                    top_p=0.9,
                    num_samples=2,
                    page_size=4,
                )
            generation = layout.to_training(generation, mesh)
        return layout, {field: sharding.to_host(value) for field, value in generation._asdict().items()}

    for temperature in (0.0, 1.0):
        _, reference = sample("train", temperature)
        lengths = reference["response_mask"].sum(axis=1)
        assert temperature == 0.0 or lengths.min() < 10, lengths  # EOS ended some sampled rows early
        for value in LAYOUTS:
            layout, rows = sample(value, temperature)
            assert layout.resharded, (value, dict(layout.mesh.shape))
            for field in ("tokens", "attention_mask", "response_tokens", "response_mask", "prompt_lengths"):
                np.testing.assert_array_equal(rows[field], reference[field], err_msg=f"{value}: {field}")
            np.testing.assert_allclose(
                rows["log_probs"], reference["log_probs"], atol=1e-5, rtol=0, err_msg=f"{value}: log_probs"
            )
            print(f"layout {value} (groups of {layout.tensor}) temperature {temperature}: equal", flush=True)
    print("decode layouts ok", flush=True)


if __name__ == "__main__":
    cli.run(main)
