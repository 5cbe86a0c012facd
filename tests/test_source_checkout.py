"""Running from a source checkout: the repository's top-level ``kernels/`` folder (installed
as ``specjax.kernels``) must not shadow the Hugging Face ``kernels`` package, which
transformers >= 5.25 imports with its activations."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import specjax, kernels, specjax.kernels.cpu_build as ours
print(kernels.__file__)
print(getattr(kernels, "CUDAProperties", None))
print(ours.__file__)
"""


def _probe(pythonpath: str) -> list[str]:
    # python -c puts the working directory (here the checkout's root) first on sys.path,
    # as `python -m specjax.cli` and pytest's rootdir do.
    env = {**os.environ, "PYTHONPATH": pythonpath, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split("\n")


def test_an_installed_hub_kernels_package_wins_over_the_checkouts_folder(tmp_path):
    hub = tmp_path / "site" / "kernels"
    hub.mkdir(parents=True)
    (hub / "__init__.py").write_text("CUDAProperties = 'hub'\n")
    where, attr, ours = _probe(str(tmp_path / "site"))[:3]
    assert Path(where).resolve() == (hub / "__init__.py").resolve()
    assert attr == "hub"
    assert Path(ours).resolve() == REPO / "kernels" / "cpu_build.py"  # specjax's own


def test_without_one_on_the_path_the_folder_imports_as_before(tmp_path):
    where, _, _ = _probe(str(tmp_path))[:3]
    try:  # transformers >= 5.25 installs the package; the lock's 5.23 does not
        hub = Path(importlib.metadata.distribution("kernels").locate_file("kernels"))
    except importlib.metadata.PackageNotFoundError:
        hub = REPO / "kernels"
    assert Path(where).resolve() == (hub / "__init__.py").resolve()
