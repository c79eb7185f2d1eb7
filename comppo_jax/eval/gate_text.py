"""A response's text coloured by its gate kappa_t: one colour per token, the statistics behind it on hover.

    pieces = token_pieces(tokenizer, response_tokens)          # one string per token
    HTML(gate_html(pieces, kappa, herfindahl, window_size))    # in a notebook; hover a token for t, kappa, H, n, c
    plot_gate_text([(pieces, kappa, "row 0")], "gate.png")     # the same shading as a PNG

Token t's colour is kappa_t, the retention gate read at the state before y_t (DESIGN.md: per-token
arrays are read at sequence position P + t - 2). In Comp-GAE, A_t = delta_t + lam kappa_t A_{t+1}
(paper eq. comp_gae), so kappa_t is the share of the credit of everything after y_t that reaches
y_t, and through it the tokens before.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import numpy as np

from comppo_jax.data.tokenizers import token_pieces

__all__ = ["gate_html", "plot_gate_text", "token_pieces"]

COLORMAP = "viridis"


def _colors(kappa, vmin: float, vmax: float) -> np.ndarray:
    import matplotlib

    scaled = (np.asarray(kappa, np.float64) - vmin) / max(vmax - vmin, 1e-12)
    return matplotlib.colormaps[COLORMAP](np.clip(scaled, 0.0, 1.0))


def _text_color(rgba) -> str:
    """Black on light backgrounds, white on dark ones (relative luminance)."""
    return "#000" if 0.2126 * rgba[0] + 0.7152 * rgba[1] + 0.0722 * rgba[2] > 0.5 else "#fff"


def _check(pieces: Sequence[str], **arrays) -> None:
    for name, values in arrays.items():
        if values is not None and np.shape(values) != (len(pieces),):
            raise ValueError(
                f"{name} has shape {np.shape(values)}; expected ({len(pieces)},), one value per token piece"
            )


def gate_html(
    pieces: Sequence[str],
    kappa,
    herfindahl=None,
    window_size=None,
    concentration=None,
    *,
    title: str = "",
    vmin: float = 0.0,
    vmax: float = 1.0,
) -> str:
    """An HTML block of the tokens, each on a background coloured by kappa_t (viridis over
    [vmin, vmax]) with a tooltip of t, kappa_t and, when given, H_t, n_t and c_t. All arrays are
    [T] for the T pieces (one response's valid tokens)."""
    _check(pieces, kappa=kappa, herfindahl=herfindahl, window_size=window_size, concentration=concentration)
    colors = _colors(kappa, vmin, vmax)
    spans = []
    for t, (piece, rgba) in enumerate(zip(pieces, colors)):
        tip = [f"t={t + 1}", f"kappa={float(kappa[t]):.3f}"]
        tip += [
            f"{name}={fmt.format(float(values[t]))}"
            for name, values, fmt in (
                ("H", herfindahl, "{:.4f}"),
                ("n", window_size, "{:.0f}"),
                ("c", concentration, "{:.3f}"),
            )
            if values is not None
        ]
        background = "rgb({:.0f},{:.0f},{:.0f})".format(*(255 * rgba[:3]))
        spans.append(
            f'<span title="{html.escape(" ".join(tip))}" style="background:{background};color:{_text_color(rgba)}">'
            f"{html.escape(piece)}</span>"
        )
    stops = ", ".join(
        "rgb({:.0f},{:.0f},{:.0f})".format(*(255 * c[:3])) for c in _colors(np.linspace(vmin, vmax, 5), vmin, vmax)
    )
    legend = (
        f'<div style="font-size:smaller">kappa {vmin:g} <span style="display:inline-block;width:10em;height:0.8em;'
        f'background:linear-gradient(to right, {stops})"></span> {vmax:g}</div>'
    )
    heading = f"<div><b>{html.escape(title)}</b></div>" if title else ""
    return (
        f'<div style="margin-bottom:1em">{heading}'
        '<div style="font-family:monospace;white-space:pre-wrap;line-height:1.5">'
        f"{''.join(spans)}</div>{legend}</div>"
    )


def plot_gate_text(
    rows: Sequence[tuple[Sequence[str], object, str]],
    path: str | None = None,
    *,
    width: int = 80,
    vmin: float = 0.0,
    vmax: float = 1.0,
):
    """Rows of (pieces, kappa [T], label) drawn as monospace text on cells coloured by kappa_t,
    wrapped at `width` characters (and at newlines), with a colour bar; saved to `path` if given.
    Returns the matplotlib Figure."""
    import matplotlib
    import matplotlib.pyplot as plt

    layouts = []  # per row: [(line, column, character, rgba)] and its line count
    for pieces, kappa, _ in rows:
        _check(pieces, kappa=kappa)
        cells, line, column = [], 0, 0
        for piece, rgba in zip(pieces, _colors(kappa, vmin, vmax)):
            for character in piece:
                if character == "\n":
                    cells.append((line, column, "\u21b5", rgba))  # the newline token keeps its colour
                    line, column = line + 1, 0
                    continue
                if column == width:
                    line, column = line + 1, 0
                cells.append((line, column, character, rgba))
                column += 1
        layouts.append((cells, line + 1))
    total_lines = sum(lines + 1.5 for _, lines in layouts)  # each row: a label line and a gap
    columns = max([column + 1 for cells, _ in layouts for _, column, _, _ in cells] + [width // 2])
    cell_inches = 0.13
    figure = plt.figure(figsize=(columns * cell_inches + 1.2, total_lines * cell_inches * 1.6 + 0.4))
    axes = figure.add_axes((0.0, 0.0, columns * cell_inches / figure.get_figwidth(), 1.0))
    axes.set_xlim(0, columns)
    axes.set_ylim(total_lines, 0)
    axes.axis("off")
    top = 0.0
    for (cells, lines), (_, _, label) in zip(layouts, rows):
        axes.text(0, top + 0.8, label, fontsize=8, fontweight="bold")
        top += 1.0
        for line, column, character, rgba in cells:
            axes.add_patch(matplotlib.patches.Rectangle((column, top + line), 1, 1, color=rgba, linewidth=0))
            axes.text(
                column + 0.5,
                top + line + 0.78,
                character,
                fontsize=7,
                family="monospace",
                ha="center",
                color=_text_color(rgba),
            )
        top += lines + 0.5
    bar_height = min(0.8, 2.5 / figure.get_figheight())  # at most 2.5 inches, at the top right
    colorbar_axes = figure.add_axes(
        (1.0 - 0.5 / figure.get_figwidth(), 0.98 - bar_height, 0.12 / figure.get_figwidth(), bar_height)
    )
    figure.colorbar(
        matplotlib.cm.ScalarMappable(matplotlib.colors.Normalize(vmin, vmax), COLORMAP),
        cax=colorbar_axes,
        label="kappa_t",
    )
    if path:
        figure.savefig(path, dpi=120, bbox_inches="tight")
    return figure
