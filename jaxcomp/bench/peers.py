"""Side by side with PyTorch: jaxcomp's codecs against the torch a user would write.

``python -m jaxcomp.bench peers [--json PATH] [--repeats R] [--n N]`` (needs the optional
``peers`` extra: ``pip install 'jaxcomp[peers]'``, the CPU torch wheel; skipped with a message
when torch is not installed; not part of CI).

Every row times jaxcomp's jitted encode then decode and the torch equivalent on the same
``float32`` data, alternating call by call (:func:`jaxcomp.bench._common.round_robin`, with
each side's own ``x * 1.0001`` copy as the shared baseline), and reports the medians, the
interquartile ranges and ``jax_over_torch``:

* ``int8``: ``quantize(8)`` vs ``torch.quantize_per_tensor(x, absmax / 127, 0, qint8)`` and
  ``dequantize``;
* ``topk1%`` and ``topk10%_per_sample``: exact TopK of ``|x|`` vs ``torch.topk`` of ``|x|``, a
  gather of the values and a scatter into zeros;
* ``powersgd_r4``: one PowerSGD round on a square matrix vs the math of torch's
  ``powerSGD_hook`` (``M Q``, ``_orthogonalize``, ``M^T P``, ``P Q^T``).

* ``ddp_dense`` and ``ddp_powersgd_r2``: a 2-worker data-parallel training step (an MLP of
  4.2M parameters, forward, backward, averaging, SGD with momentum) against torch
  ``DistributedDataParallel`` over gloo, plain and with ``powerSGD_hook`` (rank 2, error
  feedback), the two sides alternating step by step (:mod:`jaxcomp.bench._peers_ddp`; 2
  torch processes of one thread each; ``--no-ddp`` leaves these rows out).
"""

from __future__ import annotations

import math

from jaxcomp._cpu import HostMalloc
from jaxcomp.bench import _common

_common.request_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxcomp import compressors  # noqa: E402
from jaxcomp.bench import _peers_ddp  # noqa: E402


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def torch_rows(torch, n: int):
    """(label, torch callable, its args, jax codec, input shape) per row."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    side = math.isqrt(n)
    rows_shape = (1024, n // 1024)

    def int8(x):
        scale = float(x.abs().max()) / 127.0 or 1.0
        q = torch.quantize_per_tensor(x, scale, 0, torch.qint8)
        return q.dequantize()

    def topk(x, k):
        _, idx = torch.topk(x.abs(), k, sorted=False)
        return torch.zeros_like(x).scatter_(0, idx, x.gather(0, idx))

    def topk_rows(x, k):
        _, idx = torch.topk(x.abs(), k, dim=1, sorted=False)
        return torch.zeros_like(x).scatter_(1, idx, x.gather(1, idx))

    def powersgd(m, q):
        p = m @ q
        _orthogonalize(p[None])  # in place; torch 2.13 needs a batched [1, n, r] tensor
        q2 = m.t() @ p
        return p @ q2.t()

    k1 = compressors.kept_count(n, 0.01, None)
    k10 = compressors.kept_count(rows_shape[1], 0.1, None)
    return [
        ("int8", int8, (), compressors.quantize(8), (n,)),
        ("topk1%", topk, (k1,), compressors.top_k(0.01), (n,)),
        (
            "topk10%_per_sample",
            topk_rows,
            (k10,),
            compressors.top_k(0.1, per_sample=True),
            rows_shape,
        ),
        ("powersgd_r4", powersgd, ("q",), compressors.power_sgd(4), (side, side)),
    ]


def _print_row(r: dict) -> None:
    print(
        f"  {r['name']:20s} jax {r['jax_time_s'] * 1e3:8.2f} ms  torch "
        f"{r['torch_time_s'] * 1e3:8.2f} ms  jax/torch {r['jax_over_torch']:.2f}"
    )


def run(n: int = 4 * 1024 * 1024, repeats: int = 20, ddp: bool = True) -> tuple[list[dict], dict]:
    """Times every row; returns (records, run info)."""
    torch = _torch()
    x_np = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    x_t = torch.from_numpy(x_np.copy())
    x_j = jnp.asarray(x_np)
    rows = torch_rows(torch, n)
    candidates, meta = [], []
    for label, fn, extra, codec, shape in rows:
        xt = x_t.reshape(shape) if math.prod(shape) == n else torch.randn(shape)
        xj = x_j.reshape(shape) if math.prod(shape) == n else jnp.asarray(xt.numpy())
        if extra == ("q",):
            extra = (torch.randn(shape[1], 4),)
        state = codec.init(xj)
        encode = jax.jit(lambda x, s, codec=codec: codec.compress(x, s, None)[0])
        decode = jax.jit(lambda p, x, codec=codec: codec.decompress(p, x))
        payload = encode(xj, state)
        jax_calls = [(encode, (xj, state)), (decode, (payload, xj))]
        torch_calls = [(lambda fn=fn, xt=xt, extra=extra: fn(xt, *extra), ())]
        candidates += [jax_calls, torch_calls]
        meta.append(label)
    copy_j = jax.jit(lambda x: x * 1.0001)
    load_before = _common.load_average()
    base, timed = _common.round_robin([(copy_j, (x_j,))], candidates, repeats)
    # torch's own copy, alternating with jax's: both baselines in one more round-robin
    _, (copy_t,) = _common.round_robin([(copy_j, (x_j,))], [[(lambda: x_t * 1.0001, ())]], repeats)
    results = []
    for i, label in enumerate(meta):
        tj, tt = timed[2 * i], timed[2 * i + 1]
        results.append(_common.side_by_side(label, tj.samples, tt.samples))
        _print_row(results[-1])
    if ddp:
        for r in _peers_ddp.run(repeats):
            results.append(r)
            _print_row(r)
    load_after = _common.load_average()
    info = dict(
        jax_copy_time_s=_common.spread(base.samples)["median"],
        torch_copy_time_s=_common.spread(copy_t.samples)["median"],
        torch_version=torch.__version__,
        torch_threads=torch.get_num_threads(),
        repeats=repeats,
        load_before=load_before,
        load_after=load_after,
    )
    return results, info


def main(argv: list[str] | None = None, host_malloc: HostMalloc | None = None) -> int:
    p = _common.parser(__doc__, __name__)
    p.add_argument("--n", type=int, default=4 * 1024 * 1024, help="elements per input")
    p.add_argument(
        "--no-ddp", action="store_true", help="leave out the 2-worker DDP training-step rows"
    )
    args = p.parse_args(argv)
    if _torch() is None:
        print(
            "peers: skipped, torch is not installed (pip install 'jaxcomp[peers]' in a "
            "separate environment; the CPU wheel torch==2.13.0)."
        )
        return 0
    if args.n % 1024 or math.isqrt(args.n) ** 2 != args.n:
        p.error(f"--n must be a square multiple of 1024; got {args.n}")
    results, info = run(args.n, args.repeats, ddp=not args.no_ddp)
    print(
        f"copy: jax {info['jax_copy_time_s'] * 1e3:.3f} ms, torch "
        f"{info['torch_copy_time_s'] * 1e3:.3f} ms; load {info['load_before']} -> "
        f"{info['load_after']}"
    )
    _common.print_table(
        results,
        [
            ("name", "s"),
            ("jax_time_s", ".5f"),
            ("jax_q1_s", ".5f"),
            ("jax_q3_s", ".5f"),
            ("torch_time_s", ".5f"),
            ("torch_q1_s", ".5f"),
            ("torch_q3_s", ".5f"),
            ("jax_over_torch", ".2f"),
        ],
    )
    _common.write_json(args.json, "peers", results, host_malloc=host_malloc, **info)
    return 0
