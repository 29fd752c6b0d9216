"""The plugin's version adapter accepts exactly the tested vLLM builds and refuses the rest by name."""

from __future__ import annotations

import pytest

from megatron_consistent.config import UnsupportedConfigError
from megatron_consistent.vllm_plugin.compat import TESTED_VLLM, check_platform


@pytest.mark.parametrize("device, version", [("cpu", "0.32.0"), ("cpu", "0.32.0+cpu"), ("cuda", "0.26.0"), ("cuda", "0.26.0+cu130")])
def test_tested_versions_accepted(device, version):
    check_platform(device, version)


@pytest.mark.parametrize("device, version", [("cuda", "0.25.1"), ("cuda", "0.32.0"), ("cpu", "0.26.0"), ("cpu", "0.33.0")])
def test_untested_version_refused_with_the_tested_range(device, version):
    with pytest.raises(UnsupportedConfigError) as e:
        check_platform(device, version)
    msg = str(e.value)
    assert version in msg and "untested" in msg
    assert all(v in msg for vs in TESTED_VLLM.values() for v in vs)


def test_untested_platform_refused_by_name():
    with pytest.raises(UnsupportedConfigError, match="'xpu' is not supported"):
        check_platform("xpu", "0.26.0")
