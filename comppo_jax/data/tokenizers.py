"""Tokenizers behind one small interface: `encode(text) -> list[int]`, `decode(ids) -> str`,
`encode_prompt(text) -> list[int]` (with the chat template where there is one), and the
special ids.

- `CharTokenizer`: ASCII characters as ids (vocab 128, fits `configs/tiny.py`), with NUL as
  pad, SOH as BOS and STX as EOS; for the synthetic default task.
- `HFTokenizer`: `transformers.AutoTokenizer` from a local directory (transformers never reaches the
  hub: `load_tokenizer` fetches a hub id or a gs:// directory first, through `comppo_jax.hub`), whose
  prompts go through the tokenizer's chat template as a user message.
"""

from __future__ import annotations

import os

from comppo_jax import hub


class CharTokenizer:
    vocab_size = 128
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def encode(self, text: str) -> list[int]:
        bad = sorted({c for c in text if not 32 <= ord(c) < 128 and c != "\n"})
        if bad:
            raise ValueError(f"CharTokenizer encodes printable ASCII and newlines only; got {bad!r} in {text[:40]!r}")
        return [ord(c) for c in text]

    def encode_prompt(self, text: str) -> list[int]:
        return [self.bos_token_id] + self.encode(text)

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids if int(i) >= 32 or int(i) == 10)


class HFTokenizer:
    def __init__(self, path: str, use_chat_template: bool = True):
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"tokenizer directory {path} does not exist (expected tokenizer.json / tokenizer_config.json)"
            )
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.use_chat_template = use_chat_template and self.tokenizer.chat_template is not None
        self.vocab_size = len(self.tokenizer)
        self.pad_token_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        )
        self.bos_token_id = self.tokenizer.bos_token_id
        self.eos_token_id = self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_prompt(self, text: str) -> list[int]:
        if not self.use_chat_template:
            return self.tokenizer.encode(text)
        messages = [{"role": "user", "content": text}]
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


Tokenizer = CharTokenizer | HFTokenizer  # what load_tokenizer returns


def load_tokenizer(path: str | None, field: str = "model.tokenizer"):
    """`HFTokenizer` of a local directory, a gs:// one or a hub id (a tokenizer's or a model's), `CharTokenizer()`
    for None or ""; `field` is the config field an error names."""
    return HFTokenizer(hub.resolve_tokenizer(path, field)) if path else CharTokenizer()


def token_pieces(tokenizer, tokens) -> list[str]:
    """The text of each token, decoded alone: what gets one colour in a gate-on-text view. For a
    byte-level BPE, a character split over two tokens shows as replacement characters on both."""
    return [tokenizer.decode([int(token)]) for token in tokens]


def pad_batch(token_lists, pad_token_id: int, *, side: str = "left", length: int | None = None):
    """(tokens [B, P] int32, mask [B, P] bool) numpy arrays; P = the longest row unless given."""
    import numpy as np

    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    longest = max(len(t) for t in token_lists)
    length = longest if length is None else length
    if longest > length:
        raise ValueError(f"a row has {longest} tokens, more than length={length}")
    tokens = np.full((len(token_lists), length), pad_token_id, np.int32)
    mask = np.zeros((len(token_lists), length), bool)
    for row, ids in enumerate(token_lists):
        span = slice(length - len(ids), length) if side == "left" else slice(0, len(ids))
        tokens[row, span], mask[row, span] = ids, True
    return tokens, mask
