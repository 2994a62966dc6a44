from ragen_async.records.machine import MATRIX_FLAGS, cpu_info

XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""
EPYC = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse avx avx2 fma
"""


def test_the_cpu_s_model_and_matrix_flags_are_read_from_cpuinfo():
    assert cpu_info(XEON) == ("Intel(R) Xeon(R) Platinum 8488C", list(MATRIX_FLAGS))
    assert cpu_info(EPYC) == ("AMD EPYC 7B13", ["avx2"])


def test_without_cpuinfo_the_platform_names_the_cpu():
    model, flags = cpu_info("")
    assert model and flags == []
