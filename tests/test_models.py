"""Model factory, teacher checkpoints, teacher/dataset compatibility."""
from __future__ import annotations

import hashlib
import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fadrm_ray.data.base import ImageDataset, Split  # noqa: E402
from fadrm_ray.models import (MODEL_NAMES, ModelError, TeacherRecord, check_teacher_fits, create_model,  # noqa: E402
                              load_teacher, match_channels, save_teacher)


def _first_conv(model: nn.Module) -> nn.Conv2d:
    return next(m for m in model.modules() if isinstance(m, nn.Conv2d))


@pytest.mark.parametrize("name", ["convnet-bn", "resnet18-cifar", "timm:resnet18", "torchvision:resnet18",
                                  "resnet18", "shufflenet_v2_x0_5"])
@pytest.mark.parametrize("in_chans", [1, 3])
def test_models_build_and_run_at_two_resolutions(name, in_chans):
    torch.manual_seed(0)
    model = create_model(name, num_classes=7, in_chans=in_chans, image_size=32).eval()
    assert _first_conv(model).in_channels == in_chans
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    with torch.no_grad():
        for size in (32, 24):  # global pooling: the head does not care about the resolution
            assert model(torch.randn(2, in_chans, size, size)).shape == (2, 7)


def test_bare_names_resolve_in_order():
    # Own registry first (timm has no 'convnet-bn'), then timm, then torchvision-only names.
    assert type(create_model("convnet-bn", 3)).__name__ == "ConvNetBN"
    assert type(create_model("resnet18", 3)).__module__.startswith("timm")
    assert type(create_model("shufflenet_v2_x0_5", 3)).__module__.startswith("torchvision")


def test_resnet18_cifar_stem():
    model = create_model("resnet18-cifar", 10, in_chans=1)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1) and model.conv1.in_channels == 1
    assert isinstance(model.maxpool, nn.Identity)
    feats = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool, model.layer1).eval()
    assert feats(torch.randn(1, 1, 32, 32)).shape[-1] == 32  # no downsampling in the stem


def test_convnet_bn_pools_only_while_it_can():
    def pools(model):
        return sum(isinstance(m, nn.AvgPool2d) for m in model.modules())

    assert pools(create_model("convnet-bn", 10, in_chans=1, image_size=8)) == 3  # 8 -> 4 -> 2 -> 1
    assert pools(create_model("convnet-bn", 10, in_chans=1, image_size=8, depth=5)) == 3
    m = create_model("convnet-bn", 10, in_chans=1, image_size=28, depth=4, width=16)
    assert pools(m) == 4 and m.classifier.in_features == 16
    m.eval()
    assert m(torch.randn(3, 1, 8, 8)).shape == (3, 10)


def test_timm_resnet18_single_channel():
    model = create_model("timm:resnet18", 5, in_chans=1).eval()
    assert _first_conv(model).in_channels == 1
    assert model(torch.randn(1, 1, 64, 64)).shape == (1, 5)


def test_unknown_models_raise_model_error():
    with pytest.raises(ModelError) as err:
        create_model("no-such-net", 10)
    msg = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in msg
    assert "convnet-bn" in msg and "resnet18-cifar" in msg and "timm" in msg and "torchvision" in msg
    for bad in ("timm:no_such_net", "torchvision:no_such_net", "keras:resnet"):
        with pytest.raises(ModelError):
            create_model(bad, 10)
    with pytest.raises(ModelError, match="rejected its arguments"):
        create_model("convnet-bn", 10, no_such_kwarg=1)
    assert "convnet-bn" in MODEL_NAMES and "timm:NAME" in MODEL_NAMES


def test_match_channels():
    x = torch.randn(2, 1, 4, 4)
    assert match_channels(x, 3).shape == (2, 3, 4, 4)
    assert match_channels(x, 1) is x
    with pytest.raises(ModelError):
        match_channels(torch.randn(2, 3, 4, 4), 1)


# ---------------------------------------------------------------- checkpoints

def _info(**over) -> TeacherRecord:
    base = dict(model_name="convnet-bn", model_kwargs={"width": 16, "depth": 2}, num_classes=3, in_chans=1,
                image_size=8, mean=(0.3,), std=(0.4,), class_names=["a", "b", "c"], dataset="toy",
                dataset_fingerprint="abc", test_accuracy=91.5)
    base.update(over)
    return TeacherRecord(**base)


def _trained_like(info: TeacherRecord) -> nn.Module:
    torch.manual_seed(1)
    model = create_model(info.model_name, info.num_classes, info.in_chans, info.image_size, **info.model_kwargs)
    model.train()
    with torch.no_grad():  # move the BatchNorm running statistics away from their defaults
        model(torch.randn(16, info.in_chans, 8, 8) * 3 + 1)
    return model.eval()


def test_checkpoint_round_trip_gives_identical_outputs(tmp_path):
    info = _info()
    model = _trained_like(info)
    path = tmp_path / "sub" / "teacher.pt"
    saved = save_teacher(path, model, info)
    digest = saved.sha256
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest() and saved.path == str(path)
    assert saved.model_copy(update={"path": "", "sha256": None}) == info
    assert [p.name for p in path.parent.iterdir()] == ["teacher.pt"]  # no temp files left behind

    loaded, loaded_info = load_teacher(path)
    assert not loaded.training
    assert all(not p.requires_grad for p in loaded.parameters())
    assert loaded_info == saved  # every field read back, with where the file is and its sha256
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))


def test_checkpoint_loads_with_weights_only(tmp_path):
    path = tmp_path / "t.pt"
    save_teacher(path, _trained_like(_info()), _info())
    payload = torch.load(path, weights_only=True)
    assert payload["info"]["class_names"] == ["a", "b", "c"]


def test_load_teacher_rejects_missing_and_garbage(tmp_path):
    with pytest.raises(ModelError, match="not found") as err:
        load_teacher(tmp_path / "absent.pt")
    assert str(tmp_path / "absent.pt") in str(err.value)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ModelError, match="cannot read") as err:
        load_teacher(junk)
    assert "\n" not in str(err.value)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(ModelError, match="not a fadrm teacher"):
        load_teacher(other)


def test_a_checkpoint_record_lacking_a_field_is_refused_on_both_ways(tmp_path):
    path = tmp_path / "t.pt"
    with pytest.raises(ModelError, match="lacks num_classes"):
        save_teacher(path, _trained_like(_info()), _info().model_copy(update={"num_classes": None}))
    assert not path.exists()
    save_teacher(path, _trained_like(_info()), _info())
    payload = torch.load(path, weights_only=True)
    del payload["info"]["dataset_fingerprint"]
    torch.save(payload, path)
    with pytest.raises(ModelError, match="lacks dataset_fingerprint"):
        load_teacher(path)


def test_an_older_checkpoint_record_reads_back_typed(tmp_path):
    """Checkpoints written when the record was a dataclass: NaN for an unmeasured top-1, the import
    record a plain dict, class names as written."""
    path = tmp_path / "t.pt"
    save_teacher(path, _trained_like(_info()), _info())
    payload = torch.load(path, weights_only=True)
    payload["info"].update(test_accuracy=float("nan"), imported={"source": "file /w.pth", "normalization": "flags",
                                                                 "eval_images": 10, "chance": 33.3})
    torch.save(payload, path)
    _, info = load_teacher(path)
    assert info.test_accuracy is None and info.imported.source == "file /w.pth" and info.imported.eval_images == 10


def test_load_teacher_rejects_weights_of_another_shape(tmp_path):
    info = _info()
    path = tmp_path / "t.pt"
    save_teacher(path, _trained_like(info), info)
    payload = torch.load(path, weights_only=True)
    payload["info"]["model_kwargs"] = {"width": 8, "depth": 2}
    torch.save(payload, path)
    with pytest.raises(ModelError, match="do not fit"):
        load_teacher(path)


# ---------------------------------------------------------------- compatibility

def _dataset(class_names=("a", "b", "c"), channels=1, size=8) -> ImageDataset:
    n = len(class_names)
    split = Split.in_memory(torch.zeros((n, channels, size, size), dtype=torch.uint8), torch.arange(n))
    return ImageDataset(name="toy", class_names=list(class_names), image_size=size, channels=channels,
                        mean=(0.5,) * channels, std=(0.5,) * channels, train=split, test=split)


def test_check_teacher_fits_accepts_matching_and_grey_to_rgb():
    check_teacher_fits(_info(), _dataset())
    check_teacher_fits(_info(in_chans=3), _dataset())  # 1-channel data fed by repetition


@pytest.mark.parametrize("info_over, data_over, field, values", [
    ({}, {"class_names": ("a", "b", "c", "d")}, "num_classes", ("3", "4")),
    ({}, {"class_names": ("a", "c", "b")}, "class_names", ("'b'", "'c'")),
    ({}, {"size": 16}, "image_size", ("8", "16")),
    ({"in_chans": 1}, {"channels": 3}, "in_chans", ("1", "3")),
    ({"in_chans": 3, "mean": (0.1,) * 3}, {"channels": 2}, "in_chans", ("3", "2")),
])
def test_check_teacher_fits_rejects_mismatches(info_over, data_over, field, values):
    with pytest.raises(ModelError) as err:
        check_teacher_fits(_info(**info_over), _dataset(**data_over))
    msg = str(err.value)
    assert msg.startswith(field)
    assert all(v in msg for v in values)
