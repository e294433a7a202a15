"""One thread per BLAS library when several CPU devices share the process.

JAX's CPU LAPACK kernels (``svd``, ``qr``, ``eigh``) call SciPy's OpenBLAS. With several CPU
devices in one process every device thread calls it at once and each call starts its own
worker threads, which spin: on 2 cores with 8 devices an AB re-factorisation step took 10-20x
its single-threaded time, and beside a CPU-busy process over the 40 s after which XLA aborts a
waiting collective (``docs/performance.md``).
"""

from __future__ import annotations

import jax


def single_thread_lapack() -> None:
    """Limits the BLAS libraries loaded in this process (OpenBLAS) to one thread each."""
    import scipy.linalg.cython_lapack  # noqa: F401  (loads the library the kernels use)
    import threadpoolctl

    threadpoolctl.threadpool_limits(limits=1, user_api="blas")


def many_local_cpu_devices(mesh: jax.sharding.Mesh) -> bool:
    """Whether this process holds several of ``mesh``'s devices, all CPU devices."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return len(local) > 1 and all(d.platform == "cpu" for d in local)
