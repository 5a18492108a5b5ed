"""What ``dtype: auto`` rests on: the CPU's bf16 matrix units, read from its flags."""

from __future__ import annotations

import distill.hardware
from distill.hardware import bf16_is_fast, cpu_bf16_units

_AVX512_NO_BF16 = ("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni avx512vl\n"
                   "processor\t: 1\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni avx512vl\n")
_SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"


def test_avx512_without_bf16_units_has_none(tmp_path):
    # oneDNN's _is_mkldnn_bf16_supported says True on such a host; its bf16 GEMM is 3.5x slower than float32
    info = tmp_path / "cpuinfo"
    info.write_text(_AVX512_NO_BF16)
    assert cpu_bf16_units(str(info)) == []


def test_avx512_bf16_and_amx_are_named(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(_SAPPHIRE_RAPIDS)
    assert cpu_bf16_units(str(info)) == ["avx512_bf16", "amx_bf16"]


def test_no_cpuinfo_gives_none(tmp_path):
    assert cpu_bf16_units(str(tmp_path / "absent")) is None


def test_auto_follows_the_flags_on_cpu(monkeypatch):
    monkeypatch.setattr(distill.hardware, "cpu_bf16_units", lambda cpuinfo="/proc/cpuinfo": [])
    assert not bf16_is_fast("cpu")
    monkeypatch.setattr(distill.hardware, "cpu_bf16_units", lambda cpuinfo="/proc/cpuinfo": ["amx_bf16"])
    assert bf16_is_fast("cpu")
