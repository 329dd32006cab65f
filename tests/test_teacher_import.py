"""`fadrm import-teacher`: torchvision and timm classifiers trained outside the project (plain
PyTorch loops here, their weights saved locally) become teachers whose logits are the original
models', and weights that cannot make a teacher are refused in one line with nothing written."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import pytest

from fadrm_ray.cli import main
from fadrm_ray.models import load_teacher
from fadrm_ray.runtime import torch_threads


def _train_outside(model: torch.nn.Module, digits, steps: int, seed: int = 0) -> torch.nn.Module:
    """A few Adam steps on digits' training images (repeated to 3 channels): a model trained by
    someone else's code, as any user's would be."""
    torch.manual_seed(seed)
    x = digits.normalize(digits.train.load(torch.arange(len(digits.train)))).expand(-1, 3, -1, -1).contiguous()
    y = digits.train.labels
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        i = torch.randint(0, len(y), (64,), generator=gen)
        loss = F.cross_entropy(model(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def torchvision_weights(digits, tmp_path_factory):
    """A torchvision ResNet-18 trained on digits (with digits' mean/std), saved as a plain `.pth`
    state dict. Long enough for its BatchNorm running statistics to settle: an eval-mode model
    whose statistics are still at their initial values scores at random under any normalization."""
    from torchvision.models import resnet18

    with torch_threads(1):
        model = _train_outside(resnet18(num_classes=10), digits, steps=60)
    path = tmp_path_factory.mktemp("tv") / "r18-digits.pth"
    torch.save(model.state_dict(), path)
    return path, model


@pytest.fixture(scope="module")
def timm_weights(digits, tmp_path_factory):
    """A small timm ResNet trained briefly on digits, saved as `.safetensors`."""
    import timm
    from safetensors.torch import save_file

    with torch_threads(1):
        model = _train_outside(timm.create_model("test_resnet", num_classes=10), digits, steps=40)
    path = tmp_path_factory.mktemp("timm") / "test-resnet-digits.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path, model


def _logits_gap(teacher_path, original, digits) -> float:
    teacher, info = load_teacher(teacher_path)
    # The teacher normalizes with the mean/std it recorded; the original was trained with digits'.
    x = digits.test.load(torch.arange(64))
    mean = torch.tensor(info.mean).view(1, -1, 1, 1)
    std = torch.tensor(info.std).view(1, -1, 1, 1)
    with torch.no_grad():
        ours = teacher((x.float() / 255 - mean).div(std).expand(-1, 3, -1, -1))
        theirs = original(digits.normalize(x).expand(-1, 3, -1, -1))
    return float((ours - theirs).abs().max())


def test_torchvision_state_dict_round_trip(torchvision_weights, digits, tmp_path, capsys):
    path, original = torchvision_weights
    out = tmp_path / "teachers" / "r18.pt"
    assert main(["import-teacher", "--model", "torchvision:resnet18", "--weights", str(path), "--dataset", "digits",
                 "--out", str(out), "--eval-images", "200"]) == 0
    said = capsys.readouterr().out
    # No metadata in the file: both normalizations are measured and the one it was trained with wins.
    assert "normalization: mean [0.306] std [0.3763], from measured: the dataset's own statistics (digits)" in said
    assert "ImageNet's mean/std, averaged over its 3 channels for grey images: mean [0.449] std [0.226]" in said
    assert _logits_gap(out, original, digits) <= 1e-5
    _, info = load_teacher(out)
    assert info.model_name == "torchvision:resnet18" and info.class_names == digits.class_names
    assert info.imported.eval_images == 200 and info.test_accuracy > info.imported.chance


def test_timm_safetensors_round_trip(timm_weights, digits, tmp_path, capsys):
    import json

    path, original = timm_weights
    out = tmp_path / "timm.pt"
    # timm's pretrained config of test_resnet carries an RGB mean/std: the digits' own are given as flags.
    assert main(["import-teacher", "--model", "timm:test_resnet", "--weights", str(path), "--dataset", "digits",
                 "--out", str(out), "--mean", str(digits.mean[0]), "--std", str(digits.std[0]), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["record"]["normalization"] == "flags"
    assert result["record"]["eval_images"] == len(digits.test)
    assert _logits_gap(out, original, digits) <= 1e-5


def test_own_model_state_dict(digits_teacher, digits, tmp_path):
    """A plain state dict of a model the project builds (here a convnet-bn's) with its builder's keywords."""
    teacher, info = load_teacher(digits_teacher[0])
    weights = tmp_path / "convnet.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in teacher.state_dict().items()}}, weights)
    out = tmp_path / "convnet.pt"
    assert main(["import-teacher", "--model", "convnet-bn", "--model-arg", "width=32", "--weights", str(weights),
                 "--dataset", "digits", "--out", str(out), "--quiet"]) == 0
    imported, _ = load_teacher(out)
    x = digits.normalize(digits.test.load(torch.arange(32)))
    assert torch.equal(imported(x), teacher(x))


def test_an_import_reads_its_test_images_once_per_normalization(digits_teacher, tmp_path, monkeypatch,
                                                                 decodes_counted):
    """One pass over the test sample per normalization measured: its confusion counts give the
    top-1 and, for the one kept, the class-order check (counted, not timed)."""
    from fadrm_ray import teacher_import
    from fadrm_ray.teacher_import import ImportSettings, import_teacher

    teacher, _ = load_teacher(digits_teacher[0])
    weights = tmp_path / "convnet.pth"
    torch.save(teacher.state_dict(), weights)
    decoded = []
    sample = teacher_import.spread_sample

    def counted(*args, **kwargs):
        split = sample(*args, **kwargs)
        decoded.append(decodes_counted(split))
        return split

    monkeypatch.setattr(teacher_import, "spread_sample", counted)
    result = import_teacher(ImportSettings(model="convnet-bn", model_kwargs={"width": 32}, weights=str(weights),
                                           dataset="digits", out=str(tmp_path / "t.pt"), eval_images=100))
    assert result.record.normalization and not result.record.measured  # one normalization: the dataset's own
    assert sum(map(sum, decoded)) == result.record.eval_images == 100 and result.top1 > 50


def _refused(capsys, argv, out) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert not out.exists()
    return err


def test_wrong_class_count_from_torch_hub_cache(tmp_path, monkeypatch, capsys):
    """torchvision's IMAGENET1K_V1 taken from torch hub's cache (saved here: no network), metadata
    read from torchvision's enum, then refused: 1000 classes for a 10-class dataset."""
    from torchvision.models import resnet18

    hub = tmp_path / "torch-home"
    (hub / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(resnet18().state_dict(), hub / "hub" / "checkpoints" / "resnet18-f37072fd.pth")
    monkeypatch.setenv("TORCH_HOME", str(hub))
    out = tmp_path / "r18.pt"
    err = _refused(capsys, ["import-teacher", "--model", "torchvision:resnet18", "--weights", "IMAGENET1K_V1",
                            "--dataset", "digits", "--out", str(out)], out)
    assert "the weights have 1000 classes (fc.weight), dataset digits has 10" in err
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    monkeypatch.setenv("FADRM_OFFLINE", "1")
    err = _refused(capsys, ["import-teacher", "--model", "torchvision:resnet18", "--weights", "IMAGENET1K_V1",
                            "--dataset", "digits", "--out", str(out)], out)
    assert "not in torch hub's cache" in err and "resnet18-f37072fd.pth" in err


def test_wrong_weights_refused(torchvision_weights, timm_weights, tmp_path, capsys):
    out = tmp_path / "t.pt"
    err = _refused(capsys, ["import-teacher", "--model", "torchvision:resnet34", "--weights", str(torchvision_weights[0]),
                            "--dataset", "digits", "--out", str(out)], out)
    assert "do not fit torchvision:resnet34" in err and "tensors missing" in err
    err = _refused(capsys, ["import-teacher", "--model", "torchvision:resnet18", "--weights", str(timm_weights[0]),
                            "--dataset", "digits", "--out", str(out)], out)
    assert "do not fit torchvision:resnet18" in err
    pickle = tmp_path / "code.pth"
    torch.save({"model": torch.nn.Linear(2, 2)}, pickle)  # a whole module: only an unsafe load would read it
    err = _refused(capsys, ["import-teacher", "--model", "torchvision:resnet18", "--weights", str(pickle),
                            "--dataset", "digits", "--out", str(out)], out)
    assert "nothing in the file is run" in err


def test_class_order_that_differs_is_refused_at_chance(torchvision_weights, tmp_path, capsys):
    """The same weights with the classifier's rows rotated by one: a class order that is not the
    dataset's. Its top-1 is far below the bar, so no teacher is written."""
    path, _ = torchvision_weights
    state = torch.load(path, weights_only=True)
    state["fc.weight"] = state["fc.weight"].roll(1, dims=0)
    state["fc.bias"] = state["fc.bias"].roll(1, dims=0)
    rotated = tmp_path / "rotated.pth"
    torch.save(state, rotated)
    out = tmp_path / "t.pt"
    err = _refused(capsys, ["import-teacher", "--model", "torchvision:resnet18", "--weights", str(rotated),
                            "--dataset", "digits", "--out", str(out)], out)
    assert "chance 10.00%" in err and "class order or normalization does not fit" in err
    assert main(["import-teacher", "--model", "torchvision:resnet18", "--weights", str(rotated), "--dataset", "digits",
                 "--out", str(out), "--accept-chance", "--quiet"]) == 0
    assert out.is_file()


def test_imported_teacher_distills_and_sets_the_normalization(torchvision_weights, digits, tmp_path, one_thread):
    """An imported teacher distills like a squeezed one, and its recorded mean/std (here given as
    flags) is the normalization every phase uses for it (`models.teacher_view`)."""
    from fadrm_ray.config import make_config
    from fadrm_ray.runs import execute
    from fadrm_ray.runs.job import ExecutionSpec, prepare_job
    from fadrm_ray.store import open_run
    from fadrm_ray.teacher_import import ImportSettings, import_teacher

    out = tmp_path / "r18.pt"
    result = import_teacher(ImportSettings(model="torchvision:resnet18", weights=str(torchvision_weights[0]),
                                           dataset="digits", out=str(out), mean=(0.3,), std=(0.4,), eval_images=100,
                                           accept_chance=True))
    assert result.mean == (0.3,) and result.record.normalization == "flags"
    cfg = make_config("fadrm", overrides={"ipc": 1, "iterations": 2, "precision": "fp32"}, classes=[0, 1])
    spec = ExecutionSpec(local=True, device="cpu", progress=False)
    job, parts = prepare_job(cfg, digits, "digits", [out], tmp_path / "store", device_type=execute.device_type(spec))
    run = execute.run(job, spec, parts)
    reader = open_run(run.run_dir)
    assert reader.provenance.dataset.mean == [0.3] and reader.provenance.dataset.std == [0.4]
    assert reader.read()[0].shape[0] == 2


@pytest.mark.ray
def test_the_service_offers_and_distills_with_an_imported_teacher(api_service, torchvision_weights, tmp_path):
    """An imported teacher dropped into the service's teacher folder is listed by /v1/teachers and
    distills a class subset over real HTTP like a squeezed one."""
    from tests.api_helpers import request, wait_state

    out = api_service.teachers / "digits-r18-imported.pt"
    assert main(["import-teacher", "--model", "torchvision:resnet18", "--weights", str(torchvision_weights[0]),
                 "--dataset", "digits", "--out", str(out), "--eval-images", "100", "--quiet"]) == 0
    try:
        with api_service.client() as client:
            listed = {t["name"]: t for t in client.get("/v1/teachers").json()}
            assert listed["digits-r18-imported"]["model"] == "torchvision:resnet18"
            assert listed["digits-r18-imported"]["test_accuracy"] > 10
            body = {**request(classes=[5], ipc=1, seed=31, iterations=4), "teacher": "digits-r18-imported"}
            job = client.post("/v1/distillations", json=body).json()
            done = wait_state(client, job["id"])
            assert done["state"] == "succeeded", done
            data = client.get(f"/v1/distillations/{job['id']}/dataset")
            assert data.status_code == 200 and data.content[:4] == b"PAR1"
    finally:
        out.unlink()


def _colour_folder(root, classes: int = 4, per_class: int = (40, 15), size: int = 32):
    """An ImageNet-shaped folder (train/<class>/, val/<class>/) of bright, low-contrast colour
    images whose class is a small shift of hue: its own statistics are far from ImageNet's."""
    from PIL import Image

    gen = torch.Generator().manual_seed(5)
    for split, count in zip(("train", "val"), per_class):
        for c in range(classes):
            folder = root / split / f"n0000{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                base = torch.full((3, 1, 1), 0.82)
                base[c % 3] += 0.06 * (1 if c < 3 else -1)
                x = (base + 0.03 * torch.randn(3, size, size, generator=gen)).clamp(0, 1)
                Image.fromarray((x * 255).round().byte().permute(1, 2, 0).numpy()).save(folder / f"{i}.png")
    return root


def test_a_torchvision_model_trained_with_imagenet_statistics_is_imported_at_its_own_top1(tmp_path, capsys):
    """A user's torchvision ResNet-18 trained by a plain loop on their colour folder with the usual
    ImageNet mean/std, its state dict carrying no metadata: imported without flags, the teacher
    normalizes as it was trained and scores what the model scores, and the output says why."""
    import json

    from torchvision.models import resnet18

    from fadrm_ray.data import get_dataset

    folder = _colour_folder(tmp_path / "colour")
    data = get_dataset(f"imagefolder:{folder}")
    mean, std = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    x = (data.train.load(torch.arange(len(data.train))).float() / 255 - mean) / std
    y = data.train.labels
    torch.manual_seed(0)
    model = resnet18(num_classes=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with torch_threads(2):
        for step in range(60):
            i = torch.randint(0, len(y), (32,), generator=torch.Generator().manual_seed(step))
            loss = F.cross_entropy(model(x[i]), y[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            xt = (data.test.load(torch.arange(len(data.test))).float() / 255 - mean) / std
            own = 100.0 * float((model(xt).argmax(1) == data.test.labels).float().mean())
    weights = tmp_path / "r18-colour.pth"
    torch.save(model.state_dict(), weights)
    out = tmp_path / "r18.pt"
    assert main(["import-teacher", "--model", "torchvision:resnet18", "--weights", str(weights), "--dataset",
                 f"imagefolder:{folder}", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["top1"] == pytest.approx(own, abs=1e-6) and own > 60
    assert result["mean"] == pytest.approx([0.485, 0.456, 0.406])
    record = result["record"]
    assert record["normalization"].startswith("measured: ImageNet's mean/std")
    kept, other = record["measured"]
    assert other["name"].startswith("the dataset's own statistics") and other["top1"] < kept["top1"] - 10
    assert any("the normalization matters" in w for w in result["warnings"])
    _, info = load_teacher(out)
    assert info.mean == pytest.approx((0.485, 0.456, 0.406)) and info.test_accuracy == pytest.approx(own)


def _swapped_state(digits_teacher) -> tuple[dict, list[str], torch.nn.Module]:
    """The digits teacher's weights with the outputs of its first two classes swapped, the class
    name of each output in that order, and the teacher itself."""
    from fadrm_ray.teacher_import import _classifier

    teacher, info = load_teacher(digits_teacher[0])
    head = _classifier(teacher)
    state = {k: v.clone().contiguous() for k, v in teacher.state_dict().items()}
    for key in (f"{head}.weight", f"{head}.bias"):
        state[key][[0, 1]] = state[key][[1, 0]]
    names = list(info.class_names)
    return state, [names[1], names[0], *names[2:]], teacher


def _imported_logits(out, digits) -> torch.Tensor:
    imported, _ = load_teacher(out)
    return imported(digits.normalize(digits.test.load(torch.arange(64))))


def test_a_swapped_teacher_is_reordered_by_the_class_names_of_its_safetensors_metadata(digits_teacher, digits,
                                                                                       tmp_path, capsys):
    import json

    from safetensors.torch import save_file

    state, names, teacher = _swapped_state(digits_teacher)
    bare, named = tmp_path / "bare.safetensors", tmp_path / "named.safetensors"
    save_file(state, str(bare))
    save_file(state, str(named), metadata={"class_names": json.dumps(names)})
    common = ["import-teacher", "--model", "convnet-bn", "--model-arg", "width=32", "--dataset", "digits", "--quiet"]
    # Without names, the swap is refused by the confusion check; with them, the outputs are reordered.
    assert main([*common, "--weights", str(bare), "--out", str(tmp_path / "bare.pt")]) == 2
    assert "take whole classes for one another" in capsys.readouterr().err
    assert main([*common, "--weights", str(named), "--out", str(tmp_path / "named.pt")]) == 0
    said = capsys.readouterr().out
    assert "reordered to the dataset's class order by the class names in the 'class_names' key of its " \
           "safetensors metadata (2 classes moved)" in said
    x = digits.normalize(digits.test.load(torch.arange(64)))
    assert torch.equal(_imported_logits(tmp_path / "named.pt", digits), teacher(x))


def test_timm_export_label_names_reorder_a_swapped_teacher_and_bad_names_are_refused(digits_teacher, digits,
                                                                                     tmp_path, capsys):
    """timm's own convention: `save_for_hf` writes config.json with `label_names` beside the weights."""
    import json

    from safetensors.torch import save_file

    state, names, teacher = _swapped_state(digits_teacher)
    export = tmp_path / "export"
    export.mkdir()
    save_file(state, str(export / "model.safetensors"))
    (export / "config.json").write_text(json.dumps({"architecture": "convnet", "num_classes": 10,
                                                    "label_names": {str(i): n for i, n in enumerate(names)}}))
    common = ["import-teacher", "--model", "convnet-bn", "--model-arg", "width=32", "--dataset", "digits", "--quiet"]
    assert main([*common, "--weights", str(export / "model.safetensors"), "--out", str(tmp_path / "t.pt")]) == 0
    assert "by the class names in the 'label_names' of timm's config.json beside it" in capsys.readouterr().out
    x = digits.normalize(digits.test.load(torch.arange(64)))
    assert torch.equal(_imported_logits(tmp_path / "t.pt", digits), teacher(x))
    broken = tmp_path / "broken.safetensors"
    save_file(state, str(broken), metadata={"class_names": "0,1,2"})  # not a JSON list
    assert main([*common, "--weights", str(broken), "--out", str(tmp_path / "b.pt")]) == 2
    assert "must be a list of class names in output order" in capsys.readouterr().err
    assert not (tmp_path / "b.pt").exists()
