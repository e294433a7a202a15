r"""The peer on the same link: torch DDP (gloo) training the digits MLP on a lab's hosts.

The lab runs this module once per host (``python -m jaxcomp.lab run ... -- python -m
jaxcomp.lab._torch_peer ...``); each host forks ``ranks_per_host`` DDP ranks (default: the
lab's ``--devices``), so a lab of 2 hosts x 4 devices trains as 8 gloo ranks, ranks ``4 h ..
4 h + 3`` on host ``h``: the layout of jaxcomp's 2 x 4 cells (every CPU device a gloo
rank, one flat ring over all 8, two of its hops across the hosts' links). Every rank runs the
jaxcomp digits cell's step on its 1/``world`` share of the same global batch (the trainer's
:class:`~jaxcomp.data.Loader`, seed 0: the same examples in the same order), one thread each:

* ``--hook dense``: DDP's own all-reduce, Adam (lr 1e-3), as ``configs/digits_dense.py``;
* ``--hook powersgd``: ``powerSGD_hook`` with ``PowerSGDState(matrix_approximation_rank=2,
  use_error_feedback=True, warm_start=True, start_powerSGD_iter=2)`` (DDP's minimum with error
  feedback: the first two steps all-reduce dense), SGD with momentum 0.9 (lr 0.05), as the
  lab's PowerSGD r2 + EF cell (``configs/digits_accordion.py`` with ``compressed_mean``).

The model is ``configs/digits_*``'s MLP: 64-256-256-256-10, ReLU, softmax cross-entropy; the
whole gradient in one DDP bucket (torch's PowerSGD then sends what jaxcomp's does: the biases
dense, ``P`` and ``Q`` of each weight, 15,992 bytes a step). A step is timed as the trainer
times its own (``timing.jsonl``: from fetching the batch to the loss on the host); rank 0
writes ``timing.jsonl`` in the trainer's format (so
:func:`jaxcomp.study._network.step_times` reads both alike) and ``summary.json``: the layout,
the bytes each host's NIC sent per step over the timed steps (``/sys/class/net``, headers
included), the test loss before training, and the test accuracy and loss after it.

References:
  Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
  Optimization", NeurIPS 2019 (the hook's algorithm).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import sys
import time

from jaxcomp import data

HOOKS = ("dense", "powersgd")
SIZES = (64, 256, 256, 256, 10)
PORT = 29518  # the lab's coordinator holds 29517; both only inside the lab's namespaces
GLOBAL_BATCH = 128
OPTIMIZERS = {"dense": ("adam", 1e-3), "powersgd": ("sgd", 0.05)}
POWERSGD = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, use_error_feedback=True,
                warm_start=True)  # fmt: skip


def _nic_tx_bytes() -> int:
    """Bytes sent by this namespace's NICs (every interface but loopback), headers included."""
    total = 0
    for nic in os.listdir("/sys/class/net"):
        if nic != "lo":
            with open(f"/sys/class/net/{nic}/statistics/tx_bytes") as f:
                total += int(f.read())
    return total


def _model(torch):
    layers = []
    for i in range(len(SIZES) - 1):
        layers.append(torch.nn.Linear(SIZES[i], SIZES[i + 1]))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _evaluate(torch, model, test) -> tuple[float, float]:
    """Accuracy and mean cross-entropy on the whole test split."""
    with torch.no_grad():
        logits = model(torch.from_numpy(test["x"]))
        labels = torch.from_numpy(test["label"]).long()
        loss = float(torch.nn.functional.cross_entropy(logits, labels))
    return float((logits.argmax(1) == labels).float().mean()), loss


def _worker(rank: int, world: int, local: int, master: str, args, train, test) -> None:
    """One DDP rank: ``args.steps`` timed steps; rank 0 writes the results."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{PORT}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))  # fmt: skip
    torch.manual_seed(0)  # every rank starts from the same weights (DDP also broadcasts rank 0's)
    # one bucket (64 MiB > the 0.6 MB model): with several, powerSGD_hook's callbacks issued
    # their gloo all-reduces in different orders on two ranks and both waited (bench/_peers_ddp)
    ddp = DistributedDataParallel(_model(torch), bucket_cap_mb=64)
    if args.hook == "powersgd":
        state = psgd.PowerSGDState(process_group=None, **POWERSGD)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    name, lr = OPTIMIZERS[args.hook]
    opt = (torch.optim.Adam(ddp.parameters(), lr=lr) if name == "adam"
           else torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9))  # fmt: skip
    share = GLOBAL_BATCH // world
    _, test_loss_before = _evaluate(torch, ddp.module, test)
    loader = data.Loader(train, GLOBAL_BATCH, seed=0)
    pos = loader.initial_state()
    times, tx = [], []
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        if step == args.skip + 1:
            tx.append(_nic_tx_bytes())
        t0 = time.perf_counter()
        batch, pos = loader.next(pos)
        x = torch.from_numpy(batch["x"][rank * share : (rank + 1) * share])
        y = torch.from_numpy(batch["label"][rank * share : (rank + 1) * share]).long()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        loss_value = loss.item()
        now = time.perf_counter()
        times.append({"step": step, "step_s": now - t0, "elapsed_s": now - t_start})
        if not torch.isfinite(torch.tensor(loss_value)):
            raise FloatingPointError(f"rank {rank}: non-finite loss at step {step}")
    tx.append(_nic_tx_bytes())
    accuracy, test_loss = _evaluate(torch, ddp.module, test)
    sent = torch.tensor([float(tx[1] - tx[0]) if local == 0 else 0.0])
    dist.all_reduce(sent)  # the hosts' NICs together
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "timing.jsonl"), "w") as f:
            f.writelines(json.dumps(t) + "\n" for t in times)
        hosts = world // args.ranks_per_host
        summary = {
            "peer": "torch DDP", "torch": torch.__version__, "hook": args.hook,
            "powersgd": POWERSGD if args.hook == "powersgd" else None,
            "optimizer": name, "lr": lr, "model": list(SIZES), "world": world,
            "hosts": hosts, "ranks_per_host": args.ranks_per_host, "batch_per_rank": share,
            "threads_per_rank": torch.get_num_threads(), "steps": args.steps,
            "timed_from_step": args.skip + 1, "final_loss": loss_value,
            "test_accuracy": accuracy, "test_loss": test_loss,
            "test_loss_before": test_loss_before,
            "nic_tx_bytes_per_host_per_step": float(sent[0]) / hosts / (args.steps - args.skip),
        }  # fmt: skip
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    dist.destroy_process_group()


def _run_rank(*a) -> None:
    try:
        _worker(*a)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxcomp.lab._torch_peer",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--hook", choices=HOOKS, required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=4,
                   help="steps before the NIC counters start (DDP's bucket rebuild, "
                   "PowerSGD's dense start)")  # fmt: skip
    p.add_argument("--out", required=True, help="rank 0's timing.jsonl and summary.json")
    p.add_argument("--ranks_per_host", type=int, default=None,
                   help="default: the lab's devices per host")  # fmt: skip
    args = p.parse_args(argv)
    if args.ranks_per_host is None:
        args.ranks_per_host = int(os.environ.get("JAXCOMP_LAB_DEVICES", "1"))
    if args.ranks_per_host < 1 or GLOBAL_BATCH % args.ranks_per_host:
        p.error(f"--ranks_per_host must divide {GLOBAL_BATCH}; got {args.ranks_per_host}")
    if not 0 <= args.skip < args.steps:
        p.error(f"--skip must be in [0, --steps); got {args.skip}")
    return args


def main(argv=None) -> int:
    """Forks this host's ranks (the lab's ``JAX_PROCESS_ID``, ``JAX_NUM_PROCESSES`` and
    ``JAXCOMP_LAB_ADDRESSES`` say where; alone, one host at 127.0.0.1) and waits for them."""
    args = parse_args(argv)
    host = int(os.environ.get("JAX_PROCESS_ID", "0"))
    hosts = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    master = os.environ.get("JAXCOMP_LAB_ADDRESSES", "127.0.0.1").split(",")[0]
    world = hosts * args.ranks_per_host
    if GLOBAL_BATCH % world:
        raise SystemExit(f"error: {world} ranks do not split the batch of {GLOBAL_BATCH}")
    train, test = data.digits("train"), data.digits("test")
    test_arrays = {"x": test.arrays["x"], "label": test.arrays["label"]}
    ctx = multiprocessing.get_context("fork")  # the data is loaded once; torch is imported after
    procs = []
    for local in range(args.ranks_per_host):
        rank = host * args.ranks_per_host + local
        p = ctx.Process(target=_run_rank, args=(rank, world, local, master, args, train,
                                                test_arrays))  # fmt: skip
        p.start()
        procs.append(p)
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        print(f"error: host {host}'s ranks exited {codes}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
