#!/usr/bin/python3
"""peers.py: kvpager's decode attention against numpy and torch, shape by shape.

For each row of `kvpager bench`'s grid (storage dtype, batch B, query heads
H, KV heads kv_H, head width d_h, retained length L; K and V of
[B, kv_H, L, d_h]) the peers compute what one decode step computes per lane
and query head, in the row's dtype: scores = q . K^T / sqrt(d_h), a softmax,
and the weighted sum of V. Query head h reads KV head h / (H / kv_H); the
peers reshape q to [B, kv_H, H / kv_H, d_h] so a group shares its K and V
without copies (how grouped-query decode is written for them):

  numpy  float64 and float32 (np.matmul, OpenBLAS); numpy has no bfloat16
  torch  float64, float32 and bfloat16 (torch.matmul, then softmax)

kvpager's time is the `paged_ns` of `kvpager bench --json` for the same
shapes at block_tokens 16: the library's own gather loops over a paged,
shuffled cache. The public API cannot time the gather alone (a forward step
also projects, applies RoPE and appends), so the script runs the program
rather than timing kvp_attention_forward; the small ctypes wrapper below loads
libkvpager.so only to check that the library and the program are the same
version (build both: `cmake --build build/release --target libkvpager.so`).
kvpager's figure, like the peers', includes the softmax. kvpager bench
measures each shape on 1 thread and on a decoder of 2; the script compares
the rows of --threads (default 1) with the peers on as many threads. The kvpager run comes first, then the peers, in
alternating repetitions among themselves; every figure is a median.

Printed: peer time / kvpager time per shape (above 1: kvpager is faster).
Peers run on one thread by default, as kvpager's gather does (--threads N).

OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE, when set in the environment, make
OpenBLAS pick a kernel other than the one it detects; the script removes both
for its own run only (re-executing itself) and prints the kernel OpenBLAS
runs (threadpoolctl, when installed).

Optional, not part of the test command. --install installs the Debian
packages (python3-numpy, python3-torch, python3-threadpoolctl, and libopenblas0,
without which numpy runs Debian's reference BLAS) when missing.
"""
import argparse
import ctypes
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRUBBED = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kvpager", default=os.path.join(ROOT, "build/release/kvpager"),
                   help="the kvpager program (default build/release/kvpager)")
    p.add_argument("--lib", default=os.path.join(ROOT, "build/release/libkvpager.so"),
                   help="libkvpager.so (default build/release/libkvpager.so)")
    p.add_argument("--full", action="store_true",
                   help="the full grid (default: --quick's, B 1 and 8, H 8, d_h 64)")
    p.add_argument("--lens", default=None, help="lengths, e.g. 256,2048 (default: the grid's)")
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, choices=(1, 2),
                   help="threads for the peers and kvpager's rows (default 1)")
    p.add_argument("--install", action="store_true",
                   help="apt-get install -y the missing Debian packages first")
    return p.parse_args()


def ensure_packages(install):
    missing = []
    for module, package in (("numpy", "python3-numpy"), ("torch", "python3-torch"),
                            ("threadpoolctl", "python3-threadpoolctl")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    # numpy's libblas.so.3 is Debian's reference BLAS unless OpenBLAS is installed.
    if not os.path.exists("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3") and \
            os.path.exists("/usr/lib/x86_64-linux-gnu"):
        missing.append("libopenblas0")
    if missing and install:
        print("installing:", " ".join(missing), flush=True)
        subprocess.run(["apt-get", "install", "-y"] + missing, check=True,
                       stdout=subprocess.DEVNULL)
        missing = []
    hard = [m for m in missing if m not in ("python3-threadpoolctl", "libopenblas0")]
    debian = "/usr/bin/python3"
    if hard and os.path.exists(debian) and os.path.realpath(sys.executable) != \
            os.path.realpath(debian):
        # Debian's packages are for Debian's interpreter, not another one on PATH.
        os.execv(debian, [debian] + sys.argv)
    if hard:
        sys.exit("peers.py: missing %s (run with --install)" % " ".join(hard))


WRAPPER = """
import ctypes, sys
so = ctypes.CDLL(sys.argv[1])
so.kvp_version.restype = ctypes.c_char_p
so.kvp_version.argtypes = []
print(so.kvp_version().decode())
"""


def check_library(lib, program):
    """The ctypes wrapper: the library's version must be the program's.

    libkvpager.so links jemalloc, whose thread-local storage is initial-exec:
    dlopen'ed into a running interpreter it fails ("cannot allocate memory in
    static TLS block"). So the wrapper runs in a child interpreter with
    jemalloc preloaded, and the peers keep their own allocator.
    """
    env = dict(os.environ)
    ldd = subprocess.run(["ldd", lib], capture_output=True, text=True).stdout
    jemalloc = [line.split("=>")[1].split()[0] for line in ldd.splitlines()
                if "libjemalloc" in line and "=>" in line]
    if jemalloc:
        env["LD_PRELOAD"] = jemalloc[0]
    version = subprocess.run([sys.executable, "-c", WRAPPER, lib], check=True, env=env,
                             capture_output=True, text=True).stdout.strip()
    shown = subprocess.run([program, "--version"], check=True, capture_output=True,
                           text=True).stdout.split()[-1]
    if version != shown:
        sys.exit("peers.py: %s is %s but %s is %s" % (lib, version, program, shown))
    return version


def kvpager_rows(args):
    cmd = [args.kvpager, "bench", "--json", "--quiet", "--blocks", "16",
           "--read-bytes", "64MiB", "--requests", "1", "--repetitions", str(args.repetitions)]
    if not args.full:
        cmd.append("--quick")
    if args.lens:
        cmd += ["--lens", args.lens]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return out


def blas_kernel():
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (python3-threadpoolctl not installed)"
    infos = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    blas = os.path.realpath("/usr/lib/x86_64-linux-gnu/libblas.so.3")
    return "; ".join("%s %s, kernel %s, %s threads" % (
        i.get("internal_api"), i.get("version"), i.get("architecture"), i.get("num_threads"))
        for i in infos) or "%s (no OpenBLAS found: reference BLAS?)" % blas


def median_ns(fn, repetitions, min_seconds=0.005):
    n = 1
    while True:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - start >= min_seconds or n >= 1 << 20:
            break
        n *= 2
    return n


def main():
    args = parse_args()
    if any(k in os.environ for k in SCRUBBED):
        env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
        print("peers.py: running without %s" % ", ".join(
            "%s=%s" % (k, os.environ[k]) for k in SCRUBBED if k in os.environ), flush=True)
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    ensure_packages(args.install)
    if args.threads > 0:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    import numpy as np
    import torch
    torch.set_num_threads(args.threads)
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(args.threads)
    except ImportError:
        pass
    version = check_library(args.lib, args.kvpager)
    bench = kvpager_rows(args)
    print("kvpager %s (kernels %s; paged gather at block_tokens 16, from `kvpager bench "
          "--json`)" % (version, bench["isa"]))
    print("numpy %s, BLAS: %s" % (np.__version__, blas_kernel()))
    print("torch %s, %d thread(s); peers: scores + softmax + values, median of %d alternating "
          "repetitions" % (torch.__version__, torch.get_num_threads(), args.repetitions))
    print()
    print("dtype    B   H kv_H  d_h     len       K+V   kvpager ms      numpy      torch"
          "   (peer time / kvpager time, same dtype)")
    rng = np.random.default_rng(1)
    numpy_types = {"f64": np.float64, "f32": np.float32}
    torch_types = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16}
    results = {}
    for row in bench["gather"]:
        if row.get("threads", 1) != args.threads:
            continue
        dtype = row.get("dtype", "f64")
        b, h, d, n = row["batch"], row["heads"], row["head_width"], row["len"]
        kv = row.get("kv_heads", h)
        g = h // kv
        k = rng.standard_normal((b, kv, n, d))
        v = rng.standard_normal((b, kv, n, d))
        q = rng.standard_normal((b, kv, g, d)) * 0.1
        scale = 1.0 / math.sqrt(d)
        tt = torch_types[dtype]
        tk, tv, tq = (torch.from_numpy(x).to(tt) for x in (k, v, q))
        nt = numpy_types.get(dtype)
        nk, nv, nq = (x.astype(nt) for x in (k, v, q)) if nt else (None, None, None)

        def numpy_step():
            s = np.matmul(nq, np.swapaxes(nk, -1, -2)) * nt(scale)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            return np.matmul(s, nv)

        def torch_step():
            with torch.no_grad():
                s = torch.softmax(torch.matmul(tq, tk.transpose(-1, -2)) * scale, dim=-1)
                return torch.matmul(s, tv)

        # The f64 answer on the same rounded K, V and q: every peer must agree with it.
        rk, rv, rq = (x.to(torch.float64) for x in (tk, tv, tq))
        s = torch.softmax(torch.matmul(rq, rk.transpose(-1, -2)) * scale, dim=-1)
        reference = torch.matmul(s, rv).numpy()
        tol = 2e-2 if dtype == "bf16" else 1e-4
        cases = ([numpy_step] if nt else []) + [torch_step]
        for case in cases:
            got = case()
            got = got.to(torch.float64).numpy() if torch.is_tensor(got) else got.astype(float)
            assert np.allclose(got, reference, rtol=tol, atol=tol), "peer results disagree"
        counts = [median_ns(c, args.repetitions) for c in cases]
        times = [[] for _ in cases]
        for _ in range(args.repetitions):
            for i, c in enumerate(cases):
                start = time.perf_counter()
                for _ in range(counts[i]):
                    c()
                times[i].append((time.perf_counter() - start) / counts[i] * 1e9)
        ratios = [statistics.median(t) / row["paged_ns"] for t in times]
        if not nt:
            ratios = [None] + ratios
        for name, r in zip(("numpy", "torch"), ratios):
            if r is not None:
                results.setdefault((name, dtype), []).append(r)
        shown = ["%9.2fx" % r if r is not None else "        -" for r in ratios]
        print("%-5s %4d %3d %4d %4d %7d %7.1f MiB %10.3f  %s  %s" % (
            dtype, b, h, kv, d, n, row["kv_bytes"] / 1048576.0, row["paged_ns"] / 1e6,
            *shown), flush=True)
        del k, v, tk, tv, nk, nv
    if results:
        print()
        for (name, dtype), col in sorted(results.items()):
            print("%-5s %-5s peer / kvpager: %.2fx to %.2fx (median %.2fx) over %d shapes" % (
                name, dtype, min(col), max(col), statistics.median(col), len(col)))


if __name__ == "__main__":
    main()
