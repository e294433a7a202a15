"""A 2-worker data-parallel training step: jaxcomp's against torch DDP with its comm hooks.

One step is a forward and backward of an MLP (1024-2048-1024, ReLU, 4,197,376 parameters) on
each worker's own batch of 64, the gradient averaging over 2 workers, and SGD with momentum:

* ``ddp_dense``: jaxcomp's :func:`~jaxcomp.parallel.data_parallel` with
  ``compressed_mean(identity(), path="dense")`` (a ``pmean`` of the gradients) against
  ``DistributedDataParallel``'s own all-reduce;
* ``ddp_powersgd_r2``: ``compressed_mean(error_feedback(power_sgd(2)))`` against DDP with
  ``powerSGD_hook`` (``PowerSGDState(matrix_approximation_rank=2, use_error_feedback=True,
  warm_start=True)``, compressing from the second step on; biases all-reduced dense by both).

jaxcomp runs in this process on 2 (fake) CPU devices; torch runs 2 processes with one thread
each over gloo, the model in one gradient bucket (see ``_torch_worker``). The parent alternates
the two sides step by step (each torch step starts after a barrier of both ranks and is timed
by rank 0), so load that comes and goes hits both.

References:
  Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
  Optimization", NeurIPS 2019 (the hook's algorithm).
"""

from __future__ import annotations

import socket
import time

SIZES = (1024, 2048, 1024)
BATCH = 64
LR, MOMENTUM = 0.01, 0.9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_worker(rank: int, port: int, hook: str, conn) -> None:
    """One DDP rank: builds the model, then runs ``n`` timed steps per ``n`` received."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.ReLU(), torch.nn.Linear(SIZES[1], SIZES[2])
    )
    # one bucket: with the default two (a 1 MiB first bucket), powerSGD_hook's future
    # callbacks issued their gloo all-reduces in different orders on the two ranks and both
    # waited forever (torch 2.13, here)
    ddp = DistributedDataParallel(model, bucket_cap_mb=64)
    if hook == "powersgd":
        state = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=2,
            start_powerSGD_iter=2,
            use_error_feedback=True,
            warm_start=True,
        )
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(BATCH, SIZES[0], generator=gen)
    y = torch.randn(BATCH, SIZES[2], generator=gen)
    try:
        while (n := conn.recv()) is not None:
            times = []
            for _ in range(n):
                dist.barrier()
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
                times.append(time.perf_counter() - t0)
            conn.send(times)
    finally:
        dist.destroy_process_group()


class TorchDDP:
    """Two DDP ranks in child processes; ``step_time()`` runs one step, returns rank 0's time."""

    def __init__(self, hook: str, timeout_s: float = 300.0):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        port = _free_port()
        self.conns, self.procs = [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_torch_worker, args=(rank, port, hook, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def steps(self, n: int) -> list[float]:
        try:
            for c in self.conns:
                c.send(n)
            times = []
            for c in self.conns:
                if not c.poll(self.timeout_s):
                    raise RuntimeError(
                        f"a torch DDP rank did not answer within {self.timeout_s:.0f} s "
                        "(a gloo collective deadlock?)"
                    )
                times.append(c.recv())
        except (EOFError, BrokenPipeError) as e:
            codes = [p.exitcode for p in self.procs]
            raise RuntimeError(
                f"a torch DDP rank died (exit codes {codes}; its traceback is above)"
            ) from e
        return times[0]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def jax_step(reducer):
    """jaxcomp's 2-worker step with ``reducer`` and the same MLP, loss, data and optimizer."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxcomp import comm
    from jaxcomp import parallel

    mesh = comm.make_mesh([("data", 2)], devices=jax.devices()[:2])
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        f"dense{i}": {
            "kernel": jax.random.normal(keys[i], (SIZES[i], SIZES[i + 1])) / SIZES[i] ** 0.5,
            "bias": jnp.zeros(SIZES[i + 1]),
        }
        for i in range(2)
    }

    def loss_fn(p, batch):
        x, y = batch
        h = jax.nn.relu(x @ p["dense0"]["kernel"] + p["dense0"]["bias"])
        out = h @ p["dense1"]["kernel"] + p["dense1"]["bias"]
        return jnp.mean((out - y) ** 2)

    tx = optax.chain(reducer, optax.sgd(LR, momentum=MOMENTUM))
    dp = parallel.data_parallel(loss_fn, tx, mesh)
    batch = dp.shard_batch(
        (
            jax.random.normal(keys[2], (2 * BATCH, SIZES[0])),
            jax.random.normal(keys[3], (2 * BATCH, SIZES[2])),
        )
    )
    box = [dp.init(params)]

    def step():
        box[0], metrics = dp.step(box[0], batch)
        return metrics["loss"]

    return step


def run(repeats: int = 20, warmup: int = 3) -> list[dict]:
    """Times both rows, alternating jaxcomp and torch step by step; returns records."""
    import jax
    import numpy as np

    from jaxcomp import compressors
    from jaxcomp import feedback
    from jaxcomp import transforms
    from jaxcomp.bench import _common

    rows = [
        (
            "ddp_dense",
            lambda: transforms.compressed_mean(compressors.identity(), path="dense"),
            "dense",
        ),
        (
            "ddp_powersgd_r2",
            lambda: transforms.compressed_mean(feedback.error_feedback(compressors.power_sgd(2))),
            "powersgd",
        ),
    ]
    results = []
    for label, reducer, hook in rows:
        step = jax_step(reducer())
        peer = TorchDDP(hook)
        try:
            for _ in range(warmup):
                jax.block_until_ready(step())
            peer.steps(warmup)
            tj, tt = [], []
            rng = np.random.default_rng(0)
            for _ in range(repeats):
                for side in rng.permutation(2):
                    if side == 0:
                        t0 = time.perf_counter()
                        jax.block_until_ready(step())
                        tj.append(time.perf_counter() - t0)
                    else:
                        tt += peer.steps(1)
        finally:
            peer.close()
        results.append(_common.side_by_side(label, tj, tt))
    return results
