"""A source checkout imports as the whole ``kvroute`` package without being installed.

``ray job submit --working-dir .`` makes a copy of the checkout the job's cwd and puts it
first on ``sys.path``, where its ``kvroute/`` folder (the facade alone) shadows an
installed kvroute; the facade then adds the checkout's root to ``kvroute.__path__`` so
``kvroute.replica`` is ``<copy>/replica`` (kvroute/__init__.py). These tests run Python
on a copy of this working tree in a clean interpreter: no ``site`` processing (so no
``.pth`` file, and no editable install's import finder that would map ``kvroute.*`` back
to this checkout), no user site, no PYTHONPATH; the .venv's site-packages is appended as
a plain path for third-party packages (numpy, ray, ...) only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SITE_PACKAGES = sysconfig.get_paths()["purelib"]
MODULES = ("kvroute.replica", "kvroute.cluster", "kvroute.benchmarks.fleets", "kvroute.benchmarks.sim")
_NOT_COPIED = shutil.ignore_patterns(".git", ".venv", ".venv-vllm", "__pycache__", "results", ".pytest_cache", "build",
                                     "dist", "*.egg-info", "tests")  # fmt: skip

# Run by a clean interpreter: argv[1] is the sys.path to put after the script's own
# sys.path[0] ('' = cwd for -c), then the modules' files and kvroute.__path__ are printed.
_PROBE = """
import importlib, json, sys
sys.path.extend(json.loads(sys.argv[1]))
editable = [f for f in sys.meta_path if "editable" in repr(f).lower()]
files = {m: importlib.import_module(m).__file__ for m in json.loads(sys.argv[2])}
import kvroute
print(json.dumps({"files": files, "path": list(kvroute.__path__), "editable": len(editable), "sys_path0": sys.path[0]}))
"""


def _copy_checkout(dest: Path) -> Path:
    """This working tree as a fresh checkout has it (no .venv, no build outputs, no egg-info)."""
    shutil.copytree(REPO, dest, ignore=_NOT_COPIED)
    return dest


def _probe(cwd: Path, extra_path: list[str]) -> dict:
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONNOUSERSITE": "1", "HOME": str(cwd), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-E", "-s", "-S", "-c", _PROBE, json.dumps(extra_path), json.dumps(MODULES)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_checkout_imports_whole_package_with_no_install(tmp_path):
    """`python -c "import kvroute.benchmarks.fleets"` from a checkout's root, nothing
    installed: every subpackage comes from that checkout."""
    checkout = _copy_checkout(tmp_path / "checkout")
    seen = _probe(checkout, [SITE_PACKAGES])
    assert seen["editable"] == 0 and seen["sys_path0"] == ""  # really no install's finder; cwd first
    assert seen["path"] == [str(checkout / "kvroute"), str(checkout)]
    for module, file in seen["files"].items():
        assert Path(file).is_relative_to(checkout), (module, file)
    assert seen["files"]["kvroute.replica"] == str(checkout / "replica" / "__init__.py")
    assert seen["files"]["kvroute.benchmarks.fleets"] == str(checkout / "benchmarks" / "fleets.py")


def test_installed_wheel_works_and_a_working_dir_copy_shadows_it_whole(tmp_path):
    """A wheel built from the checkout imports from anywhere with ``__path__`` untouched;
    with a checkout copy as cwd (Ray's working_dir) in front of it, every module comes
    from the copy, none from the wheel: no mix of two versions."""
    checkout = _copy_checkout(tmp_path / "checkout")
    build = _copy_checkout(tmp_path / "build")  # setuptools writes build/ and egg-info into its source
    wheel_dir = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_wheel({str(wheel_dir)!r}))"],
        cwd=build, capture_output=True, text=True, timeout=120,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel_dir / built.stdout.strip().splitlines()[-1]) as whl:
        whl.extractall(site)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    installed = _probe(elsewhere, [str(site), SITE_PACKAGES])
    assert installed["path"] == [str(site / "kvroute")]  # no checkout beside an installed package
    for module, file in installed["files"].items():
        assert Path(file).is_relative_to(site / "kvroute"), (module, file)

    shadowed = _probe(checkout, [str(site), SITE_PACKAGES])
    for module, file in shadowed["files"].items():
        assert Path(file).is_relative_to(checkout), (module, file)


def test_source_root_is_recognised_only_beside_pyproject_and_replica(tmp_path):
    """The facade's check itself: a ``kvroute`` folder without a pyproject.toml and a
    ``replica`` package beside it (site-packages, a vendored copy) is left alone."""
    pkg = tmp_path / "kvroute"
    pkg.mkdir()
    shutil.copy(REPO / "kvroute" / "__init__.py", pkg / "__init__.py")
    (tmp_path / "replica").mkdir()
    (tmp_path / "replica" / "__init__.py").write_text("")
    code = "import json, kvroute; print(json.dumps(list(kvroute.__path__)))"
    run = lambda: subprocess.run([sys.executable, "-E", "-s", "-S", "-c", code], cwd=tmp_path,  # noqa: E731
                                 capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
    assert json.loads(run()) == [str(pkg)]
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'kvroute'\n")
    assert json.loads(run()) == [str(pkg), str(tmp_path)]


@pytest.mark.parametrize("module", ["kvroute.replica", "kvroute.router", "kvroute.deploy"])
def test_this_checkout_resolves_to_its_own_folders(module):
    """In this process (editable install, or none) the mapping is pyproject's package-dir."""
    import importlib
    import tomllib

    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert Path(importlib.import_module(module).__file__) == REPO / package_dir[module] / "__init__.py"


# The real `ray job submit --working-dir` of a checkout copy runs on test_ray_cluster_flow.py's
# token-auth cluster (test_ray_job_submit_with_the_checkout_as_working_dir): one `ray start` for both.
