"""The single-device simulation: the model with compression inserted at its cut points."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.comm import _send
from jaxcomp.pipeline import _batch
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _links
from jaxcomp.pipeline import _params
from jaxcomp.pipeline import _prepare


class _Run(NamedTuple):
    """The static inputs of :func:`_run`."""

    model: _config.StagedModel
    links: tuple[_config.Link, ...]
    num_microbatches: int
    metrics: Any
    compress: bool
    collect: bool


def _run(run: _Run, params_seq, x, labels, ids, key, fwd, tokens):
    """Scans the microbatches through all stages, links at the cut points.

    Microbatch ``m`` crosses boundary ``b`` with ``link_key(key, b, m)``, in the same order per
    boundary as the distributed schedule (forward ``m = 0..M-1``, backward reversed), so every
    channel state sees the same sequence of updates. States (and backward tokens) keep their
    ``[S, ...]`` layout: boundary ``b``'s link reads and writes only rows ``b`` and ``b + 1``,
    and of a per-sample buffer only the microbatch's rows (never a whole-buffer copy).
    """
    model, num = run.model, run.model.num_stages

    def body(carry, m):
        fwd, tokens, loss_sum, metrics_sum = carry
        fwd, tokens = list(fwd), list(tokens)
        h = x[m]
        for b, lk in enumerate(run.links):
            h = model.stages[b](params_seq[b], h)
            h, fwd[b], tokens[b] = _send.compressed_transfer(
                h,
                fwd[b],
                tokens[b],
                forward=lk.forward,
                backward=lk.backward,
                key=_links.link_key(key, b, m),
                ids=None if ids is None else ids[m],
                mode=lk.mode,
                compress=run.compress,
                slots=(b, b + 1),
            )
        y = model.stages[num - 1](params_seq[num - 1], h)
        loss, metrics = _prepare.split_loss(model.loss_fn(y, jax.tree.map(lambda a: a[m], labels)))
        loss_sum = loss_sum + loss.astype(jnp.float32)
        metrics_sum = jax.tree.map(lambda s, v: s + v.astype(jnp.float32), metrics_sum, metrics)
        return (tuple(fwd), tuple(tokens), loss_sum, metrics_sum), (y if run.collect else None)

    zero = jnp.zeros((), jnp.float32)
    carry = (tuple(fwd), tuple(tokens), zero, jax.tree.map(lambda _: zero, run.metrics))
    (fwd, tokens, loss_sum, metrics_sum), ys = lax.scan(
        body, carry, jnp.arange(run.num_microbatches)
    )
    m_ = run.num_microbatches
    return fwd, tokens, loss_sum / m_, jax.tree.map(lambda v: v / m_, metrics_sum), ys


def simulate(model: _config.StagedModel, config: _config.PipelineConfig) -> _prepare.Pipeline:
    """The single-device counterpart of :func:`~jaxcomp.pipeline.gpipe`: same numbers, one device.

    The stages run one after the other on each microbatch, and every cut point applies its
    link with :func:`jaxcomp.comm.compressed_transfer`: the same channel calls, keys, sample
    ids and state updates as the distributed pipeline's sends, with nothing sent. For the same
    params, batch, link states and key it returns the same loss, gradients and link states as
    :func:`gpipe` on a stage-only mesh (up to float summation order), in the same layout, so a
    run can switch between the two. It is the fast way to run the paper's sweeps on one device,
    and what Rudakov et al. did ("integrating compression to the model directly").

    Args:
      model: the :class:`StagedModel`.
      config: :class:`PipelineConfig`; ``M`` sets the microbatches that stateful channels
        (EF residuals per position, EF21) see, as in the pipeline.

    Returns:
      A :class:`Pipeline` (``init``, ``step``, ``evaluate``, ``bytes_per_step``); its byte
      counts are those the distributed pipeline would send.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp import compressors, pipeline
      >>> def stage(w, x):
      ...     return jnp.tanh(x @ w)
      >>> model = pipeline.StagedModel((stage,) * 4, lambda y, t: jnp.mean((y - t) ** 2))
      >>> params = [jnp.eye(8)] * 4
      >>> batch = {"x": jnp.ones((16, 8)), "label": jnp.zeros((16, 8))}
      >>> link = pipeline.link(compressors.top_k(0.25, per_sample=True), mode="shared_mask")
      >>> sim = pipeline.simulate(model, pipeline.PipelineConfig(4, link))
      >>> states = sim.init(params, batch)
      >>> loss, grads, states, metrics = jax.jit(sim.step)(params, batch, states, None)
      >>> round(float(loss), 4)
      0.0657
    """
    _config.check_model(model)
    num = model.num_stages
    links = _config.resolve_links(config, num)
    m_ = config.num_microbatches
    lead = (num,)

    def prepare(params, batch, need_ids=None):
        return _prepare.prepare(model, links, m_, params, batch, 1, need_ids)

    def stage_params(params):
        return params.unpack() if isinstance(params, _params.PackedParams) else tuple(params)

    def init(params, batch):
        prep = prepare(params, batch, need_ids=False)
        return jax.jit(lambda: _links.init_link_states(links, prep.shapes, lead))()

    def step(params, batch, link_states, key=None, compress=True):
        compress = _prepare.check_compress(compress)
        prep = prepare(params, batch)
        _links.check_key(links, key, compress)
        _links.check_link_states(link_states, _prepare.expected_states(links, prep, lead))
        x = _batch.microbatches(prep.batch.inputs, m_)
        labels = _batch.microbatches(prep.batch.labels, m_)
        ids = None if prep.batch.ids is None else _batch.microbatches(prep.batch.ids, m_)
        fwd0 = tuple(st.forward for st in link_states)
        bwd0 = tuple(st.backward for st in link_states)
        run = _Run(model, links, m_, prep.metrics, compress, False)

        def objective(params_seq, tokens):
            fwd, tokens, loss, metrics, _ = _run(run, params_seq, x, labels, ids, key, fwd0, tokens)
            seed = sum(_send.seed_backward_state(t, b) for t, b in zip(tokens, bwd0))
            return loss + seed, (loss, metrics, fwd)

        tokens0 = tuple(_send.backward_token(b) for b in bwd0)
        (_, (loss, metrics, fwd)), (grads, bwd) = jax.value_and_grad(
            objective, argnums=(0, 1), has_aux=True
        )(stage_params(params), tokens0)
        if isinstance(params, _params.PackedParams):
            grads = _params.PackedParams(prep.layout.pack(grads), prep.layout)
        else:
            grads = type(params)(grads)
        new_states = tuple(_links.LinkState(f, b) for f, b in zip(fwd, bwd))
        metrics = _prepare.with_bytes({"loss": loss, **metrics}, prep, links, m_, compress, True)
        return loss, grads, new_states, metrics

    def evaluate(params, batch, key=None, compress=False):
        compress = _prepare.check_compress(compress)
        prep = prepare(params, batch, need_ids=False)
        elinks = _links.eval_links(links)
        key = _prepare.eval_key(links, key, compress)
        x = _batch.microbatches(prep.batch.inputs, m_)
        labels = _batch.microbatches(prep.batch.labels, m_)
        fwd = tuple(st.forward for st in _links.init_link_states(elinks, prep.shapes, lead))
        tokens = tuple(_send.init_channel_states(None, s) for s in prep.shapes)
        run = _Run(model, elinks, m_, prep.metrics, compress, True)
        _, _, loss, metrics, ys = _run(run, stage_params(params), x, labels, None, key, fwd, tokens)
        metrics = _prepare.with_bytes({"loss": loss, **metrics}, prep, elinks, m_, compress, False)
        return loss, metrics, _batch.unmicrobatch(ys)

    bytes_per_step = _prepare.bytes_per_step_fn(prepare, links, m_)
    return _prepare.Pipeline(init, step, evaluate, bytes_per_step, num, m_, links)
