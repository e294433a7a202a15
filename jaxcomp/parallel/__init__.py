"""Step builders over meshes: what runs the gradient transformations, and is not one.

* :func:`data_parallel`: a jitted data-parallel train step (per-worker gradients with
  :func:`jaxcomp.comm.local_value_and_grad`, averaged by the optax chain you give, e.g.
  :func:`jaxcomp.transforms.compressed_mean` or :func:`jaxcomp.transforms.accordion`), its
  :class:`TrainState` (step, replicated params, optimizer state with per-worker parts sharded).
* :func:`ab_data_parallel`: AB-Training's grouped step (:class:`jaxcomp.transforms.ABConfig`)
  as compiled programs chosen on the host; :func:`ab_mesh` (the ``(group, member)`` mesh),
  :func:`stack_per_worker` / :func:`worker_entry` (per-worker state entries),
  :func:`fit_rank_capacity` (resize the factors' rank capacity).

Mesh axis names and :func:`jaxcomp.comm.make_mesh` stay in :mod:`jaxcomp.comm` (they are what
collectives run over); placing a transform's state is :func:`jaxcomp.comm.place_state`.
"""

from jaxcomp._driver import TrainState
from jaxcomp.ab._parallel import ABDataParallel
from jaxcomp.ab._parallel import ab_data_parallel
from jaxcomp.ab._parallel import ab_mesh
from jaxcomp.ab._parallel import fit_rank_capacity
from jaxcomp.ab._parallel import stack_per_worker
from jaxcomp.ab._parallel import worker_entry
from jaxcomp.parallel._data_parallel import DataParallel
from jaxcomp.parallel._data_parallel import data_parallel


def __getattr__(name):
    if name == "single_thread_lapack":  # deprecated alias for one release, not in __all__
        import warnings

        from jaxcomp import _cpu

        warnings.warn(
            "parallel.single_thread_lapack is deprecated and will be removed in the next "
            "release: ab_data_parallel limits BLAS to one thread itself on a CPU mesh of "
            "several local devices (the private jaxcomp._cpu.for_mesh).",
            DeprecationWarning,
            stacklevel=2,
        )
        return _cpu._lapack.single_thread_lapack
    raise AttributeError(f"module 'jaxcomp.parallel' has no attribute {name!r}")


__all__ = (
    "ABDataParallel",
    "DataParallel",
    "TrainState",
    "ab_data_parallel",
    "ab_mesh",
    "data_parallel",
    "fit_rank_capacity",
    "stack_per_worker",
    "worker_entry",
)
