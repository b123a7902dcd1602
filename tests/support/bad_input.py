"""What the bad-input tests (tests/integration/test_runtime_bad_input_*.py) share: odd
values past parsers' limits and the hypothesis strategies of container input."""

from __future__ import annotations

from hypothesis import strategies as st

from support.runtime import NVD

HUGE = "1" * 5000  # past int()'s 4300-digit limit
ARABIC_ZERO = "\u0660"
SUPERSCRIPT_TWO = "\u00b2"

# any text: every plane, controls, lone surrogates, other scripts' digits
anytext = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
numbers = st.one_of(st.integers(0, 10**6).map(str), st.just(HUGE), st.just(ARABIC_ZERO),
                    st.just(SUPERSCRIPT_TWO), st.text("0123456789" + ARABIC_ZERO + "²:.-,",
                                                      max_size=12))
values = st.one_of(anytext, numbers, st.sampled_from(["all", "none", "void", "0", "1", "0:0",
                                                      "GPU-", "MIG-", "cuda>=12", ""]))
NAMES = [NVD, "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_REQUIRE_CUDA", "NVIDIA_REQUIRE_X",
         "CUDA_VERSION", "NVIDIA_DISABLE_REQUIRE", "NVIDIA_MIG_CONFIG_DEVICES",
         "NVIDIA_MIG_MONITOR_DEVICES", "CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_MEMORY_LIMIT_0",
         "CUDA_DEVICE_SM_LIMIT", "CUDA_DEVICE_SM_LIMIT_1", "NVCTK_VGPU_CONTEXT_RESERVE",
         "CUDA_DEVICE_MEMORY_SHARED_CACHE"]
envs = st.dictionaries(st.one_of(st.sampled_from(NAMES), anytext), values, max_size=6)
