"""``MC_LOG_SPECIALIZATIONS`` (kernels/triton/compile_log.py): a line per Triton binary of this package's kernels, other
packages' kernels left alone, a hook installed before still called, installing twice one hook."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

triton = pytest.importorskip("triton")

from megatron_consistent.kernels.triton import compile_log  # noqa: E402


def _compile_info(constants):
    return {"key": "k", "constants": constants, "num_warps": 4}


def _fn(module, params=("Q", "NSEQ", "MODE", "BLOCK_M")):
    jit = SimpleNamespace(params=[SimpleNamespace(name=p) for p in params])
    return SimpleNamespace(module=module, name="_attn_kernel", jit_function=jit)


def test_a_line_names_our_kernel_and_its_constexprs():
    line = compile_log.specialization_line(
        key="k", repr="_attn_kernel[num_warps=4](NSEQ: i32, sqt: D)", fn=_fn("megatron_consistent.kernels.triton.attention"),
        compile=_compile_info({(2,): 1, (3,): 16}), is_manual_warmup=False,
        already_compiled=False)
    assert line.startswith(compile_log.PREFIX + " megatron_consistent.kernels.triton.attention._attn_kernel[")
    assert "(NSEQ: i32, sqt: D)" in line and "'MODE': 1" in line and "'BLOCK_M': 16" in line


@pytest.mark.parametrize("module", ["vllm.v1.attention.ops.triton_unified_attention", "megatron_consistent_fork.x", ""])
def test_other_packages_kernels_are_not_logged(module):
    assert compile_log.specialization_line(repr="k[]()", fn=_fn(module), compile=_compile_info({})) is None


def test_install_chains_the_hook_before_it_once(monkeypatch, capsys):
    runtime = triton.knobs.runtime
    seen = []
    monkeypatch.setattr(runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw["repr"]))
    compile_log.install()
    compile_log.install()  # idempotent: one logging hook, the earlier one still behind it
    kwargs = dict(key="k", repr="_rms_kernel[num_warps=4]()", fn=_fn("megatron_consistent.kernels.triton.rms_norm"),
                  compile=_compile_info({}), is_manual_warmup=False, already_compiled=False)
    runtime.jit_post_compile_hook(**kwargs)
    assert seen == ["_rms_kernel[num_warps=4]()"]
    assert capsys.readouterr().err.count(compile_log.PREFIX) == 1
    runtime.jit_post_compile_hook(**dict(kwargs, fn=_fn("vllm.x")))
    assert seen == ["_rms_kernel[num_warps=4]()"] * 2 and compile_log.PREFIX not in capsys.readouterr().err
