"""A response coloured by its gate: one span per token with its statistics, and the PNG."""

from __future__ import annotations

import re

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from comppo_jax.data.tokenizers import CharTokenizer
from comppo_jax.eval.gate_text import gate_html, plot_gate_text, token_pieces

TEXT = "3<4 & 5>2\nAnswer: 7"


def test_pieces_rejoin_to_the_decoded_response():
    tokenizer = CharTokenizer()
    ids = tokenizer.encode(TEXT)
    assert "".join(token_pieces(tokenizer, ids)) == tokenizer.decode(ids) == TEXT


def test_html_has_one_escaped_span_per_token_with_its_statistics():
    pieces = token_pieces(CharTokenizer(), CharTokenizer().encode(TEXT))
    kappa = np.linspace(0.1, 0.9, len(pieces))
    window = np.arange(len(pieces))
    page = gate_html(pieces, kappa, herfindahl=np.full(len(pieces), 0.25), window_size=window, title="<row>")
    spans = re.findall(
        r'<span title="([^"]*)" style="background:rgb\((\d+),(\d+),(\d+)\);color:(#\w+)">(.*?)</span>', page, re.S
    )
    assert len(spans) == len(pieces)
    assert "".join(text for *_, text in spans) == TEXT.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    assert spans[4][0] == "t=5 kappa=0.278 H=0.2500 n=4"
    # viridis: dark at kappa 0.1 (white text), bright at 0.9 (black text)
    assert spans[0][4] == "#fff" and spans[-1][4] == "#000"
    assert sum(map(int, spans[0][1:4])) < sum(map(int, spans[-1][1:4]))
    assert "<b>&lt;row&gt;</b>" in page


def test_arrays_must_match_the_pieces():
    with pytest.raises(ValueError, match=r"herfindahl has shape \(2,\); expected \(3,\)"):
        gate_html(["a", "b", "c"], np.zeros(3), herfindahl=np.zeros(2))
    with pytest.raises(ValueError, match=r"kappa has shape \(3, 1\); expected \(3,\)"):
        plot_gate_text([(["a", "b", "c"], np.zeros((3, 1)), "row")])


def test_png_wraps_lines_and_colours_each_character(tmp_path):
    pieces = token_pieces(CharTokenizer(), CharTokenizer().encode("x" * 25 + "\nyz"))
    figure = plot_gate_text(
        [(pieces, np.linspace(0.1, 0.9, len(pieces)), "row 0")], str(tmp_path / "gate.png"), width=10
    )
    cells = figure.axes[0].patches
    assert len(cells) == len(pieces)  # the newline keeps a cell (drawn as a return arrow)
    rows = sorted({cell.get_y() for cell in cells})
    assert len(rows) == 4  # 25 characters at width 10: three lines, then "yz" after the newline
    assert (tmp_path / "gate.png").stat().st_size > 1000
