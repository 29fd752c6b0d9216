"""``gates``: order, stop at the first failure, JSON shape and exit code (fake gates); a real run of the cheap gates."""

from __future__ import annotations

import json

import pytest

from megatron_consistent.cli import main as cli_main
from megatron_consistent.verify import gates as gates_mod
from megatron_consistent.verify.gates import Gate, GatesConfig, run_all, run_gates


def _fake(calls, status, detail="d"):
    def fn(ctx):
        calls.append(status)
        if status == "raise":
            raise RuntimeError("boom")
        return status, detail

    return fn


def _gates(calls, statuses):
    return [Gate(f"C{i}", f"gate {i}", _fake(calls, s)) for i, s in enumerate(statuses)]


def test_runs_in_order_and_stops_at_first_failure():
    calls = []
    res = run_gates(_gates(calls, ["pass", "skip", "pass", "fail", "pass", "pass"]), ctx=None)
    assert calls == ["pass", "skip", "pass", "fail"]  # nothing after the failure ran
    assert [r["id"] for r in res] == [f"C{i}" for i in range(6)]
    assert [r["status"] for r in res] == ["pass", "skip", "pass", "fail", "skip", "skip"]
    assert all("C3" in r["detail"] for r in res[4:])
    assert all(set(r) >= {"id", "name", "status", "detail"} for r in res)


def test_exception_and_unknown_status_are_failures():
    calls = []
    res = run_gates(_gates(calls, ["raise", "pass"]), ctx=None)
    assert res[0]["status"] == "fail" and "RuntimeError: boom" in res[0]["detail"]
    assert res[1]["status"] == "skip" and calls == ["raise"]
    res = run_gates(_gates([], ["maybe"]), ctx=None)
    assert res[0]["status"] == "fail"


def test_only_selects_gates_without_reordering():
    calls = []
    res = run_gates(_gates(calls, ["pass", "fail", "pass"]), ctx=None, only=["C2", "C0"])
    assert [r["status"] for r in res] == ["pass", "skip", "pass"]
    assert res[1]["detail"] == "not selected"


@pytest.mark.parametrize("statuses, rc", [(["pass", "skip", "pass"], 0), (["pass", "fail", "pass"], 1)])
def test_cli_json_and_exit_code(tmp_path, monkeypatch, capsys, statuses, rc):
    monkeypatch.setattr(gates_mod, "GATES", _gates([], statuses))
    out = tmp_path / "g.json"
    assert cli_main(["gates", "--out-dir", str(tmp_path), "--json", str(out)]) == rc
    report = json.loads(out.read_text())
    assert [g["id"] for g in report["gates"]] == ["C0", "C1", "C2"]
    assert [g["status"] for g in report["gates"]] == (statuses if rc == 0 else ["pass", "fail", "skip"])
    assert "C1" in capsys.readouterr().out


def test_cli_refuses_unknown_gate_id(tmp_path, capsys):
    assert cli_main(["gates", "--only", "C42", "--out-dir", str(tmp_path)]) == 2
    assert "C42" in capsys.readouterr().err


@pytest.mark.slow
def test_real_cheap_gates(tmp_path):
    """C0 (versions recorded) and C1 (kernel sweep, bitwise) for real; C9 skips without CUDA; the rest not selected."""
    report = run_all(GatesConfig(out_dir=str(tmp_path), only=["C0", "C1", "C9"]))
    by_id = {g["id"]: g for g in report["gates"]}
    assert by_id["C0"]["status"] == "pass" and (tmp_path / "environment.json").is_file()
    assert by_id["C1"]["status"] == "pass", by_id["C1"]["detail"]
    import torch

    if not torch.cuda.is_available():
        assert by_id["C9"] == {**by_id["C9"], "status": "skip", "detail": "no CUDA device"}
    assert report["passed"]
    assert [g["id"] for g in report["gates"]] == [f"C{i}" for i in range(11)]
