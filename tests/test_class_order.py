"""Classes in the teacher's order and by name: weights whose outputs are another order than the
folder's classes are refused naming the classes (and taken with `--class-order`); classes are
named as the service takes them."""
from __future__ import annotations

import json

import pytest
import torch

from fadrm_ray.cli import main


@pytest.fixture(scope="module")
def digits_folders(tmp_path_factory):
    """digits written as an ImageFolder (train/ and test/ of its own split), and the same with the
    folders of classes 0 and 1 swapped."""
    from PIL import Image

    from fadrm_ray.data import get_dataset

    digits = get_dataset("digits")
    root = tmp_path_factory.mktemp("digits-folders")
    for name, swap in (("plain", {}), ("swapped", {0: 1, 1: 0})):
        for split_name, split in (("train", digits.train), ("test", digits.test)):
            images = split.load(torch.arange(len(split)))
            for i, (image, label) in enumerate(zip(images, split.labels.tolist())):
                folder = root / name / split_name / str(swap.get(label, label))
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(image[0].numpy()).save(folder / f"{i}.png")
    return root / "plain", root / "swapped"


def test_weights_of_another_class_order_are_refused_naming_the_classes(digits_teacher, digits_folders, tmp_path,
                                                                       capsys):
    plain, swapped = digits_folders
    state = torch.load(digits_teacher[0], weights_only=True)["state_dict"]
    torch.save(state, tmp_path / "weights.pth")
    common = ["import-teacher", "--model", "convnet-bn", "--model-arg", "width=32", "--weights",
              str(tmp_path / "weights.pth"), "--mean", "0.5", "--std", "0.5"]
    assert main([*common, "--dataset", f"imagefolder:{plain}", "--out", str(tmp_path / "plain.pt"), "--quiet"]) == 0
    capsys.readouterr()
    assert main([*common, "--dataset", f"imagefolder:{swapped}", "--out", str(tmp_path / "swapped.pt"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "'0' predicted as '1'" in err and "'1' predicted as '0'" in err and "--class-order" in err
    assert not (tmp_path / "swapped.pt").exists()
    # the order given: the weights' output 0 is this folder's class '1', output 1 its class '0'
    assert main([*common, "--dataset", f"imagefolder:{swapped}", "--out", str(tmp_path / "swapped.pt"),
                 "--class-order", "1,0,2,3,4,5,6,7,8,9", "--quiet", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["top1"] > 50 and any("reordered" in w for w in result["warnings"])


def test_classes_by_name_as_the_service_takes_them():
    from fadrm_ray.cli.common import CLIError, parse_classes

    names = ["cat", "dog", "étoile", "7"]
    assert parse_classes("0,2", names) == [0, 2]
    assert parse_classes("dog,étoile", names) == [1, 2]
    assert parse_classes("7", names) == [3]  # a class named like a number is that class
    with pytest.raises(CLIError, match="'cow' is neither; the dataset's classes are cat, dog"):
        parse_classes("cat,cow", names)
    with pytest.raises(CLIError, match="more than once"):
        parse_classes("cat,0", names)
