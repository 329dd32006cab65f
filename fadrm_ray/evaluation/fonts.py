"""Labels a plot can draw: class names in any script, with the fonts that have their glyphs.

matplotlib draws text in its default font (DejaVu Sans) and, for a character that font lacks,
draws a box and warns once per glyph. A class name in another script (a Japanese folder name)
is drawn here with the plot font first and, for its other characters, the installed fonts that
matplotlib knows and that have them (matplotlib falls back glyph by glyph along a family list).
A character no installed font has is written as its code point (`\\u30b9`), which says exactly
what the name is, and the plot says so in its caption: nothing is drawn as a box, and nothing
warns.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Sequence


class Drawable(NamedTuple):
    labels: list[str]        # the labels, any character no font has written as its code point
    family: list[str]        # the font families to draw them with, the plot font first
    escaped: list[str]       # the characters written as code points (none: every one is drawn)


@lru_cache(maxsize=None)
def _glyphs(path: str) -> frozenset[int]:
    """The code points the font file at `path` has a glyph for."""
    from matplotlib import ft2font

    try:
        return frozenset(ft2font.FT2Font(path).get_charmap())
    except (OSError, RuntimeError, ValueError):  # a font file FreeType cannot read
        return frozenset()


def _font_file(family: str) -> str | None:
    from matplotlib import font_manager

    try:
        return font_manager.findfont(font_manager.FontProperties(family=family), fallback_to_default=False)
    except ValueError:
        return None


def drawable(labels: Sequence[str]) -> Drawable:
    """`labels` as the plot font and the installed fonts can draw them (module docstring)."""
    from matplotlib import font_manager, rcParams

    first = rcParams["font.family"][0]
    plot_font = rcParams[f"font.{first}"][0] if f"font.{first}" in rcParams else first
    default = _font_file(plot_font)
    missing = {ord(ch) for label in labels for ch in label if not ch.isspace()} - _glyphs(default or "")
    family = [plot_font]
    for name in sorted({entry.name for entry in font_manager.fontManager.ttflist}):
        if not missing:
            break
        path = _font_file(name)
        covered = missing & _glyphs(path) if path else set()
        if covered:
            family.append(name)
            missing -= covered
    escaped = sorted(chr(c) for c in missing)
    out = ["".join(f"\\u{ord(ch):04x}" if ord(ch) in missing else ch for ch in label) for label in labels]
    return Drawable(out, family, escaped)
