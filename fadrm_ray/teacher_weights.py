"""The weights of a classifier trained elsewhere, found for `fadrm import-teacher`
(teacher_import.py): `find_weights(model, source)` reads them, weights-only, from a file,
torch hub's cache (torchvision's published weights, downloaded where a network exists) or the
Hugging Face cache (timm's `pretrained`), with what their metadata says of the normalization,
the training size and the class names (a file's own: `file_categories`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from fadrm_ray.fileio import sha256_file
from fadrm_ray.models import ModelError


class FoundWeights(BaseModel):
    """The weights found for a source, and what their metadata says."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    state_dict: dict[str, Any]
    described: str                      # e.g. "torchvision ResNet18FoundWeights.IMAGENET1K_V1 (torch hub cache)"
    weights_sha256: str | None = None   # of the file read
    meta_from: str | None = None        # what the metadata below comes from
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    trained_size: int | None = None
    categories: list[str] | None = None
    categories_from: str | None = None  # where the class names come from, where it is not `meta_from`


def _read_file(path: Path) -> dict[str, Any]:
    from timm.models import load_state_dict

    if not path.is_file():
        raise ModelError(f"weights file not found: {path}")
    try:
        state = load_state_dict(str(path), use_ema=False, weights_only=True)
    except Exception as exc:  # a pickle that a weights-only load refuses, a truncated file, not a checkpoint
        # torch's own text suggests loading again with weights_only=False, which runs whatever code
        # the file holds: never pass that on.
        why = ("it holds objects other than tensors and plain values" if "weights_only" in str(exc)
               else f"not a weights file ({type(exc).__name__})")
        raise ModelError(f"cannot read weights {path}: {why}; only tensors and plain values are loaded, and "
                         f"nothing in the file is run") from None
    if not isinstance(state, dict) or not state:
        raise ModelError(f"{path} holds no state dict")
    if state.get("format") == "fadrm-teacher":
        raise ModelError(f"{path} is already a fadrm teacher checkpoint: pass it as --teacher")
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ModelError(f"{path} holds no tensors: not a state dict")
    return tensors


# The safetensors metadata key that names the classes of a weights file's outputs, in output
# order, as a JSON list of strings (README, `fadrm import-teacher`): safetensors metadata holds
# strings only. Write it with `safetensors.torch.save_file(state, path,
# metadata={"class_names": json.dumps(names)})`.
CLASS_NAMES_KEY = "class_names"
# timm's own convention: `timm.models.save_for_hf` (and push_to_hub) writes the weights with a
# config.json beside them whose `label_names` is the class of each output (a list, or a mapping
# of output index to name). torchvision has none for a file: its published weights name their
# categories in their enum's metadata (`_torchvision_meta`).
TIMM_CONFIG, TIMM_LABEL_NAMES = "config.json", "label_names"


def file_categories(path: Path) -> dict:
    """The class names a weights file carries, in output order, and where they come from: its
    safetensors metadata (`CLASS_NAMES_KEY`), else timm's config.json beside it; {} for neither.
    Names that are there but malformed are refused (the user wrote them to be used)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
        except Exception:  # not readable as safetensors: _read_file says why
            metadata = {}
        if CLASS_NAMES_KEY in metadata:
            where = f"the {CLASS_NAMES_KEY!r} key of its safetensors metadata"
            try:
                names = json.loads(metadata[CLASS_NAMES_KEY])
            except ValueError:
                names = None
            return {"categories": _names_list(names, f"{where} ({path})"), "categories_from": where}
    config = path.parent / TIMM_CONFIG
    try:
        loaded = json.loads(config.read_text()) if config.is_file() else None
    except (OSError, ValueError):
        loaded = None
    if isinstance(loaded, dict) and loaded.get(TIMM_LABEL_NAMES):
        where = f"the {TIMM_LABEL_NAMES!r} of timm's {TIMM_CONFIG} beside it"
        return {"categories": _names_list(loaded[TIMM_LABEL_NAMES], f"{where} ({config})"), "categories_from": where}
    return {}


def _names_list(names: Any, where: str) -> list[str]:
    """Class names as a list in output order, from a list or an {index: name} mapping."""
    if isinstance(names, dict):
        try:
            by_index = {int(k): v for k, v in names.items()}
        except (TypeError, ValueError):
            by_index = {}
        names = [by_index[i] for i in range(len(by_index))] if sorted(by_index) == list(range(len(by_index))) \
            else None
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ModelError(f"{where} must be a list of class names in output order (a JSON list of strings)")
    return names


def _torchvision_enum_member(arch: str, name: str):
    from torchvision.models import get_model_weights

    try:
        enum = get_model_weights(arch)
    except (ValueError, KeyError):
        raise ModelError(f"torchvision publishes no weights for {arch}") from None
    members = [m for m in enum.__members__]
    if name not in members:
        raise ModelError(f"torchvision has no weights {name!r} for {arch}; choose one of: {', '.join(members)} "
                         f"or a weights file")
    return enum[name]


def _torchvision_member_of_file(arch: str, path: Path):
    """The weights enum member whose published file name is `path`'s (torch hub's cache keeps it)."""
    from torchvision.models import get_model_weights

    try:
        enum = get_model_weights(arch)
    except (ValueError, KeyError):
        return None
    return next((m for m in enum if Path(m.url).name == path.name), None)


def _torchvision_meta(member) -> dict:
    transform = member.transforms()
    size = transform.crop_size[0] if isinstance(transform.crop_size, (list, tuple)) else transform.crop_size
    return {"mean": tuple(float(v) for v in transform.mean), "std": tuple(float(v) for v in transform.std),
            "trained_size": int(size), "categories": list(member.meta.get("categories") or []) or None,
            "meta_from": f"torchvision's {member}"}


def _torchvision_weights(arch: str, source: str) -> FoundWeights:
    path = Path(source).expanduser()
    if path.suffix or os.sep in source or path.exists():
        member = _torchvision_member_of_file(arch, path)
        state = _read_file(path)
        described = f"file {path.resolve()}" + (f" (torchvision's {member} file)" if member else "")
        meta = {**(_torchvision_meta(member) if member else {}), **file_categories(path)}
        return FoundWeights(state_dict=state, described=described, weights_sha256=sha256_file(path), **meta)
    member = _torchvision_enum_member(arch, source)
    cached = Path(os.path.join(torch.hub.get_dir(), "checkpoints", Path(member.url).name))  # torch hub's cache
    if not cached.is_file() and os.environ.get("FADRM_OFFLINE", "").strip().lower() not in ("", "0", "false", "no"):
        raise ModelError(f"torchvision weights {member} are not in torch hub's cache ({cached}) and FADRM_OFFLINE is "
                         f"set; copy {cached.name} there or pass the file as --weights")
    if not cached.is_file():
        try:
            member.get_state_dict(progress=False, check_hash=True)  # downloads into the cache
        except Exception as exc:
            raise ModelError(f"torchvision weights {member} are not in torch hub's cache ({cached}) and the download "
                             f"failed ({type(exc).__name__}); copy {cached.name} there or pass the file as "
                             f"--weights") from None
    state = _read_file(cached)
    return FoundWeights(state_dict=state, described=f"torchvision {member} ({cached})", weights_sha256=sha256_file(cached),
                    **_torchvision_meta(member))


def timm_meta(arch: str) -> dict:
    """What timm's pretrained config of `arch` says of its normalization, training size and class
    names (empty where timm has no config for it)."""
    import timm

    cfg = timm.models.get_pretrained_cfg(arch)
    if cfg is None:
        return {}
    names = list(cfg.label_names) if cfg.label_names else None
    return {"mean": tuple(float(v) for v in cfg.mean), "std": tuple(float(v) for v in cfg.std),
            "trained_size": int(cfg.input_size[-1]), "categories": names,
            "meta_from": f"timm's pretrained config of {cfg.architecture}" + (f".{cfg.tag}" if cfg.tag else "")}


def _timm_weights(arch: str, source: str) -> FoundWeights:
    import timm

    if not timm.is_model(arch):
        raise ModelError(f"unknown timm model '{arch}'")
    if source == "pretrained":  # the Hugging Face cache (downloads only where a network exists)
        try:
            model = timm.create_model(arch, pretrained=True)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise ModelError(f"timm weights for {arch} are not in the Hugging Face cache and cannot be fetched "
                             f"({first}); pass a weights file as --weights") from None
        state = {k: v for k, v in model.state_dict().items()}
        return FoundWeights(state_dict=state, described=f"timm {arch} pretrained (Hugging Face cache)", **timm_meta(arch))
    path = Path(source).expanduser()  # a file of the user's: timm's config says how timm trains, not how it was
    return FoundWeights(state_dict=_read_file(path), described=f"file {path.resolve()}", weights_sha256=sha256_file(path),
                        **file_categories(path))


def find_weights(model: str, source: str) -> FoundWeights:
    """The state dict and metadata `source` gives for `model`."""
    prefix, sep, arch = model.partition(":")
    if sep and prefix == "torchvision":
        return _torchvision_weights(arch, source)
    if sep and prefix == "timm":
        return _timm_weights(arch, source)
    path = Path(source).expanduser()
    return FoundWeights(state_dict=_read_file(path), described=f"file {path.resolve()}", weights_sha256=sha256_file(path),
                        **file_categories(path))
