"""Pinned host memory, measured: ``cuMemHostAlloc`` against an anonymous map zero-filled on torch's CPU threads
then ``cuMemHostRegister``, each alone, and on a worker thread beside GPU work on the main thread (a prefill
stand-in: matmuls, small kernels, a host sync every fifth). What ``fathom.host.pinned`` chose rests on it.

``python -m bench.pinned_probe [--gib 8] [--out bench/results/pinned-probe.json]`` (needs a GPU).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import threading
import time
from pathlib import Path

from bench.cli import plain, probe_ready
from bench.report import command_line

GIB = 1 << 30


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pinned_probe",
                                     description=plain(__doc__.split("\n\n")[0]))  # no reST in --help
    parser.add_argument("--gib", type=int, default=8, help="GiB per allocation (default 8)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/pinned-probe.json"),
                        help="JSON written here (default bench/results/pinned-probe.json)")
    args = parser.parse_args(argv)
    probe_ready(parser, args.gib, args.out)  # before the minutes of pinning: the JSON is the last thing written
    import torch
    from cuda.bindings import driver
    from numba import cuda

    torch.zeros(1, device="cuda")
    cuda.current_context()
    n = args.gib * GIB

    def ok(result):
        if int(result[0]) != 0:
            raise RuntimeError(f"CUDA driver call failed: {result[0]}")
        return result[1] if len(result) > 1 else None

    def host_alloc(memset: bool):
        cuda.current_context()
        t0 = time.perf_counter()
        ptr = ok(driver.cuMemHostAlloc(n, driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE))
        t1 = time.perf_counter()
        if memset:
            ok(driver.cuMemsetD8(ok(driver.cuMemHostGetDevicePointer(ptr, 0)), 0, n))
            ok(driver.cuCtxSynchronize())
        release = lambda: ok(driver.cuMemFreeHost(ptr))  # noqa: E731
        return release, {"alloc_s": t1 - t0, "memset_s": time.perf_counter() - t1}

    def register(threads: int, chunks: int = 1):
        cuda.current_context()
        t0 = time.perf_counter()
        mapped = mmap.mmap(-1, n)
        buffer = torch.frombuffer(mapped, dtype=torch.uint8)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        buffer.zero_()
        torch.set_num_threads(before)
        t1 = time.perf_counter()
        address = buffer.data_ptr()
        step = -(-n // chunks) // 4096 * 4096
        spans = [(a, min(step, n - a)) for a in range(0, n, step)]
        flags = driver.CU_MEMHOSTREGISTER_DEVICEMAP | driver.CU_MEMHOSTREGISTER_PORTABLE

        def pin(span):
            cuda.current_context()
            ok(driver.cuMemHostRegister(address + span[0], span[1], flags))

        with concurrent.futures.ThreadPoolExecutor(len(spans)) as pool:
            list(pool.map(pin, spans))
        t2 = time.perf_counter()
        same = int(ok(driver.cuMemHostGetDevicePointer(address, 0))) == address

        def release():
            for start, _ in spans:
                ok(driver.cuMemHostUnregister(address + start))

        return release, {"touch_s": t1 - t0, "register_s": t2 - t1, "device_ptr_is_host_ptr": same}

    def timed_release(release) -> float:
        t0 = time.perf_counter()
        release()
        return time.perf_counter() - t0

    ways = {"hostalloc+memset": lambda: host_alloc(True), "hostalloc": lambda: host_alloc(False),
            "register t1": lambda: register(1), "register t16": lambda: register(16),
            "register t16 c8": lambda: register(16, 8)}
    out = {"command": command_line(argv, "python -m bench.pinned_probe"), "device": torch.cuda.get_device_name()}
    for name, way in ways.items():
        release, record = way()
        seconds = sum(v for k, v in record.items() if k.endswith("_s"))
        record.update(free_s=timed_release(release), GB_per_s=n / 1e9 / seconds)  # n bytes: GiB are not GB
        out[name] = record
        print(name, json.dumps(record), flush=True)

    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def work(iterations: int = 1500) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(iterations):
            y = x @ x
            for _ in range(20):
                small.mul(1.001)
            if i % 5 == 0:
                y.sum().item()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    work(20)
    alone = out["work_alone_s"] = work()
    for name in ("hostalloc+memset", "register t16"):
        result = {}
        thread = threading.Thread(target=lambda: result.update(zip(("release", "record"), ways[name]())))
        thread.start()
        busy = work()
        thread.join()
        record = {"work_s": busy, "slowdown": busy / alone, **result["record"]}
        record["free_s"] = timed_release(result["release"])
        out["concurrent " + name] = record
        print("concurrent", name, json.dumps(record), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
