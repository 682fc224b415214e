"""bench timing's kernel profile, as reported: profiler names made short, one table of kernels × methods."""

from bench.timing_report import kernel_table
from bench.timing_run import kernel_name


def test_kernel_names_are_the_package_kernels_module_and_function():
    assert kernel_name("fathom::cuda::topk::_candidates_kernel[abi:v64][abi:cw51cXTL]") == "topk._candidates_kernel"
    assert kernel_name("fathom::cuda::scan::_scan_kernel::_3clocals_3e::kernel[abi:v1]") == "scan._scan_kernel"
    assert kernel_name("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long)") == \
        "void at::native::vectorized_gather_kernel<16, long>(char*, c"


def test_the_kernel_table_puts_the_largest_first_and_sums_every_kernel():
    table = kernel_table({"fathom@48": {"scan._scan_kernel": 4387.0, "topk._ties_kernel": 2172.0, "copy": 2.0},
                          "double-sparsity@136": {"scan._scan_kernel": 9378.0, "copy": 3.0}}).splitlines()
    assert table[0] == "| kernel | fathom@48 | double-sparsity@136 |"
    assert [line.split(" | ")[0] for line in table[2:]] == ["| scan._scan_kernel", "| topk._ties_kernel", "| copy",
                                                           "| all kernels"]
    assert table[3] == "| topk._ties_kernel | 2172 | — |" and table[-1] == "| all kernels | 6561 | 9381 |"
