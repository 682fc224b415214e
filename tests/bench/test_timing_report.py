"""bench timing's reports: profiler names made short, one table of kernels × methods, the README's throughput
section made from the committed runs."""

import json
import re

from bench.__main__ import main
from bench.report import RESULTS
from bench.timing_report import PEERS, THROUGHPUT_END, THROUGHPUT_START, kernel_table, markdown, throughput_table
from bench.timing_run import kernel_name


def test_kernel_names_are_the_package_kernels_module_and_function():
    assert kernel_name("fathom::cuda::topk::_candidates_kernel[abi:v64][abi:cw51cXTL]") == "topk._candidates_kernel"
    assert kernel_name("fathom::cuda::scan::_scan_kernel::_3clocals_3e::kernel[abi:v1]") == "scan._scan_kernel"
    assert kernel_name("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long)") == \
        "void at::native::vectorized_gather_kernel<16, long>(char*, c"


def test_a_run_whose_scans_read_tables_says_so_and_a_midpoint_run_says_nothing():
    payload = json.loads((RESULTS / "timing-kernels-128k-h100.json").read_text())
    assert "The plane scans read" not in markdown(payload)  # made before the field: the midpoints
    payload["scan_reads"] = "reconstruction tables (the midpoints as tables)"
    assert "The plane scans read reconstruction tables (the midpoints as tables)." in markdown(payload).split("\n")[0]


def test_the_kernel_table_puts_the_largest_first_and_sums_every_kernel():
    table = kernel_table({"fathom@48": {"scan._scan_kernel": 4387.0, "topk._ties_kernel": 2172.0, "copy": 2.0},
                          "double-sparsity@136": {"scan._scan_kernel": 9378.0, "copy": 3.0}}).splitlines()
    assert table[0] == "| kernel | fathom@48 | double-sparsity@136 |"
    assert [line.split(" | ")[0] for line in table[2:]] == ["| scan._scan_kernel", "| topk._ties_kernel", "| copy",
                                                           "| all kernels"]
    assert table[3] == "| topk._ties_kernel | 2172 | — |" and table[-1] == "| all kernels | 6561 | 9381 |"


def test_the_kernel_table_says_how_many_profiled_tokens_sealed_a_block():
    """A sealing token's seal kernels quantize and pack every session's block; the others' return at once: the seal's
    figure is read with the count. Runs made before it was recorded say nothing."""
    payload = json.loads((RESULTS / "timing-warps-ab-main-k16-h100.json").read_text())
    assert "sealed a block" not in markdown(payload)
    for record in payload["records"]:
        record.update(kernel_tokens=3, kernel_sealing_tokens=1)
    caption = [line for line in markdown(payload).splitlines() if line.startswith("GPU µs per token by kernel")]
    assert caption == ["GPU µs per token by kernel (eager token, torch's profiler; the 12 largest of any method; "
                       "1 of 3 tokens sealed a block):"]


def test_replot_into_a_readme_rewrites_its_sections_and_sets_ds_in_hbm_beside_its_run(tmp_path):
    """--readme rewrites each section its file holds, the rest untouched; an hbm-regime run of DS-136 fills the
    "DS-136 in HBM" column of the host run's setting (the H200 runs of 2026-12-05)."""
    runs = [str(RESULTS / f"timing-{name}.json")
            for name in ("k128-host-hbm-h200", "scan-kernels-128k-16", "k16-hbm-h200", "1m-final")]
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- throughput:start -->\nold\n<!-- throughput:end -->\nbetween\n"
                      "<!-- timing:start -->\nold\n<!-- timing:end -->\nafter\n")
    main(["timing", "--replot", *runs, "--readme", str(readme), "--out", str(tmp_path), "--name", "x"])
    text = readme.read_text()
    assert "old" not in text and text.startswith("before\n<!-- throughput:start -->\n`python -m bench timing")
    assert "\n<!-- throughput:end -->\nbetween\n<!-- timing:start -->\n" in text
    assert text.endswith("<!-- timing:end -->\nafter\n")
    assert "| 128k × 16 ragged, t = 2, row cache 32768 | 6 | 44.17 | **362** | 79.57 | 201 | 1.80× | " \
           "49.90 (1.13×) | 0.973 / 0.983 | 7.7 |" in text
    assert all(f"| {name} | {setting} | {hardware} | {rate:g} |" in text for name, setting, hardware, rate in PEERS)


def test_the_readme_throughput_section_is_the_committed_runs_table_with_the_peers():
    """The README's throughput table is the one the committed run it names makes (so a new run that is not replotted
    into it, or a run named but not committed, shows here): its settings merged into one JSON."""
    readme = (RESULTS.parents[1] / "README.md").read_text()
    section = readme.split(THROUGHPUT_START)[1].split(THROUGHPUT_END)[0]
    named = re.findall(r"recorded in `bench/results/(timing-[\w.-]+\.json)`", section)
    assert len(named) == 1, named
    merged = json.loads((RESULTS / named[0]).read_text())
    assert throughput_table(merged) in section
    assert all(f"| {name} | {setting} | {hardware} | {rate:g} |" in readme for name, setting, hardware, rate in PEERS)


def _record(label, regime, gpu_ms, **extra):
    return {"mode": "graph", "label": label, "regime": regime, "context": 131072, "sessions": 16, "k": 512,
            "ragged": True, "row_cache_rows": 32768, "hbm_planes": 2 if regime == "host" else None,
            "physical_layers": 6, "gpu_ms": gpu_ms, "row_hit_rate": 0.97, "gpu_over_floor": 7.7,
            "speedup_vs_ds136": None, **extra}


def test_ds136_with_its_label_cache_in_hbm_is_paired_with_fathom_on_the_host_store():
    """DS's own design keeps its 136 bits a token in HBM: the hbm regime's DS-136 of the same sessions stands beside
    fathom@48's host-store row, with fathom's lead over it; without such a record the cell is a dash."""
    records = [_record("fathom@48", "host", 44.0, speedup_vs_ds136=1.8), _record("double-sparsity@136", "host", 79.2),
               _record("double-sparsity@136", "hbm", 55.0)]
    lines = throughput_table({"records": records}).splitlines()
    assert "DS-136 in HBM ms (fathom vs it)" in lines[0]
    assert lines[2] == ("| 128k × 16 ragged, t = 2, row cache 32768 | 6 | 44.00 | **364** | 79.20 | 202 | 1.80× | "
                        "55.00 (1.25×) | 0.970 / 0.970 | 7.7 |")
    other = [_record("fathom@48", "host", 44.0, speedup_vs_ds136=1.8),
             _record("double-sparsity@136", "hbm", 55.0, row_cache_rows=8192)]  # another setting: not paired
    assert "| 1.80× | — |" not in throughput_table({"records": other})  # no same-tier DS either
    assert throughput_table({"records": other}).splitlines()[2].endswith("| — | — | — | — | 0.970 / — | 7.7 |")
