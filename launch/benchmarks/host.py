"""Host-side work of one train step that grows with the batch: decoding the responses and verifying them.

Every host of a multi-host run decodes all of a step's responses; the verifier's work is split
over the hosts (docs/reliability.md). This suite times both at the paper's shape (16 responses
of 16,384 tokens) on one host, with a byte-level BPE fast tokenizer trained here (the real ones
are not downloaded) and the math-verify worker pool the train loop uses.
"""

from __future__ import annotations

import numpy as np
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

from benchmarks.timing import interleaved_medians, print_table
from comppo_jax.data.rewards import VerifierPool, score_responses

ALPHABET = list("abcdefghijklmnopqrstuvwxyz0123456789+-=()")


def byte_level_tokenizer(seed: int = 0) -> transformers.PreTrainedTokenizerFast:
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(ALPHABET, rng.integers(1, 9))) for _ in range(5000)]
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        (" ".join(rng.choice(words, 200)) for _ in range(2000)),
        trainers.BpeTrainer(vocab_size=32000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend)


def run(batch: int = 16, length: int = 16384, repeats: int = 3) -> list[dict]:
    tokenizer = byte_level_tokenizer()
    ids = np.random.default_rng(1).integers(0, tokenizer.vocab_size, (batch, length))
    responses = [f"{tokenizer.decode(row[:64].tolist())}\nAnswer: \\frac{{{i + 1}}}{{2}}" for i, row in enumerate(ids)]
    golds = [f"{i + 1}/2" if i % 2 else "7" for i in range(batch)]
    with VerifierPool(num_workers=1, timeout_s=5.0) as pool:
        seconds = interleaved_medians(
            {
                "decode": lambda: [tokenizer.decode(row.tolist(), skip_special_tokens=True) for row in ids],
                "verify": lambda: score_responses(responses, golds, [length] * batch, pool),
            },
            repeats,
        )
    rows = [
        {"work": name, "responses": batch, "tokens each": length, "seconds per step": f"{value:.3f}"}
        for name, value in seconds.items()
    ]
    print_table(rows, ["work", "responses", "tokens each", "seconds per step"])
    return rows
