"""tuning_config: hook answer first, then the platform's default, then the kernel's; cached."""

from __future__ import annotations

from inference_engine import hookimpl
from inference_engine.builtin.platforms.cpu import CpuPlatform
from inference_engine.kernel_tuning import clear_tuning_cache, tuning_config
from inference_engine.plugins import load_plugins, module_with_hooks, reset_plugins

DEFAULT = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "num_warps": 4}


class _TunedCpu(CpuPlatform):
    def kernel_tuning_default(self, op_name, shape):
        return {"num_warps": 2} if op_name == "fp8_gemm" else None


def _with_hook(answer_fn):
    calls = []

    @hookimpl
    def ie_kernel_tuning_config(op_name, platform, shape):
        calls.append((op_name, dict(shape)))
        return answer_fn(op_name, platform, shape)

    plugin = module_with_hooks("tuner", ie_kernel_tuning_config=ie_kernel_tuning_config)
    reset_plugins(load_plugins(extra={"tuner": plugin}, use_entry_points=False))
    clear_tuning_cache()
    return calls


def teardown_function():
    reset_plugins(None)
    clear_tuning_cache()


def test_hook_answer_wins_and_is_laid_over_default():
    _with_hook(lambda op, p, s: {"BLOCK_SIZE_M": 128} if s["M"] > 8 else None)
    got = tuning_config("fp8_gemm", {"M": 64, "N": 8, "K": 8}, DEFAULT, platform=_TunedCpu())
    assert got == {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 32, "num_warps": 4}


def test_platform_default_then_kernel_default():
    _with_hook(lambda op, p, s: None)
    platform = _TunedCpu()
    assert tuning_config("fp8_gemm", {"M": 1}, DEFAULT, platform)["num_warps"] == 2
    assert tuning_config("fused_moe", {"M": 1}, DEFAULT, platform) == DEFAULT


def test_cached_per_op_and_shape_and_copies_returned():
    calls = _with_hook(lambda op, p, s: {"num_warps": 8})
    platform = CpuPlatform()
    first = tuning_config("fused_moe", {"M": 4, "E": 8}, DEFAULT, platform)
    first["num_warps"] = 99  # the caller's copy; the cache must not change
    again = tuning_config("fused_moe", {"E": 8, "M": 4}, DEFAULT, platform)
    assert again["num_warps"] == 8
    tuning_config("fused_moe", {"M": 5, "E": 8}, DEFAULT, platform)
    assert calls == [("fused_moe", {"M": 4, "E": 8}), ("fused_moe", {"M": 5, "E": 8})]


def test_broken_hook_falls_back():
    def boom(op, p, s):
        raise RuntimeError("bad table")

    _with_hook(boom)
    assert tuning_config("fp8_gemm", {"M": 1}, DEFAULT, _TunedCpu())["num_warps"] == 2
