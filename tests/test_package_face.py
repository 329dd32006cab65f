"""The package's face: `fadrm_ray.__all__` (and `fadrm_ray.evaluation.__all__`, the sweeps'
`tune.__all__` and the service's `api.__all__`) is the public API, every name resolves, `import
fadrm_ray` (and `import tune`, `import api`) stays light, and the README's Python example runs as
written (only its sizes made tiny)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

import api
import fadrm_ray
import fadrm_ray.evaluation
import tune

README = Path(fadrm_ray.__file__).parent.parent / "README.md"
FACES = (fadrm_ray, fadrm_ray.evaluation, tune, api)
# The README example's sizes, each made tiny; every one must be found exactly once in the example.
TINY = (("SqueezeConfig(epochs=8)", "SqueezeConfig(epochs=1)"),
        ('overrides={"iterations": 500}', 'overrides={"iterations": 4}'),
        ("ipc=5)", "ipc=1)"),
        ("EvalConfig(seeds=2)", "EvalConfig(seeds=1, epochs=1)"))


def readme_example() -> str:
    """The Python block under the README's "In Python" heading."""
    section = README.read_text().split("## In Python", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README: no python block under 'In Python'"
    return match.group(1)


@pytest.mark.parametrize("face", FACES, ids=lambda m: m.__name__)
def test_every_public_name_resolves(face):
    assert face.__all__ and len(set(face.__all__)) == len(face.__all__)
    for name in face.__all__:
        assert getattr(face, name) is not None, f"{face.__name__}.{name}"
        assert name in dir(face)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        face.not_a_name  # noqa: B018


@pytest.mark.parametrize("face", FACES, ids=lambda m: m.__name__)
def test_no_public_name_is_a_submodule(face):
    """Importing a submodule sets it on its package, which would hide a public name of the same name."""
    package = Path(face.__file__).parent
    submodules = {p.stem for p in package.glob("*.py")} | {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    assert {"config", "training", "sweep", "client"} & submodules  # the folder is read
    assert not set(face.__all__) & submodules


def test_the_readme_example_imports_from_the_face_only():
    code = readme_example()
    imports = re.findall(r"^(?:from|import) (\S+)", code, re.M)
    assert imports == ["fadrm_ray"]
    imported = re.search(r"from fadrm_ray import \((.*?)\)", code, re.S).group(1)
    assert {n.strip() for n in imported.split(",")} <= set(fadrm_ray.__all__)


def test_importing_the_package_loads_neither_torch_nor_ray():
    code = ("import sys, fadrm_ray, fadrm_ray.evaluation, tune, api; "
            "print(sorted({'torch', 'ray', 'fastapi'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=README.parent).stdout
    assert out.strip() == "[]"


def test_the_readme_example_runs(tmp_path, monkeypatch, capsys):
    code = readme_example()
    for old, new in TINY:
        assert code.count(old) == 1, f"README example: {old!r} not found once"
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, str(README) + ":In Python", "exec"), namespace)
    run, images = namespace["run"], namespace["images"]
    assert run.images == 10 and images.shape[0] == 10 and str(images.dtype) == "torch.uint8"
    assert Path(run.run_dir).resolve().parent == (tmp_path / "store").resolve()
    assert (tmp_path / "teacher" / "teacher.pt").is_file()
    assert len(list((tmp_path / "digits-ipc5").glob("*/*.png"))) == 10
    top1 = float(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.0 <= top1 <= 100.0
