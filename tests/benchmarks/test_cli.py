"""The one benchmark command: `kvroute bench` lists every benchmark, each builds its
parser from the shared groups, and a benchmark runs through it (and its old module path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvroute.benchmarks import cli
from kvroute.deploy.cli import main as kvroute_main


def test_bench_without_a_name_lists_every_benchmark(capsys):
    assert kvroute_main(["bench"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in cli.BENCHMARKS)


@pytest.mark.parametrize("name", sorted(cli.BENCHMARKS))
def test_every_benchmark_builds_its_parser_with_one_output_rule(name):
    parser = cli.parser_for(name, cli.load(name))
    dests = {a.dest for a in parser._actions}  # noqa: SLF001
    assert dests & {"out", "out_dir"}, f"{name} has neither --out nor --out-dir"


def test_an_unknown_benchmark_is_refused_with_the_list(capsys):
    assert cli.main(["no_such_bench"]) == 2
    assert "offline" in capsys.readouterr().err


def test_a_benchmark_runs_by_name_and_by_its_module_path(tmp_path):
    argv = ["--blocks", "4096", "--request-blocks", "16", "--routes", "200", "--warmup", "10", "--replicas", "4",
            "--churn-blocks-per-replica", "64"]  # fmt: skip
    assert kvroute_main(["bench", "router_overhead", *argv, "--out", str(tmp_path / "a.json")]) == 0
    env_out = tmp_path / "results"
    subprocess.run([sys.executable, "-m", "kvroute.benchmarks.router_overhead", *argv], check=True, capture_output=True,
                   env={**os.environ, "KVROUTE_RESULTS": str(env_out)})  # fmt: skip
    a, b = json.loads((tmp_path / "a.json").read_text()), json.loads((env_out / "router_overhead.json").read_text())
    assert a["benchmark"] == b["benchmark"] == "router_overhead"
    assert a["directory_blocks"] == b["directory_blocks"] > 0
