"""Image bytes <-> uint8 (C, H, W) tensors, through Pillow.

One codec for the store (PNG parts) and the dataset readers (PNG, JPEG and whatever Pillow
opens). Pillow imports in milliseconds, which matters in Ray workers that start per run.
"""
from __future__ import annotations

import io
import os
import re
from typing import NamedTuple

import numpy as np
import torch

from fadrm_ray.errors import InputError

# Pillow modes that hold one grey channel (with alpha: two).
_GREY_MODES = {"1": 1, "L": 1, "I": 1, "I;16": 1, "I;16B": 1, "I;16L": 1, "F": 1, "LA": 2, "La": 2}


class CodecError(InputError):
    """Bytes that are not a readable image."""


# What a whole file of these formats ends with: JPEG's end-of-image marker, PNG's IEND chunk
# (an MPO is a JPEG with more pictures after the first). Looked for in the last _TAIL_BYTES, as
# some writers pad a file after it.
_END_MARKS = {"JPEG": b"\xff\xd9", "MPO": b"\xff\xd9", "PNG": b"IEND\xaeB`\x82"}
_TAIL_BYTES = 64


class FileCheck(NamedTuple):
    """What `check_file` found: `problem` None for a readable image, else what is wrong with it:
    `empty`, `oversized`, or `unreadable: ` and the decoder's own reason (Pillow's words: "image
    file is truncated (103 bytes not processed)" for a file cut short in its pixels, "broken data
    stream when reading image file" for garbage behind a valid header, "cannot identify image
    file" for bytes no format of Pillow's starts with); its mode and size as stored where Pillow
    read its header."""

    problem: str | None
    mode: str = ""
    width: int = 0
    height: int = 0


def _unreadable(exc: BaseException) -> str:
    """`unreadable: REASON`, the decoder's reason in one line (without the repr of the stream it read)."""
    reason = " ".join(str(exc).split()) or type(exc).__name__
    reason = re.sub(r"\s*<[^<>]*(BytesIO|BufferedReader)[^<>]*>", "", reason).strip() or type(exc).__name__
    return f"unreadable: {reason}"


def _open(data: bytes | bytearray | memoryview):
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(bytes(data)))
        image.load()
    except Exception as exc:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError...
        raise CodecError(f"{type(exc).__name__}: {exc}") from None
    return image


def encode_png(image: torch.Tensor) -> bytes:
    """Lossless PNG bytes of a uint8 (C, H, W) tensor with C = 1 (grey) or 3 (RGB)."""
    from PIL import Image

    array = image.detach().cpu().contiguous().numpy()
    pil = Image.fromarray(array[0] if array.shape[0] == 1 else array.transpose(1, 2, 0))  # mode L or RGB
    buf = io.BytesIO()
    pil.save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def decode(data: bytes | bytearray | memoryview, channels: int | None = None) -> torch.Tensor:
    """uint8 (C, H, W): grey for `channels=1`, RGB for 3, the stored channels (grey or RGB) for None."""
    image = _open(data)
    if channels is None:
        channels = 1 if image.mode in _GREY_MODES else 3
    image = image.convert("L" if channels == 1 else "RGB")
    array = np.asarray(image, dtype=np.uint8)
    tensor = torch.from_numpy(array.copy())
    return tensor.unsqueeze(0) if channels == 1 else tensor.permute(2, 0, 1).contiguous()


def stored_channels(data: bytes | bytearray | memoryview) -> int:
    """How many channels the encoded image holds: 1 or 2 for grey (with alpha), 3 or 4 for colour."""
    return _channels(_open(data))


def header_channels(head: bytes | bytearray | memoryview) -> int | None:
    """`stored_channels` from the first bytes of an encoded image, without decoding it: Pillow's
    open reads the mode from the header and leaves the pixels alone. None when those bytes do
    not hold a header Pillow can read (then decode the whole image)."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(bytes(head)))
    except Exception:  # truncated before the mode, or not an image format Pillow knows
        return None
    return _channels(image)


def is_grey_mode(mode: str) -> bool:
    """Whether Pillow's `mode` holds one grey channel (with or without alpha)."""
    return mode in _GREY_MODES


def check_file(path: str) -> FileCheck:
    """Whether the image file at `path` can be read whole, from its head and its end, without
    decoding it: Pillow identifies it from its header (format, mode, size), and a JPEG or PNG
    must end with its end marker. One that does not (cut short, or padded past the last bytes
    looked at) is decoded whole, and is `unreadable` with the decoder's reason where that fails
    (cut short, or garbage behind a valid header: the decoder says which). Other formats are taken
    on their header. Never raises: a file that cannot be opened is `unreadable` too."""
    from PIL import Image

    try:
        with open(path, "rb") as fh:
            try:
                image = Image.open(fh)  # the header only: the pixels are left alone
            except Image.DecompressionBombError:  # decoding it would be refused too
                return FileCheck("oversized")
            except Exception as exc:  # not an image Pillow knows, or cut short inside its header
                if os.fstat(fh.fileno()).st_size == 0:
                    return FileCheck("empty")
                return FileCheck(_unreadable(exc))
            found = FileCheck(None, image.mode, *image.size)
            mark = _END_MARKS.get(image.format or "")
            if mark is None:
                return found
            end = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, end - _TAIL_BYTES))
            if mark in fh.read():
                return found
            fh.seek(0)
            data = fh.read()
    except OSError as exc:
        return FileCheck(_unreadable(exc))
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError...
        return found._replace(problem=_unreadable(exc))
    return found


def _channels(image) -> int:
    if image.mode in _GREY_MODES:
        return _GREY_MODES[image.mode]
    return 4 if "A" in image.getbands() else 3
