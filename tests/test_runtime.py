"""tune_allocator really changes glibc's malloc in a fresh process (and can be turned off)."""
import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt is glibc's")

PROBE = r"""
import ctypes, json
from fadrm_ray.runtime import tune_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
tuned = tune_allocator()
before = libc.mallinfo2()
blocks = [libc.malloc(200_000) for _ in range(20)]   # above glibc's default 128 KiB mmap threshold
after = libc.mallinfo2()
print(json.dumps({"tuned": tuned, "heap_growth": after.arena - before.arena, "new_mmaps": after.hblks - before.hblks}))
"""


def probe(**env) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "FADRM_DEFAULT_MALLOC"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tune_allocator_keeps_mid_sized_blocks_on_a_padded_heap():
    default = probe(FADRM_DEFAULT_MALLOC="1")
    tuned = probe()
    assert default["tuned"] is False and tuned["tuned"] is True
    # glibc's defaults: every 200 kB block is its own mmap (returned to the kernel on free)
    assert default["new_mmaps"] == 20
    # tuned: the blocks come from the heap, which grows by the 1 GiB top pad at once
    assert tuned["new_mmaps"] == 0 and tuned["heap_growth"] >= 1 << 30


def test_settings_from_the_environment_are_left_alone():
    # MALLOC_TOP_PAD_ alone (no mmap threshold): tune_allocator must not add the other settings
    result = probe(MALLOC_TOP_PAD_="0")
    assert result["tuned"] is True and result["new_mmaps"] == 20
