"""Training attention paths against the materialized reference: forward, gradients, memory."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HANG_S, fake_devices_env

from comppo_jax.models import ConfigError, ModelConfig, forward, init_params
from comppo_jax.models.attention import (
    chunked_attention,
    cudnn_attention,
    resolve_implementation,
    splash_attention,
    training_attention,
)
from pallas_kernels.common import causal_attention


def inputs(batch=3, length=200, heads=4, kv_heads=2, head_dim=16, seed=0, dtype=jnp.float32):
    """Random q, k, v and a mask with left padding, right padding and a hole in the middle."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), dtype)
    k = jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), dtype)
    mask = np.ones((batch, length), bool)
    mask[0, : length // 7] = False
    mask[1 % batch, length - length // 4 :] = False
    mask[2 % batch, length // 5 : length // 5 + 6] = False
    # Cotangent weights on the real queries only: padded queries' outputs are unspecified.
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * mask[:, :, None, None]
    return q, k, v, jnp.asarray(mask), weights


def value_and_grads(attention, q, k, v, weights):
    loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * weights)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


PATHS = {
    "chunked, blocks dividing L": lambda q, k, v, m: chunked_attention(q, k, v, m, block_q=40, block_k=40),
    "chunked, uneven blocks": lambda q, k, v, m: chunked_attention(q, k, v, m, block_q=64, block_k=32),
    "chunked, one block": lambda q, k, v, m: chunked_attention(q, k, v, m),
    "splash (interpreted)": lambda q, k, v, m: splash_attention(q, k, v, m, block=128, interpret=True),
    "packed rows (cudnn's, run by XLA)": lambda q, k, v, m: cudnn_attention(q, k, v, m, implementation="xla"),
}


def output_value_and_grads(attention, q, k, v, weights):
    """`attention`'s output and `value_and_grads`, jitted: one compile (eagerly, every op compiles alone)."""
    return jax.jit(lambda q, k, v: (attention(q, k, v), value_and_grads(attention, q, k, v, weights)))(q, k, v)


@pytest.fixture(scope="module")
def reference():
    """The inputs, and the materialized reference's output, loss and gradients on them: shared by the paths."""
    q, k, v, mask, weights = inputs()
    return (q, k, v, mask, weights), output_value_and_grads(
        lambda q, k, v: causal_attention(q, k, v, mask), q, k, v, weights
    )


@pytest.mark.parametrize("path", PATHS)
def test_attention_path_matches_reference_forward_and_gradient(path, reference):
    (q, k, v, mask, weights), (expected_out, (expected_value, expected_grads)) = reference
    out, (value, grads) = output_value_and_grads(lambda q, k, v: PATHS[path](q, k, v, mask), q, k, v, weights)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(expected_out)[real], atol=2e-5)
    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    for name, grad, expected in zip("qkv", grads, expected_grads):
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), atol=5e-5, err_msg=f"d{name}")


# Packed rows: per row, (length, segment id) runs filling ROW_LENGTH, id 0 for padding. Row 0 has
# left padding, a 5-token sequence and sequences across block edges (32, 40 and 48 tokens); row 1
# padding between sequences. Sequence 2 has a hole (padding inside the sequence) at HOLE.
ROW_LENGTH = 200
PACKED_ROWS = [[(3, 0), (45, 1), (70, 2), (5, 3), (60, 4), (17, 0)], [(90, 7), (4, 0), (33, 5), (64, 6), (9, 0)]]
HOLE = (2, range(10, 13))  # (segment id, offsets within its sequence)


def packed_inputs(seed=0, heads=4, kv_heads=2, head_dim=16):
    """Packed q, k, v, mask, segment_ids, cotangent weights (zero at padding), and `unpack`: packed
    [R, L, ...] -> [S, L, ...], each sequence alone at the start of a row, zero past its end."""
    rng = np.random.default_rng(seed)
    segments, rows, positions, valid = np.zeros((len(PACKED_ROWS), ROW_LENGTH), np.int32), [], [], []
    for r, runs in enumerate(PACKED_ROWS):
        offset = 0
        for length, segment in runs:
            segments[r, offset : offset + length] = segment
            if segment:
                rows.append(np.full(ROW_LENGTH, r))
                positions.append(np.minimum(offset + np.arange(ROW_LENGTH), ROW_LENGTH - 1))
                valid.append(np.arange(ROW_LENGTH) < length)
            offset += length
        assert offset == ROW_LENGTH
    mask = segments > 0
    hole_segment, hole_offsets = HOLE
    hole_row, hole_start = np.argwhere(segments == hole_segment)[0]
    mask[hole_row, hole_start + np.asarray(hole_offsets)] = False
    rows, positions, valid = np.stack(rows), np.stack(positions), np.stack(valid)

    def unpack(x):
        gathered = x[rows, positions]
        return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), gathered, jnp.zeros((), x.dtype))

    shape = lambda h: (len(PACKED_ROWS), ROW_LENGTH, h, head_dim)
    q, k, v = (jnp.asarray(rng.normal(size=shape(h)), jnp.float32) for h in (heads, kv_heads, kv_heads))
    weights = jnp.asarray(rng.normal(size=shape(heads)), jnp.float32) * mask[:, :, None, None]
    return q, k, v, jnp.asarray(mask), jnp.asarray(segments), weights, unpack


PACKED_PATHS = {
    "xla": lambda q, k, v, m, s: training_attention(q, k, v, m, implementation="xla", segment_ids=s),
    "chunked, blocks of 40": lambda q, k, v, m, s: training_attention(
        q, k, v, m, implementation="chunked", block=40, segment_ids=s
    ),
    "chunked, uneven blocks": lambda q, k, v, m, s: chunked_attention(
        q, k, v, m, block_q=32, block_k=48, segment_ids=s
    ),
    "chunked, one block": lambda q, k, v, m, s: chunked_attention(q, k, v, m, segment_ids=s),
    # Packed rows (segment ids given) hand over to packed_flash, interpreted here.
    "splash (interpreted)": lambda q, k, v, m, s: training_attention(
        q, k, v, m, implementation="splash_interpret", block=128, segment_ids=s
    ),
    "cudnn's, run by XLA": lambda q, k, v, m, s: cudnn_attention(q, k, v, m, implementation="xla", segment_ids=s),
}
# The contributor's loop runs one path of each kind; CI runs them all.
PACKED_PARAMS = [
    pytest.param(path, marks=pytest.mark.slow)
    if path in ("chunked, uneven blocks", "chunked, one block", "splash (interpreted)")
    else path
    for path in PACKED_PATHS
]


@pytest.mark.parametrize("path", PACKED_PARAMS)
def test_packed_rows_give_each_sequence_what_it_gets_alone(path):
    """Forward at every real token and the gradients w.r.t. the packed q, k, v: the packed rows
    against the same path on each sequence alone in a padded row, without segment ids."""
    q, k, v, mask, segments, weights, unpack = packed_inputs()
    attend = PACKED_PATHS[path]
    alone_mask = unpack(mask)
    real = np.asarray(alone_mask)
    packed_loss = lambda q, k, v: jnp.sum(attend(q, k, v, mask, segments) * weights)
    alone_loss = lambda q, k, v: jnp.sum(attend(unpack(q), unpack(k), unpack(v), alone_mask, None) * unpack(weights))

    @jax.jit  # one compile (eagerly, every op would compile on its own)
    def outputs_values_and_grads(q, k, v):
        packed_out = attend(q, k, v, mask, segments)
        alone_out = attend(unpack(q), unpack(k), unpack(v), alone_mask, None)
        return (
            (unpack(packed_out), alone_out),
            jax.value_and_grad(packed_loss, argnums=(0, 1, 2))(q, k, v),
            jax.value_and_grad(alone_loss, argnums=(0, 1, 2))(q, k, v),
        )

    (packed_out, alone_out), (value, grads), (expected_value, expected_grads) = outputs_values_and_grads(q, k, v)
    np.testing.assert_allclose(np.asarray(packed_out)[real], np.asarray(alone_out)[real], atol=1e-5)

    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    for name, grad, expected in zip("qkv", grads, expected_grads):
        assert np.abs(np.asarray(expected)).max() > 0.1  # the loss reaches every input
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), atol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("path", PACKED_PARAMS)
def test_one_segment_per_row_is_the_same_as_no_segment_ids(path):
    q, k, v, mask, weights = inputs(batch=2, length=100)
    attend = lambda segments: lambda q, k, v: PACKED_PATHS[path](q, k, v, mask, segments)
    (value, grads), (expected_value, expected_grads) = jax.jit(  # one compile
        lambda q, k, v: (
            value_and_grads(attend(None), q, k, v, weights),
            value_and_grads(attend(jnp.full(mask.shape, 3, jnp.int32)), q, k, v, weights),
        )
    )(q, k, v)
    np.testing.assert_allclose(value, expected_value, rtol=1e-6)
    for grad, expected in zip(grads, expected_grads):
        # Rounding level: CPUs of other vector widths sum in other orders.
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_cudnn_packed_rows_match_the_float32_reference():
    """cuDNN with segment ids (the explicit-mask path) on bfloat16 against the float32 reference
    with the same segments, on the same rounded inputs: bounds as the unpacked cuDNN test."""
    q, k, v, mask, segments, weights, _ = packed_inputs(head_dim=64)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    up = lambda x: x.astype(jnp.float32)
    real = np.asarray(mask)
    attend = lambda q, k, v: cudnn_attention(q, k, v, mask, segment_ids=segments)
    reference = lambda q, k, v: causal_attention(q, k, v, mask, segment_ids=segments)
    out = jax.jit(attend)(q, k, v)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(out, np.float32)[real], np.asarray(reference(up(q), up(k), up(v)))[real], atol=3e-2
    )
    _, grads = jax.jit(lambda q, k, v: value_and_grads(attend, q, k, v, weights))(q, k, v)
    _, expected = value_and_grads(reference, up(q), up(k), up(v), weights)
    for name, grad, want in zip("qkv", grads, expected):
        want = np.asarray(want)
        np.testing.assert_allclose(
            np.asarray(grad, np.float32), want, atol=2e-2 * np.abs(want).max(), err_msg=f"d{name}"
        )


def test_chunked_packed_rows_skip_the_key_blocks_before_each_segment():
    """The forward's (and dq's) first key block per query block: the one holding the earliest
    segment start of its queries over the batch; without segments, block 0."""
    from comppo_jax.models.attention import _first_key_blocks

    _, _, _, _, segments, _, _ = packed_inputs()
    padded = jnp.pad(segments, ((0, 0), (0, 288 - ROW_LENGTH)), mode="edge")
    # segment starts: row 0 at 0, 3, 48, 118, 123, 183; row 1 at 0, 90, 94, 127, 191
    np.testing.assert_array_equal(_first_key_blocks(padded, 32, 48), [0, 0, 0, 1, 2, 2, 3, 3, 3])
    assert _first_key_blocks(None, 32, 48) is None


@pytest.mark.parametrize("length", [1, 3])
def test_one_block_attention_handles_fewer_queries_than_slices(length):
    q, k, v, mask, _ = inputs(batch=2, length=length)
    both = jax.jit(lambda q, k, v, m: (chunked_attention(q, k, v, m), causal_attention(q, k, v, m)))
    np.testing.assert_allclose(*both(q, k, v, jnp.ones_like(mask)), atol=1e-6)


def test_bfloat16_chunked_attention_is_close_to_the_float32_reference():
    q, k, v, mask, _ = inputs(dtype=jnp.bfloat16)
    reference, out = jax.jit(
        lambda q, k, v: (
            causal_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask),
            chunked_attention(q, k, v, mask, block_q=64, block_k=64),
        )
    )(q, k, v)
    assert out.dtype == jnp.bfloat16
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out, np.float32)[real], np.asarray(reference)[real], atol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cudnn_attention_matches_the_float32_reference_forward_and_gradient(dtype):
    """cuDNN's fused kernel (packed rows) on 16-bit inputs against the float32 reference on the
    same rounded inputs: forward as the bf16 chunked path's bound, gradients within 2% of their largest entry."""
    q, k, v, mask, weights = inputs(length=256, head_dim=64, dtype=dtype)
    up = lambda x: x.astype(jnp.float32)
    real = np.asarray(mask)
    out = jax.jit(lambda q, k, v: cudnn_attention(q, k, v, mask))(q, k, v)
    reference = causal_attention(up(q), up(k), up(v), mask)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32)[real], np.asarray(reference)[real], atol=3e-2)
    _, grads = jax.jit(
        lambda q, k, v: value_and_grads(lambda q, k, v: cudnn_attention(q, k, v, mask), q, k, v, weights)
    )(q, k, v)
    _, expected = value_and_grads(lambda q, k, v: causal_attention(q, k, v, mask), up(q), up(k), up(v), weights)
    for name, grad, want in zip("qkv", grads, expected):
        want = np.asarray(want)
        np.testing.assert_allclose(
            np.asarray(grad, np.float32), want, atol=2e-2 * np.abs(want).max(), err_msg=f"d{name}"
        )


def temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_chunked_attention_gradient_never_materializes_the_length_squared_logits():
    q, k, v, mask, weights = inputs(batch=1, length=2048, heads=2, kv_heads=1, head_dim=16)
    logits_bytes = 2 * 2048 * 2048 * 4  # one float32 [H, L, L] logits tensor
    grad = lambda attention: lambda q, k, v: value_and_grads(lambda q, k, v: attention(q, k, v, mask), q, k, v, weights)
    dense = temp_bytes(grad(causal_attention), q, k, v)
    chunked = temp_bytes(grad(lambda q, k, v, m: chunked_attention(q, k, v, m, block_q=128, block_k=128)), q, k, v)
    assert dense >= logits_bytes  # the reference does hold [L, L] (the check has teeth)
    assert chunked < logits_bytes / 8, (chunked, dense)


def test_auto_picks_splash_on_tpu_cudnn_for_16_bit_gpu_and_chunked_otherwise():
    assert resolve_implementation("auto", jnp.bfloat16, "tpu") == "splash"
    assert resolve_implementation("auto", jnp.bfloat16, "gpu") == "cudnn"
    assert resolve_implementation("auto", jnp.float32, "gpu") == "chunked"
    assert resolve_implementation("auto", jnp.float32, "cpu") == "chunked"
    assert resolve_implementation("xla", jnp.float32, "tpu") == "xla"
    with pytest.raises(ValueError, match="'flash'"):
        resolve_implementation("flash", jnp.float32)


def test_bad_attention_inputs_are_named():
    q, k, v, mask, _ = inputs()
    with pytest.raises(ValueError, match="attention_mask must be bool"):
        training_attention(q, k, v, mask.astype(jnp.int32))
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        training_attention(q[:, :, :3], k, v, mask)
    with pytest.raises(ValueError, match="segment_ids must be int"):
        training_attention(q, k, v, mask, segment_ids=mask)
    for field, value in (("attention", "flash"), ("remat", "some"), ("logits_chunk", -1)):
        with pytest.raises(ConfigError, match=field):
            ModelConfig(
                architecture="qwen3",
                vocab_size=8,
                hidden_size=8,
                intermediate_size=8,
                num_layers=1,
                num_heads=2,
                num_kv_heads=1,
                head_dim=4,
                **{field: value},
            )


CONFIG = ModelConfig(
    architecture="qwen3",
    vocab_size=40,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,  # remat's barrier between layers needs two; a third runs the same code again
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    attention="xla",
)


def forward_loss_and_grads(config):
    """(loss, gradient) of the masked squared logits of `config`'s forward, jitted (one compile)."""
    params = init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.3)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 50)), jnp.int32)
    mask = jnp.asarray(np.arange(50)[None] < np.array([[50], [33]]))

    def loss(params):
        logits = forward(params, config, tokens, mask).logits
        return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2) / 1000

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.fixture(scope="module")
def xla_forward_without_remat():
    return forward_loss_and_grads(CONFIG)


# Every remat policy runs the same code of ours (one jax.checkpoint, with a policy of JAX's):
# "full" and "dots" stand for "dots_no_batch" too.
@pytest.mark.parametrize("attention,remat", [("chunked", "full"), ("splash_interpret", "none"), ("xla", "dots")])
def test_forward_logits_and_gradient_do_not_depend_on_attention_or_remat(attention, remat, xla_forward_without_remat):
    expected_value, expected = xla_forward_without_remat
    value, grads = forward_loss_and_grads(CONFIG.replace(attention=attention, remat=remat))
    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    for path, grad in jax.tree_util.tree_leaves_with_path(grads):
        wanted = dict(jax.tree_util.tree_leaves_with_path(expected))[path]
        np.testing.assert_allclose(np.asarray(grad), np.asarray(wanted), atol=2e-5, err_msg=jax.tree_util.keystr(path))


SHARDED_SPLASH = """
import jax, jax.numpy as jnp, numpy as np, ml_collections
from jax.sharding import NamedSharding, PartitionSpec as P
from comppo_jax.sharding import make_mesh, BATCH
from comppo_jax.models.attention import splash_attention
from pallas_kernels.common import causal_attention
mesh = make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=2, tensor=2)))
rng = np.random.default_rng(0)
q = jnp.asarray(rng.normal(size=(2, 130, 4, 16)), jnp.float32)
k, v = (jnp.asarray(rng.normal(size=(2, 130, 2, 16)), jnp.float32) for _ in range(2))
mask = jnp.asarray(np.arange(130)[None] < np.array([[130], [90]]))
rows = NamedSharding(mesh, P(BATCH))
attend = jax.jit(lambda q, k, v, m: splash_attention(q, k, v, m, block=128, interpret=True), in_shardings=(rows,) * 4)
# The output and the gradient of its masked sum, in one compile.
output_and_grad = lambda attention: jax.jit(
    lambda q: (attention(q), jax.grad(lambda q: jnp.where(mask[:, :, None, None], attention(q), 0).sum())(q))
)
with jax.set_mesh(mesh):
    assert "shard_map" in str(jax.make_jaxpr(attend)(q, k, v, mask))  # the kernel sees per-device blocks
    out, grad = output_and_grad(lambda q: attend(q, k, v, mask))(q)
reference_out, reference_grad = output_and_grad(lambda q: causal_attention(q, k, v, mask))(q)
grad_error = np.abs(np.asarray(grad - reference_grad)).max()
assert grad_error < 5e-5, grad_error
error = np.abs(np.asarray(out - reference_out))[np.asarray(mask)].max()
assert error < 2e-5, error
print("ok", error)
"""


def test_splash_runs_per_shard_under_a_context_mesh():
    env = fake_devices_env(4)
    result = subprocess.run(
        [sys.executable, "-c", SHARDED_SPLASH], env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
