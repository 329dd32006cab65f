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


# Fonts whose glyph for a character is a box naming its block (matplotlib ships "Last Resort
# High-Efficiency"): they cover every character and draw none of them.
PLACEHOLDER_FONTS = ("Last Resort",)


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


def _regular_fonts() -> list[tuple[str, str]]:
    """Each font family matplotlib knows, by name, with the file of its most regular face (upright,
    weight nearest 400): read from its font list, not looked up (a lookup of a family that has no
    regular face logs a warning)."""
    from matplotlib import font_manager

    best: dict[str, tuple] = {}
    for entry in font_manager.fontManager.ttflist:
        if entry.name.startswith(PLACEHOLDER_FONTS):  # a box for every character: not the character
            continue
        weight = entry.weight if isinstance(entry.weight, int) else 400
        rank = (entry.style != "normal", abs(weight - 400), entry.fname)
        if entry.name not in best or rank < best[entry.name][0]:
            best[entry.name] = (rank, entry.fname)
    return sorted((name, fname) for name, (_, fname) in best.items())


def _font_file(family: str) -> str | None:
    from matplotlib import font_manager

    try:
        return font_manager.findfont(font_manager.FontProperties(family=family), fallback_to_default=False)
    except ValueError:
        return None


def drawable(labels: Sequence[str]) -> Drawable:
    """`labels` as the plot font and the installed fonts can draw them (module docstring)."""
    from matplotlib import rcParams

    first = rcParams["font.family"][0]
    plot_font = rcParams[f"font.{first}"][0] if f"font.{first}" in rcParams else first
    default = _font_file(plot_font)
    missing = {ord(ch) for label in labels for ch in label if not ch.isspace()} - _glyphs(default or "")
    family = [plot_font]
    for name, path in _regular_fonts() if missing else []:
        covered = missing & _glyphs(path)
        if covered:
            family.append(name)
            missing -= covered
        if not missing:
            break
    escaped = sorted(chr(c) for c in missing)
    out = ["".join(f"\\u{ord(ch):04x}" if ord(ch) in missing else ch for ch in label) for label in labels]
    return Drawable(out, family, escaped)
