"""The Pillow codec shared by the store and the dataset readers."""
import io

import pytest
import torch
from PIL import Image

from fadrm_ray import codec


def pil_bytes(array, fmt="PNG", mode=None) -> bytes:
    image = Image.fromarray(array)
    if mode:
        image = image.convert(mode)
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("channels", [1, 3])
def test_png_round_trip_is_lossless_and_keeps_channels(channels):
    image = torch.randint(0, 256, (channels, 7, 9), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    data = codec.encode_png(image)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert codec.stored_channels(data) == channels
    assert torch.equal(codec.decode(data), image)
    with Image.open(io.BytesIO(data)) as pil:  # an independent reader sees the same pixels
        assert pil.mode == ("L" if channels == 1 else "RGB")
        pixels = torch.from_numpy(__import__("numpy").asarray(pil).copy())
    assert torch.equal(pixels if channels == 3 else pixels.unsqueeze(-1), image.permute(1, 2, 0))


def test_decode_converts_to_the_requested_channels():
    rgb = torch.zeros(3, 4, 4, dtype=torch.uint8)
    rgb[0] = 255  # pure red
    data = codec.encode_png(rgb)
    grey = codec.decode(data, channels=1)
    assert grey.shape == (1, 4, 4) and int(grey[0, 0, 0]) == 76  # ITU-R 601-2 luma of red: 0.299 * 255
    assert codec.decode(codec.encode_png(grey), channels=3).shape == (3, 4, 4)


def test_alpha_and_jpeg_inputs():
    import numpy as np

    rgba = np.zeros((5, 5, 4), dtype=np.uint8)
    assert codec.stored_channels(pil_bytes(rgba)) == 4
    assert codec.stored_channels(pil_bytes(np.zeros((5, 5), dtype=np.uint8), mode="LA")) == 2
    assert codec.decode(pil_bytes(rgba)).shape == (3, 5, 5)
    jpeg = pil_bytes(np.full((8, 8, 3), 128, dtype=np.uint8), fmt="JPEG")
    assert codec.stored_channels(jpeg) == 3
    assert (codec.decode(jpeg, channels=3).int() - 128).abs().max() <= 2


def test_garbage_is_a_codec_error():
    with pytest.raises(codec.CodecError, match="UnidentifiedImageError"):
        codec.decode(b"not an image")
