"""One OpenMP thread pool per process: why the server's worker thread takes over the loader's.

GNU OpenMP (libgomp, torch's CPU backend on Linux) keeps a pool of helper threads for each
thread that has run a parallel region. `cachegraft serve` loads its models on the main thread
and decodes on a worker thread, so it held two pools. Once the pools' threads outnumber the
cores, libgomp stops spinning between regions (its "throttled" spin of at most 1,000
iterations, whatever OMP_WAIT_POLICY or GOMP_SPINCOUNT say), and each of a decode step's
~1,000 short regions wakes its helpers through the kernel. On 2 cores that made the worker's
int4 decode step 36-52 ms instead of 25 (docs/results.md, "The server's decode step").

`release_pool()` frees the calling thread's pool (OpenMP 5.0's `omp_pause_resource_all`), so
the worker's is the only one. A later parallel region on the calling thread makes a new pool:
call it where that thread's model work is done.
"""

from __future__ import annotations

import ctypes
import functools
import sys

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t; libgomp frees the calling thread's pool for either kind


def release_pool() -> bool:
    """Free the calling thread's OpenMP thread pool; True if one was freed (or there was none)
    under libgomp. False where the runtime is not libgomp or has no `omp_pause_resource_all`
    (nothing is changed then)."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def runtime() -> str | None:
    """The path of the libgomp in use, or None (another OpenMP runtime, or none)."""
    lib = _libgomp()
    return lib._name if lib is not None else None


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp that torch loaded (found in this process's memory map), if any."""
    if not sys.platform.startswith("linux"):
        return None
    import torch  # noqa: F401 - loads the OpenMP runtime torch was built with

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:
        return None
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            return lib
    return None
