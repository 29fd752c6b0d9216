"""Engine runs take their descendants with them (``verify/processes.py``, ``verify/launcher.py``).

A stand-in "engine" starts a grandchild (as vLLM starts its engine core) and then hangs or exits: past the timeout the
run reports None / an error naming the timeout, and in every case the grandchild is gone afterwards -- killing only
the process we started (``subprocess.run(timeout=...)``) would leave it running, which these tests catch.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from megatron_consistent.verify.processes import run_group

ENGINE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[1], "w").write(str(child.pid))
print("engine core started", flush=True)
if sys.argv[2] == "hang":
    time.sleep(300)
"""


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a killed orphan may wait for a reaper that never comes in a container)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _running(pid)


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to see the grandchild")


@pytest.mark.parametrize("behaviour", ["hang", "exit"])
def test_run_group_kills_the_grandchild_after_a_timeout_or_an_exit(tmp_path, behaviour):
    script, pid_file, log = tmp_path / "engine.py", tmp_path / "pid", tmp_path / "log"
    script.write_text(ENGINE)
    start = time.monotonic()
    # an exiting engine gets room on a loaded 2-core machine (its Python start-up once took over 5 s in CI)
    rc = run_group([sys.executable, str(script), str(pid_file), behaviour], log, timeout_s=5.0 if behaviour == "hang" else 40.0)
    assert rc == (None if behaviour == "hang" else 0)
    assert time.monotonic() - start < 60 and "engine core started" in log.read_text()
    assert _wait_gone(int(pid_file.read_text())), "the engine's own child outlived the run"


def test_run_module_reports_a_hung_engine_and_kills_it(tmp_path, monkeypatch):
    """``check``'s engine runs: a module that never writes its result is cut at the timeout with a one-line reason."""
    from megatron_consistent.verify import rollout

    (tmp_path / "hung_engine_module.py").write_text(
        "import subprocess, sys, time\n"
        "def main(argv=None):\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"    open({str(tmp_path / 'pid')!r}, 'w').write(str(child.pid))\n"
        "    time.sleep(300)\n"
        "if __name__ == '__main__':\n"
        "    main()\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + str(Path(__file__).resolve().parents[1]))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the plain process path (the forked one: next test)
    res = rollout.run_module("hung_engine_module", {}, tmp_path / "engines", "hung", {}, timeout_s=5.0)
    assert "gave no result in 5 s" in res["error"] and "\n" not in res["error"]
    assert _wait_gone(int((tmp_path / "pid").read_text()))


def test_forked_engine_run_is_cut_with_its_children(tmp_path, monkeypatch):
    """The CPU path that forks engine runs from the warm launcher: same timeout, same cleanup (forked here from this
    process instead of the launcher that preloads vLLM: the run's own code, ``launcher._run``, is the same)."""
    import multiprocessing as mp

    from megatron_consistent.verify import launcher

    module_dir = tmp_path / "mods"
    module_dir.mkdir()
    (module_dir / "hung_forked_module.py").write_text(
        "import subprocess, sys, time\n"
        "def main(argv):\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "    open(argv[0], 'w').write(str(child.pid))\n"
        "    time.sleep(300)\n")
    monkeypatch.syspath_prepend(str(module_dir))
    monkeypatch.setattr(launcher, "_CONTEXT", mp.get_context("fork"))
    env = {"PATH": "/usr/bin:/bin"}
    rc = launcher.run_forked("hung_forked_module", [str(tmp_path / "pid")], env, str(tmp_path / "log"), timeout_s=5.0)
    assert rc is None
    assert _wait_gone(int((tmp_path / "pid").read_text()))
