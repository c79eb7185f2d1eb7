"""The rollout engine (paged cache, one prefill per prompt, continuous batching) against the dense
reference sampler, the scoring pass and a float64 attention oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comppo_jax.models import ModelConfig, init_params, paged_cache
from comppo_jax.rollout import engine, generate
from comppo_jax.rollout.dense import generate_dense
from comppo_jax.rollout.scoring import score_rollout

CONFIG = ModelConfig(
    architecture="qwen3",
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tie_word_embeddings=False,
    eos_token_ids=(),
    pad_token_id=0,
)
# Right-padded, left-padded, full and one-token prompt rows.
PROMPTS = jnp.asarray([[5, 6, 7, 8, 9], [11, 12, 13, 0, 0], [0, 0, 21, 22, 23], [0, 0, 0, 0, 30]], jnp.int32)
PROMPT_MASK = PROMPTS != 0


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.3)


@pytest.fixture(scope="module")
def eos(params):
    """A token the greedy responses emit mid-way, so rows end at different steps."""
    greedy = generate_dense(
        params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(0), max_new_tokens=10, temperature=0.0
    )
    return int(np.asarray(greedy.response_tokens)[1, 3])


@pytest.fixture(scope="module")
def dense(params, eos):
    """The dense sampler's greedy rows, EOS `eos`, one row per prompt: a group's greedy rows are all alike, so
    each layout's rows are these repeated (one dense program for every num_samples)."""
    return generate_dense(
        params,
        CONFIG,
        PROMPTS,
        PROMPT_MASK,
        jax.random.PRNGKey(1),
        max_new_tokens=10,
        temperature=0.0,
        eos_token_ids=(eos,),
    )


def assert_same_generation(a, b, atol=1e-5):
    for field in a._fields:
        np.testing.assert_allclose(
            np.asarray(getattr(a, field)), np.asarray(getattr(b, field)), atol=atol, err_msg=field
        )


@pytest.mark.parametrize(
    "page_size,decode_slots,num_samples",
    # The default layout (page 64, every row at once): tests/rollout/test_sampler.py's greedy, EOS and
    # log-prob tests, and the sampled rows' reference below.
    [
        # more rows than slots: rows wait, slots and pages are reused; pages filled mid-prompt
        # (copy-on-write) and shared by a group
        (3, 3, 2),
        (1, 1, 3),  # one slot: rows run one after another
    ],
)
def test_greedy_tokens_and_log_probs_equal_the_dense_sampler(params, eos, dense, page_size, decode_slots, num_samples):
    kwargs = dict(max_new_tokens=10, temperature=0.0, num_samples=num_samples, eos_token_ids=(eos,))
    paged = generate(
        params,
        CONFIG,
        PROMPTS,
        PROMPT_MASK,
        jax.random.PRNGKey(1),
        page_size=page_size,
        decode_slots=decode_slots,
        **kwargs,
    )
    lengths = np.asarray(paged.response_mask).sum(axis=1)
    assert lengths.min() < 10 and lengths.max() == 10  # EOS ended some rows mid-batch, not all
    assert_same_generation(paged, type(dense)(*(jnp.repeat(x, num_samples, axis=0) for x in dense)))


SAMPLED = dict(max_new_tokens=9, temperature=0.7, top_p=0.9, num_samples=3, eos_token_ids=(3, 4))
WAITING = dict(page_size=2, decode_slots=5)  # 12 rows: they wait for slots, which are reused


def test_sampled_rows_depend_on_the_rng_only_not_on_slots_or_pages(params, monkeypatch):
    """Row r's tokens depend on the rng and r only, whatever the pages and slots; and each prompt is
    prefilled once for its whole group (recorded while the reference call traces)."""
    prefilled = []
    original = engine.prefill_prompts

    def recording(params, config, tokens, *args):
        prefilled.append(tokens.shape)
        return original(params, config, tokens, *args)

    with monkeypatch.context() as patch:
        patch.setattr(engine, "prefill_prompts", recording)
        reference = generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(7), **SAMPLED)
    assert prefilled == [PROMPTS.shape]  # 4 prompts through the model once, not 12 rows
    # Rows wait for slots and start at other steps (one slot alone: the greedy test's (1, 1, 3)).
    other = generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(7), **WAITING, **SAMPLED)
    assert_same_generation(other, reference)
    assert not np.array_equal(
        generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(8), **SAMPLED).tokens, reference.tokens
    )


def test_sampled_log_probs_equal_the_scoring_pass_with_rows_waiting_for_slots(params):
    """At temperature 0.7 with top_p 0.9, rows ending at EOS (temperature 1: tests/rollout/test_sampler.py and
    tests/rollout/test_conversations.py). The sampler is the test above's, compiled once."""
    temperature = SAMPLED["temperature"]
    out = generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(2), **WAITING, **SAMPLED)
    scored = score_rollout(params, None, CONFIG, out, temperature=temperature, top_k=None, backend="reference")
    np.testing.assert_allclose(scored.log_probs, out.log_probs, atol=1e-5)


def test_the_pool_holds_the_slots_not_the_rows():
    layout = engine.make_layout(8, 128, num_samples=8, max_new_tokens=4096, page_size=64, decode_slots=16)
    rows_times_table = layout.rows * layout.table_width
    assert layout.slots == 16 and layout.pages_per_layer < rows_times_table / 3.5
    with pytest.raises(ValueError, match="decode_slots must be >= 1"):
        engine.make_layout(2, 8, num_samples=1, max_new_tokens=4, page_size=4, decode_slots=0)


# --- decode attention over pages against a float64 oracle ---------------------------------------

PAGE, NUM_LAYERS, PAGES_PER_LAYER, HEAD_DIM, NUM_HEADS, NUM_KV = (
    8,
    2,
    14,
    128,
    8,
    2,
)  # the TPU kernel needs hd % 128 == 0
LENGTHS = np.asarray([1, 8, 9, 30, 32], np.int32)  # one token, page boundaries, a partial last page


def attention_inputs():
    rng = np.random.default_rng(0)
    kv = rng.normal(size=(NUM_LAYERS * PAGES_PER_LAYER, PAGE, 2 * NUM_KV, HEAD_DIM)).astype(np.float32)
    tables = np.stack([rng.permutation(np.arange(1, PAGES_PER_LAYER))[:4] for _ in LENGTHS]).astype(np.int32)
    q = rng.normal(size=(len(LENGTHS), NUM_HEADS, HEAD_DIM)).astype(np.float32)
    return q, kv, tables


def oracle(q, kv, tables, layer):
    out = np.zeros(q.shape, np.float64)
    group = NUM_HEADS // NUM_KV
    for row, length in enumerate(LENGTHS):
        pages = kv[layer * PAGES_PER_LAYER + tables[row]].reshape(-1, 2 * NUM_KV, HEAD_DIM)[:length].astype(np.float64)
        for head in range(NUM_HEADS):
            k, v = pages[:, 2 * (head // group)], pages[:, 2 * (head // group) + 1]
            logits = k @ q[row, head] / np.sqrt(HEAD_DIM)
            probs = np.exp(logits - logits.max())
            out[row, head] = probs @ v / probs.sum()
    return out


def pool_for(backend, kv):
    """`kv` (combined layout) in `backend`'s layout."""
    layout = paged_cache.LAYOUTS[backend]
    k, v = kv[:, :, 0::2], kv[:, :, 1::2]  # [pages, page, Hkv, hd]
    arrays = {"combined": (kv,), "heads_first": (k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3))}[layout]
    return paged_cache.PagePool(tuple(jnp.asarray(a) for a in arrays), layout, PAGES_PER_LAYER, PAGE)


@pytest.mark.parametrize("backend", ["xla", "gpu_interpret", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_paged_decode_attention_equals_dense_attention(backend):
    q, kv, tables = attention_inputs()
    out = paged_cache.decode_attention(
        jnp.asarray(q),
        pool_for(backend, kv),
        1,
        jnp.asarray(tables),
        jnp.asarray(LENGTHS),
        backend=backend,
        num_pages=tables.shape[1],
    )
    np.testing.assert_allclose(np.asarray(out), oracle(q, kv, tables, 1), atol=1e-5)


@pytest.mark.parametrize("pages_per_row", [4, 80, 96])
def test_the_gpu_kernel_lowers_to_triton_at_any_table_width(pages_per_row):
    """Lowered for CUDA on this CPU: Triton takes only power-of-two arrays, and a table of 96 pages
    (16 partitions of 6) once asked it for 6 page numbers at a time (seen on an H200)."""
    q, kv, _ = attention_inputs()
    tables = jax.ShapeDtypeStruct((len(LENGTHS), pages_per_row), jnp.int32)
    attend = jax.jit(
        lambda q, tables, lengths: paged_cache.decode_attention(
            q, pool_for("gpu", kv), 1, tables, lengths, backend="gpu"
        )
    )
    attend.trace(jnp.asarray(q), tables, jnp.asarray(LENGTHS)).lower(lowering_platforms=("cuda",))


# One page a chunk; three, the last chunk padded (a chunk of several pages: 24's first).
@pytest.mark.parametrize("chunk_tokens", [8, 24])
def test_the_xla_path_softmax_spans_its_chunks_and_reads_a_traced_page_count(monkeypatch, chunk_tokens):
    monkeypatch.setattr(paged_cache, "XLA_CHUNK_TOKENS", chunk_tokens)
    q, kv, tables = attention_inputs()
    attend = jax.jit(
        lambda q, tables, lengths, num_pages: paged_cache.decode_attention(
            q, pool_for("xla", kv), 1, tables, lengths, backend="xla", num_pages=num_pages
        )
    )
    out = attend(jnp.asarray(q), jnp.asarray(tables), jnp.asarray(LENGTHS), jnp.int32(tables.shape[1]))
    np.testing.assert_allclose(np.asarray(out), oracle(q, kv, tables, 1), atol=1e-5)
    # Rows up to two pages long only need two pages read; garbage past them changes nothing.
    short = LENGTHS <= 2 * PAGE
    junk = tables.copy()
    junk[:, 2:] = 0
    out = attend(jnp.asarray(q[short]), jnp.asarray(junk[short]), jnp.asarray(LENGTHS[short]), jnp.int32(2))
    np.testing.assert_allclose(np.asarray(out), oracle(q, kv, tables, 1)[short], atol=1e-5)


def test_the_tpu_kernels_reference_reads_our_pool_as_our_xla_path_does():
    """JAX's own reference for the ragged paged attention kernel, on our pool, tables and lengths."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    q, kv, tables = attention_inputs()
    rows = len(LENGTHS)
    # Jitted, its lengths static (it slices by them): one program, not each row's ops compiled eagerly.
    reference = jax.jit(
        lambda q, kv, tables: ref_ragged_paged_attention(
            q,
            kv,
            LENGTHS,
            tables,
            np.arange(rows + 1, dtype=np.int32),
            np.asarray([rows], np.int32),
            sm_scale=HEAD_DIM**-0.5,
        )
    )
    out = reference(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(tables + PAGES_PER_LAYER))
    np.testing.assert_allclose(np.asarray(out), oracle(q, kv, tables, 1), atol=1e-5)


def test_interpreted_tpu_kernel_equals_dense_attention():
    q, kv, tables = attention_inputs()
    attend = lambda: paged_cache.decode_attention(
        jnp.asarray(q),
        pool_for("tpu_interpret", kv),
        1,
        jnp.asarray(tables),
        jnp.asarray(LENGTHS),
        backend="tpu_interpret",
    )
    if jax.__version_info__ < (0, 11):
        # jax 0.10's Pallas TPU interpreter cannot run this kernel; the TPU compile test checks it compiled.
        with pytest.raises(jax.errors.JaxRuntimeError, match="'ReshapeTransform' object has no attribute 'indices'"):
            attend()
        return
    np.testing.assert_allclose(np.asarray(attend()), oracle(q, kv, tables, 1), atol=1e-5)


GPU_CONFIG = CONFIG.replace(head_dim=16)  # the compiled GPU kernels' dots need 16 features


@pytest.fixture(scope="module")
def gpu_params():
    return init_params(GPU_CONFIG, jax.random.PRNGKey(0), init_std=0.3)


@pytest.mark.parametrize("backend", ["gpu_interpret", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_generate_on_the_gpu_kernel_equals_the_xla_path(gpu_params, backend):
    config, params = GPU_CONFIG, gpu_params
    kwargs = dict(max_new_tokens=5, temperature=0.0, num_samples=2, page_size=2, decode_slots=3)
    xla = generate(params, config, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(4), paged_attention="xla", **kwargs)
    gpu = generate(params, config, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(4), paged_attention=backend, **kwargs)
    assert_same_generation(gpu, xla)


@pytest.mark.gpu
def test_sampled_log_probs_equal_the_gpu_scoring_pass(gpu_params):
    """On the device's kernels end to end: the paged decode kernel samples, the Triton
    concentration kernel scores, and the log-probs agree as they do on CPU."""
    config, params = GPU_CONFIG, gpu_params
    out = generate(
        params,
        config,
        PROMPTS,
        PROMPT_MASK,
        jax.random.PRNGKey(2),
        max_new_tokens=8,
        temperature=1.0,
        num_samples=2,
        page_size=2,
        decode_slots=3,
        paged_attention="gpu",
    )
    scored = score_rollout(params, None, config, out, top_k=None, backend="gpu")
    np.testing.assert_allclose(scored.log_probs, out.log_probs, atol=1e-5)
