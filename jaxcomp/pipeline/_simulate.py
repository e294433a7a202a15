"""The single-device simulation: the model with compression inserted at its cut points."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.comm import _send
from jaxcomp.pipeline import _batch
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _gpipe
from jaxcomp.pipeline import _links
from jaxcomp.pipeline import _params
from jaxcomp.pipeline import _prepare


def _live(states: tuple[_links.LinkState, ...]):
    """Per boundary, the forward and backward ends at their live slots (see ``_links``)."""
    fwd, bwd = [], []
    for b, st in enumerate(states):
        at = lambda tree, i: jax.tree.map(lambda a: a[i], tree)  # noqa: E731
        fwd.append(_send.ChannelStates(at(st.forward.send, b), at(st.forward.recv, b + 1)))
        bwd.append(_send.ChannelStates(at(st.backward.send, b + 1), at(st.backward.recv, b)))
    return tuple(fwd), tuple(bwd)


def _write_live(states, fwd, bwd):
    def put(tree, i, value):
        return jax.tree.map(lambda a, v: a.at[i].set(v), tree, value)

    out = []
    for b, (st, f, w) in enumerate(zip(states, fwd, bwd)):
        forward = _send.ChannelStates(put(st.forward.send, b, f.send),
                                      put(st.forward.recv, b + 1, f.recv))  # fmt: skip
        backward = _send.ChannelStates(put(st.backward.send, b + 1, w.send),
                                       put(st.backward.recv, b, w.recv))  # fmt: skip
        out.append(_links.LinkState(forward, backward))
    return tuple(out)


def _run(
    model, links, m_, params_seq, x, labels, ids, key, fwd, tokens, compress, collect, metrics
):
    """Scans the microbatches through all stages, links at the cut points.

    Microbatch ``m`` crosses boundary ``b`` with ``link_key(key, b, m)``, in the same order per
    boundary as the distributed schedule (forward ``m = 0..M-1``, backward reversed), so every
    channel state sees the same sequence of updates.
    """
    num = model.num_stages

    def body(carry, m):
        fwd, tokens, loss_sum, metrics_sum = carry
        fwd, tokens = list(fwd), list(tokens)
        h = x[m]
        for b, lk in enumerate(links):
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
                compress=compress,
            )
        y = model.stages[num - 1](params_seq[num - 1], h)
        loss, metrics = _prepare.split_loss(model.loss_fn(y, jax.tree.map(lambda a: a[m], labels)))
        loss_sum = loss_sum + loss.astype(jnp.float32)
        metrics_sum = jax.tree.map(lambda s, v: s + v.astype(jnp.float32), metrics_sum, metrics)
        return (tuple(fwd), tuple(tokens), loss_sum, metrics_sum), (y if collect else None)

    carry = (fwd, tokens, jnp.zeros((), jnp.float32),
             jax.tree.map(lambda s: jnp.zeros((), jnp.float32), metrics))  # fmt: skip
    (fwd, tokens, loss_sum, metrics_sum), ys = lax.scan(body, carry, jnp.arange(m_))
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
        expected = jax.eval_shape(lambda: _links.init_link_states(links, prep.shapes, lead))
        _links.check_link_states(link_states, expected)
        x = _batch.microbatches(prep.batch.inputs, m_)
        labels = _batch.microbatches(prep.batch.labels, m_)
        ids = None if prep.batch.ids is None else _batch.microbatches(prep.batch.ids, m_)
        fwd0, bwd0 = _live(link_states)

        def objective(params_seq, tokens):
            fwd, tokens, loss, metrics, _ = _run(
                model,
                links,
                m_,
                params_seq,
                x,
                labels,
                ids,
                key,
                fwd0,
                tokens,
                compress,
                False,
                prep.metrics,
            )
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
        new_states = _write_live(link_states, fwd, bwd)
        metrics = {
            "loss": loss,
            **metrics,
            **_prepare.bytes_metrics(prep, links, m_, compress, True),
        }
        return loss, grads, new_states, metrics

    def evaluate(params, batch, key=None, compress=False):
        compress = _prepare.check_compress(compress)
        prep = prepare(params, batch, need_ids=False)
        elinks = _gpipe.eval_links(links)
        x = _batch.microbatches(prep.batch.inputs, m_)
        labels = _batch.microbatches(prep.batch.labels, m_)
        fwd = tuple(_send.init_channel_states(lk.forward, s) for lk, s in zip(elinks, prep.shapes))
        tokens = tuple(_send.init_channel_states(None, s) for s in prep.shapes)
        _, _, loss, metrics, ys = _run(
            model, elinks, m_, stage_params(params), x, labels, None, key, fwd, tokens,
            compress, True, prep.metrics,
        )  # fmt: skip
        metrics = {"loss": loss, **metrics,
                   **_prepare.bytes_metrics(prep, elinks, m_, compress, False)}  # fmt: skip
        return loss, metrics, _batch.unmicrobatch(ys)

    def bytes_per_step(params, batch, compress=True, train=True):
        prep = prepare(params, batch, need_ids=False)
        use = links if train else _gpipe.eval_links(links)
        return _links.step_bytes(use, prep.shapes, m_, compress, train)

    return _prepare.Pipeline(init, step, evaluate, bytes_per_step, num, m_, links)
