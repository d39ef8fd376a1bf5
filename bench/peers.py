#!/usr/bin/python3
"""peers.py: kvpager's paged decode attention against numpy and torch, in one process.

For each shape (storage dtype, batch B, query heads H, KV heads kv_H, head
width d_h, retained length L; K and V of [B, kv_H, L, d_h]) every
implementation computes one decode step's attention per lane and query head
on the same data: scores = q . K^T / sqrt(d_h), a softmax, and the weighted
sum of V. Query head h reads KV head h / (H / kv_H); the peers reshape q to
[B, kv_H, H / kv_H, d_h] so a group shares its K and V without copies:

  kvpager  kvp_paged_attention (include/kvpager/paged.h), the public call, on
           an external cache of the row's dtype (block_tokens 16, rows
           appended with kvp_cache_append_rows), through ctypes on
           libkvpager.so, at the exact level and, for narrow dtypes, the fast
           one; queries and outputs in f64 for f64 pages, f32 otherwise
  numpy    float64 and float32 (np.matmul on the BLAS numpy loaded); numpy has
           no bfloat16
  torch    float64, float32 and bfloat16 (torch.matmul, then softmax)

All of them run in this process, on one thread, alternating round after round
on the same data; every figure is a median. Printed: peer time / kvpager time
per shape (above 1: kvpager is faster).

The data: K, V and q are drawn in f64, rounded once to the row's dtype
(torch's round to nearest even), and that same rounded data is appended to
kvpager (the pages hold it exactly) and given to the peers. Every output is
checked before anything is timed: against an f64 softmax attention of the
same rounded data, the largest error divided by the reference's largest
magnitude must stay within a tolerance of the implementation's arithmetic
(TOLERANCE below; printed). A failure stops the script.

BLAS: numpy's and torch's f32/f64 matmuls run the BLAS they loaded. Debian's
default libblas.so.3 is the reference BLAS, which is many times slower than
an optimized one and would flatter kvpager; the script finds the BLAS loaded
in this process (threadpoolctl when installed, and /proc/self/maps), prints
it with the kernel OpenBLAS chose, and refuses to report (exit 2) unless it
is OpenBLAS or MKL. OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE, when set, make
OpenBLAS pick a kernel other than the one it detects; the script removes
both for its own run (re-executing itself).

libkvpager.so links jemalloc, whose thread-local storage is initial-exec;
if the dynamic loader has no room left for it (dlopen fails with "cannot
allocate memory in static TLS block"), the script re-executes itself with
GLIBC_TUNABLES=glibc.rtld.optional_static_tls raised. The peers keep their
own allocator either way (the library is loaded RTLD_LOCAL).

Optional, not part of the test command. --install installs the Debian
packages (python3-numpy, python3-torch, python3-threadpoolctl, and
libopenblas0, without which numpy runs Debian's reference BLAS) when missing.
Build the library first: `cmake --workflow --preset release`.
"""
import argparse
import ctypes
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRUBBED = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
TLS_TUNABLE = "glibc.rtld.optional_static_tls=65536"

KVP_F64, KVP_F32 = 0, 1
# The page dtypes: name -> (kvp_dtype, bytes, torch dtype, numpy dtype or None). One line each;
# a narrow dtype is timed at both levels, and needs its TOLERANCE entries below.
DTYPE_TABLE = {
    "f64": (0, 8, "float64", "float64"),
    "f32": (1, 4, "float32", "float32"),
    "bf16": (2, 2, "bfloat16", None),
    "f16": (3, 2, "float16", None),
}
# Dtypes whose matmul this torch cannot run on the CPU ("addmm_impl_cpu_" not implemented for
# 'Half' in torch 1.13): torch only rounds their data; kvpager is compared with the reference.
NO_TORCH_MATMUL = {"f16"}
# fp8 (e4m3) pages have no peer here: this torch has no float8 type, and numpy none at all.
DTYPES = {name: row[0] for name, row in DTYPE_TABLE.items()}
SIZES = {name: row[1] for name, row in DTYPE_TABLE.items()}
EXACT, FAST = 0, 1
BLOCK_TOKENS = 16

# Largest |output - f64 reference| / largest |reference| allowed, per implementation and dtype:
# kvpager's exact level widens every stored element to f64 (only the summation order differs
# from the reference), then rounds its f32 outputs once (2^-24 of an element at most); its fast
# level and the f32 peers accumulate in f32; torch's bf16 matmul rounds the weights and the
# outputs to bf16 (8 significant bits).
TOLERANCE = {
    ("kvpager exact", "f64"): 1e-12, ("kvpager exact", "f32"): 6.5e-8,
    ("kvpager exact", "bf16"): 6.5e-8, ("kvpager exact", "f16"): 6.5e-8,
    ("kvpager fast", "f32"): 1e-4, ("kvpager fast", "bf16"): 1e-4, ("kvpager fast", "f16"): 1e-4,
    ("numpy", "f64"): 1e-12, ("numpy", "f32"): 1e-4,
    ("torch", "f64"): 1e-12, ("torch", "f32"): 1e-4, ("torch", "bf16"): 1e-2,
    ("torch", "f16"): 2e-3,
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lib", default=os.path.join(ROOT, "build/release/libkvpager.so"),
                   help="libkvpager.so (default build/release/libkvpager.so)")
    p.add_argument("--full", action="store_true",
                   help="L up to 32768 and B 8 (default: the quick grid, see --help)")
    p.add_argument("--lens", default=None, help="lengths, e.g. 512,4096 (default: the grid's)")
    p.add_argument("--dtypes", default="f64,f32,bf16", help="dtypes (default f64,f32,bf16)")
    p.add_argument("--max-bytes", type=float, default=1024,
                   help="skip shapes above this many MiB of stored K+V (default 1024)")
    p.add_argument("--repetitions", type=int, default=5)
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


# ---- BLAS -------------------------------------------------------------------------------

def loaded_blas():
    """The BLAS-looking shared objects mapped in this process (realpaths)."""
    found = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if "/" in line else ""
                name = os.path.basename(path)
                if any(k in name for k in ("blas", "mkl_rt", "mkl_core", "openblas")):
                    found.add(os.path.realpath(path))
    except OSError:
        pass
    return sorted(found)


def blas_check(np, torch):
    """Prints the BLAS numpy and torch run; exits 2 unless it is OpenBLAS or MKL."""
    a = np.ones((64, 64))
    a @ a  # make sure the BLAS is loaded and initialised
    t = torch.ones((64, 64), dtype=torch.float64)
    t @ t
    infos = []
    try:
        from threadpoolctl import threadpool_info
        infos = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    except ImportError:
        pass
    paths = loaded_blas()
    optimized = [i for i in infos if i.get("internal_api") in ("openblas", "mkl")]
    optimized_paths = [p for p in paths if "openblas" in p or "mkl" in p]
    reference = [p for p in paths if "openblas" not in p and "mkl" not in p and "blas" in
                 os.path.basename(p) and "/blas/" in p]
    torch_blas = [line.strip() for line in torch.__config__.show().splitlines()
                  if "BLAS_INFO" in line]
    for i in infos:
        print("BLAS: %s %s, kernel %s, %s thread(s), %s" % (
            i.get("internal_api"), i.get("version"), i.get("architecture"),
            i.get("num_threads"), i.get("filepath")))
    if not infos:
        print("BLAS: threadpoolctl not installed; mapped: %s" % (", ".join(paths) or "none"))
    if torch_blas:
        setting = [s for s in torch_blas[0].split(",") if "BLAS_INFO" in s]
        print("torch %s (\"generic\": the system libblas.so.3, the one above)" % (
            setting[0].strip() if setting else torch_blas[0]))
    if reference or not (optimized or optimized_paths):
        print("peers.py: numpy/torch run %s, not OpenBLAS or MKL: a reference BLAS would "
              "flatter kvpager. Install libopenblas0 (or run with --install) and make it "
              "the libblas.so.3 alternative." % (", ".join(reference or paths) or
                                                 "an unknown BLAS"), file=sys.stderr)
        sys.exit(2)
    return infos


# ---- kvpager through ctypes -------------------------------------------------------------

class PoolConfig(ctypes.Structure):
    # The first release's fields of kvp_pool_config (include/kvpager/pool.h); the buffer
    # behind it is larger than the whole struct, which kvp_pool_config_init fills.
    _fields_ = [("struct_size", ctypes.c_size_t), ("block_tokens", ctypes.c_size_t),
                ("heads", ctypes.c_size_t), ("head_width", ctypes.c_size_t),
                ("budget_bytes", ctypes.c_size_t), ("dtype", ctypes.c_int)]


class PagedArgs(ctypes.Structure):
    # kvp_paged_attention_args (include/kvpager/paged.h).
    _fields_ = [("struct_size", ctypes.c_size_t), ("cache", ctypes.c_void_p),
                ("heads", ctypes.c_size_t), ("io_dtype", ctypes.c_int),
                ("queries", ctypes.c_void_p), ("keys", ctypes.c_void_p),
                ("values", ctypes.c_void_p), ("scale", ctypes.c_double),
                ("accum", ctypes.c_int), ("outputs", ctypes.c_void_p)]


def open_library(path):
    try:
        so = ctypes.CDLL(path)
    except OSError as e:
        if "static TLS" in str(e) and TLS_TUNABLE not in os.environ.get("GLIBC_TUNABLES", ""):
            env = dict(os.environ)
            env["GLIBC_TUNABLES"] = ":".join(
                x for x in (env.get("GLIBC_TUNABLES"), TLS_TUNABLE) if x)
            os.execve(sys.executable, [sys.executable] + sys.argv, env)
        sys.exit("peers.py: cannot load %s: %s" % (path, e))
    vp, sz, st = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    so.kvp_version.restype = ctypes.c_char_p
    so.kvp_error_format.restype = sz
    so.kvp_error_format.argtypes = [vp, ctypes.c_char_p, sz]
    so.kvp_pool_config_init.argtypes = [vp]
    so.kvp_pool_create.argtypes = [vp, ctypes.POINTER(vp), vp]
    so.kvp_pool_destroy.argtypes = [vp, vp]
    so.kvp_binding_init_external.argtypes = [vp, sz, sz, sz, ctypes.c_uint64, ctypes.c_uint64,
                                             vp]
    so.kvp_cache_create.argtypes = [vp, vp, sz, sz, ctypes.POINTER(vp), vp]
    so.kvp_cache_destroy.argtypes = [vp, vp]
    so.kvp_cache_append_rows.argtypes = [vp, vp, vp, sz, vp]
    for name in ("kvp_pool_create", "kvp_pool_destroy", "kvp_binding_init_external",
                 "kvp_cache_create", "kvp_cache_destroy", "kvp_cache_append_rows"):
        getattr(so, name).restype = st
    if not hasattr(so, "kvp_paged_attention"):
        sys.exit("peers.py: %s has no kvp_paged_attention (build this checkout's library)" %
                 path)
    so.kvp_paged_attention_args_init.argtypes = [vp]
    so.kvp_paged_attention.argtypes = [vp, vp, vp]
    so.kvp_paged_attention.restype = st
    return so


class Kvpager:
    """One external cache holding K and V of one shape, and the calls that read it."""

    def __init__(self, so, dtype, k, v):
        self.so = so
        self.err = ctypes.create_string_buffer(1024)
        b, kv, n, d = k.shape
        config_buf = ctypes.create_string_buffer(4096)
        so.kvp_pool_config_init(config_buf)
        config = PoolConfig.from_buffer(config_buf)
        page = 2 * kv * BLOCK_TOKENS * d * SIZES[dtype]
        config.block_tokens, config.heads, config.head_width = BLOCK_TOKENS, kv, d
        config.budget_bytes = (b * ((n + BLOCK_TOKENS - 1) // BLOCK_TOKENS) + 1) * page
        config.dtype = DTYPES[dtype]
        self.pool = ctypes.c_void_p()
        self.cache = ctypes.c_void_p()
        self.check(so.kvp_pool_create(config_buf, ctypes.byref(self.pool), self.err),
                   "kvp_pool_create")
        binding = ctypes.create_string_buffer(4096)
        self.check(so.kvp_binding_init_external(binding, kv, d, n, 17, 1, self.err),
                   "kvp_binding_init_external")
        self.check(so.kvp_cache_create(self.pool, binding, b, n, ctypes.byref(self.cache),
                                       self.err), "kvp_cache_create")
        import numpy as np
        step = max(1, (64 << 20) // max(1, b * kv * d * 16))
        for start in range(0, n, step):
            kc = np.ascontiguousarray(k[:, :, start:start + step, :], dtype=np.float64)
            vc = np.ascontiguousarray(v[:, :, start:start + step, :], dtype=np.float64)
            self.check(so.kvp_cache_append_rows(self.cache, kc.ctypes.data, vc.ctypes.data,
                                                kc.shape[2], self.err),
                       "kvp_cache_append_rows")

    def check(self, status, what):
        if status != 0:
            buf = ctypes.create_string_buffer(512)
            self.so.kvp_error_format(self.err, buf, 512)
            sys.exit("peers.py: %s: %s" % (what, buf.value.decode()))

    def call(self, q, out, accum):
        """Prepares one kvp_paged_attention call: q [B][H][d_h] and out alike, f64 or f32."""
        args = PagedArgs()
        self.so.kvp_paged_attention_args_init(ctypes.byref(args))
        args.cache = self.cache
        args.heads = q.shape[1]
        args.io_dtype = KVP_F64 if q.dtype.itemsize == 8 else KVP_F32
        args.queries = q.ctypes.data
        args.scale = 1.0 / math.sqrt(q.shape[2])
        args.accum = accum
        args.outputs = out.ctypes.data
        fn, err, check = self.so.kvp_paged_attention, self.err, self.check

        def run():
            status = fn(ctypes.byref(args), None, err)
            if status != 0:
                check(status, "kvp_paged_attention")
        return run

    def close(self):
        if self.cache:
            self.so.kvp_cache_destroy(self.cache, None)
        if self.pool:
            self.check(self.so.kvp_pool_destroy(self.pool, self.err), "kvp_pool_destroy")
        self.cache = self.pool = None


# ---- timing -----------------------------------------------------------------------------

def calibrate(fn, min_seconds=0.005):
    n = 1
    while True:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - start >= min_seconds or n >= 1 << 20:
            return n
        n *= 2


def alternating(cases, repetitions):
    """Median seconds per call of each case, timed round after round in turn."""
    counts = [calibrate(c) for c in cases]
    times = [[] for _ in cases]
    for _ in range(repetitions):
        for i, c in enumerate(cases):
            start = time.perf_counter()
            for _ in range(counts[i]):
                c()
            times[i].append((time.perf_counter() - start) / counts[i])
    return [statistics.median(t) for t in times]


def grid(args):
    lens = [int(x) for x in args.lens.split(",")] if args.lens else \
        ([512, 4096, 32768] if args.full else [512, 4096, 32768])
    batches = [1, 8] if args.full else [1]
    shapes = []
    for dtype in args.dtypes.split(","):
        if dtype not in DTYPES:
            sys.exit("peers.py: --dtypes: unknown dtype '%s'" % dtype)
        for kv in (32, 8):
            for b in batches:
                for n in lens:
                    shapes.append((dtype, b, 32, kv, 128, n))
    return shapes


def main():
    args = parse_args()
    if any(k in os.environ for k in SCRUBBED):
        env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
        print("peers.py: running without %s" % ", ".join(
            "%s=%s" % (k, os.environ[k]) for k in SCRUBBED if k in os.environ), flush=True)
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    ensure_packages(args.install)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    import numpy as np
    import torch
    torch.set_num_threads(1)
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(1)
    except ImportError:
        pass
    so = open_library(args.lib)
    print("kvpager %s (libkvpager.so: kvp_paged_attention on an external cache, block_tokens "
          "%d, 1 thread)" % (so.kvp_version().decode(), BLOCK_TOKENS))
    print("numpy %s, torch %s, 1 thread each" % (np.__version__, torch.__version__))
    blas_check(np, torch)
    print("median of %d alternating repetitions, all in this process, on the same data" %
          args.repetitions)
    print("max error / max |reference|, tolerances: %s" % ", ".join(
        "%s %s %g" % (k[0], k[1], v) for k, v in sorted(TOLERANCE.items())))
    print()
    print("dtype    B   H kv_H  d_h     len       K+V  level    kvpager ms      numpy      "
          "torch   (peer time / kvpager time, same data)")
    torch_types = {name: getattr(torch, row[2]) for name, row in DTYPE_TABLE.items()}
    numpy_types = {name: getattr(np, row[3]) for name, row in DTYPE_TABLE.items() if row[3]}
    rng = np.random.default_rng(1)
    results = {}
    worst = {}
    for dtype, b, h, kv, d, n in grid(args):
        stored = 2 * SIZES[dtype] * b * kv * n * d
        if stored > args.max_bytes * 1048576:
            print("%-5s %4d %3d %4d %4d %7d %7.1f MiB  skipped (--max-bytes)" % (
                dtype, b, h, kv, d, n, stored / 1048576.0))
            continue
        g = h // kv
        tt = torch_types[dtype]
        # The same rounded data for everyone: drawn in f64, rounded once to the dtype (q too:
        # kvpager takes bf16 queries as the f32 values they are).
        tk = torch.from_numpy(rng.standard_normal((b, kv, n, d))).to(tt)
        tv = torch.from_numpy(rng.standard_normal((b, kv, n, d))).to(tt)
        io = np.float64 if dtype == "f64" else np.float32
        tq = torch.from_numpy(rng.standard_normal((b, kv, g, d)) * 0.1).to(tt)
        k64, v64, q64 = (x.to(torch.float64) for x in (tk, tv, tq))
        scale = 1.0 / math.sqrt(d)
        with torch.no_grad():
            w = torch.softmax(torch.matmul(q64, k64.transpose(-1, -2)) * scale, dim=-1)
            reference = torch.matmul(w, v64).numpy().reshape(b, h, d)
        del w
        kvp = Kvpager(so, dtype, k64.numpy(), v64.numpy())
        q_io = np.ascontiguousarray(q64.numpy().reshape(b, h, d).astype(io))
        levels = [EXACT] + ([FAST] if dtype != "f64" else [])
        outs = {lvl: np.zeros((b, h, d), dtype=io) for lvl in levels}
        kvp_calls = {lvl: kvp.call(q_io, outs[lvl], lvl) for lvl in levels}
        del k64, v64
        nt = numpy_types.get(dtype)
        nk, nv, nq = (x.numpy() for x in (tk, tv, tq)) if nt else (None, None, None)

        def numpy_step():
            s = np.matmul(nq, np.swapaxes(nk, -1, -2)) * nt(scale)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            return np.matmul(s, nv)

        def torch_step():
            with torch.no_grad():
                s = torch.softmax(torch.matmul(tq, tk.transpose(-1, -2)) * scale, dim=-1)
                return torch.matmul(s, tv)

        peers = ([("numpy", numpy_step)] if nt else []) + \
            ([("torch", torch_step)] if dtype not in NO_TORCH_MATMUL else [])
        magnitude = float(np.abs(reference).max())
        checks = [("kvpager %s" % ("exact" if lvl == EXACT else "fast"), kvp_calls[lvl],
                   lambda lvl=lvl: outs[lvl]) for lvl in levels] + \
            [(name, fn, fn) for name, fn in peers]
        for name, fn, result in checks:
            fn()
            got = result()
            got = got.to(torch.float64).numpy() if torch.is_tensor(got) else \
                np.asarray(got, dtype=np.float64)
            err = float(np.abs(got.reshape(b, h, d) - reference).max()) / magnitude
            worst[(name, dtype)] = max(worst.get((name, dtype), 0.0), err)
            if not err <= TOLERANCE[(name, dtype)]:
                sys.exit("peers.py: %s on %s B=%d kv_H=%d L=%d: error %.3g of the output's "
                         "magnitude %.3g, above %g" % (name, dtype, b, kv, n, err, magnitude,
                                                       TOLERANCE[(name, dtype)]))
        cases = [kvp_calls[lvl] for lvl in levels] + [fn for _, fn in peers]
        medians = alternating(cases, args.repetitions)
        peer_times = dict(zip([name for name, _ in peers], medians[len(levels):]))
        for i, lvl in enumerate(levels):
            level = "exact" if lvl == EXACT else "fast"
            ratios = []
            for name in ("numpy", "torch"):
                if name in peer_times:
                    r = peer_times[name] / medians[i]
                    results.setdefault((name, dtype, level), []).append(r)
                    ratios.append("%9.2fx" % r)
                else:
                    ratios.append("        -")
            print("%-5s %4d %3d %4d %4d %7d %7.1f MiB  %-5s %11.3f  %s  %s" % (
                dtype, b, h, kv, d, n, stored / 1048576.0, level, medians[i] * 1e3, *ratios),
                flush=True)
        kvp.close()
        del tk, tv, nk, nv
    if results:
        print()
        for (name, dtype, level), col in sorted(results.items()):
            print("%-5s %-5s against kvpager %-5s: %.2fx to %.2fx (median %.2fx) over %d shapes"
                  % (name, dtype, level, min(col), max(col), statistics.median(col), len(col)))
        print()
        print("largest error seen / max |reference|: %s" % ", ".join(
            "%s %s %.2g" % (k[0], k[1], v) for k, v in sorted(worst.items())))


if __name__ == "__main__":
    main()
