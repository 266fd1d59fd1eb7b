"""bench/step.py ``cpu_model``: the model name the benchmarks write beside the CPU's flags."""

from __future__ import annotations

from bench.step import cpu_model

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model\t\t: 17
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu avx2 avx512f
vmx flags\t: vnmi

processor\t: 1
model name\t: another
"""


def test_the_first_processors_model_name() -> None:
    assert cpu_model(CPUINFO) == "AMD EPYC 9R14 96-Core Processor"  # not "model"'s 17, not the second's


def test_no_model_name_is_empty() -> None:
    assert cpu_model("processor : 0\nFeatures : fp asimd\n") == ""


def test_this_machines_name_is_read() -> None:
    assert isinstance(cpu_model(), str)
