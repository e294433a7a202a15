"""Step builders over meshes: what runs the gradient transformations, and is not one.

* :func:`data_parallel`: a jitted data-parallel train step (per-worker gradients with
  :func:`jaxcomp.comm.local_value_and_grad`, averaged by the optax chain you give, e.g.
  :func:`jaxcomp.transforms.compressed_mean` or :func:`jaxcomp.transforms.accordion`), its
  :class:`TrainState` (step, replicated params, optimizer state with per-worker parts sharded).
* :func:`ab_data_parallel`: AB-Training's grouped step (:class:`jaxcomp.transforms.ABConfig`)
  as compiled programs chosen on the host; :func:`ab_mesh` (the ``(group, member)`` mesh),
  :func:`stack_per_worker` / :func:`worker_entry` (per-worker state entries),
  :func:`fit_rank_capacity` (resize the factors' rank capacity), :func:`single_thread_lapack`.

Mesh axis names and :func:`jaxcomp.comm.make_mesh` stay in :mod:`jaxcomp.comm` (they are what
collectives run over); placing a transform's state is :func:`jaxcomp.comm.place_state`.
"""

from jaxcomp._driver import TrainState
from jaxcomp.ab._parallel import ABDataParallel
from jaxcomp.ab._parallel import ab_data_parallel
from jaxcomp.ab._parallel import ab_mesh
from jaxcomp.ab._parallel import fit_rank_capacity
from jaxcomp.ab._parallel import single_thread_lapack
from jaxcomp.ab._parallel import stack_per_worker
from jaxcomp.ab._parallel import worker_entry
from jaxcomp.parallel._data_parallel import DataParallel
from jaxcomp.parallel._data_parallel import data_parallel

__all__ = (
    "ABDataParallel",
    "DataParallel",
    "TrainState",
    "ab_data_parallel",
    "ab_mesh",
    "data_parallel",
    "fit_rank_capacity",
    "single_thread_lapack",
    "stack_per_worker",
    "worker_entry",
)
