"""benchmarks.cpu_account: CPU of the processes a benchmark started, by kind."""

from __future__ import annotations

import subprocess
import sys
import time

from kvroute.benchmarks import cpu_account


def test_a_busy_child_is_counted_by_kind_and_an_idle_one_is_not():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<3: pass"])
    idle = subprocess.Popen(["sleep", "3"])
    try:
        time.sleep(0.3)
        before, t0 = cpu_account.snapshot(), time.perf_counter()
        assert busy.pid in before and idle.pid in before
        time.sleep(1.5)
        usage = cpu_account.usage(before, cpu_account.snapshot(), time.perf_counter() - t0)
    finally:
        busy.kill()
        idle.kill()
    spinning = sum(v for k, v in usage["by_kind"].items() if k.startswith("python"))
    assert 0.3 < spinning <= 1.1  # one spinning core at most
    assert usage["by_kind"].get("sleep", 0.0) < 0.05
    assert usage["cores"] >= spinning
    assert "cores (" in cpu_account.describe(usage)


def test_a_serve_replica_process_names_its_kind():
    proc = subprocess.Popen([sys.executable, "-c", "import time\ntime.sleep(3)", "serve-replica"])
    try:
        time.sleep(0.3)
        assert cpu_account.kind(proc.pid) == "serve-replica"
    finally:
        proc.kill()
