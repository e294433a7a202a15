"""Dense data parallelism: the uncompressed baseline every compressed mode is compared with.

Parameters are replicated, the batch is split over every mesh axis, and XLA inserts the
gradient all-reduce (float32, the full parameter size). BatchNorm statistics are computed over
the global batch (a synchronised BatchNorm).
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp._compile import compile_all
from jaxcomp._compile import lower_later
from jaxcomp.models import _staged
from jaxcomp.train import _collectives
from jaxcomp.train import _config
from jaxcomp.train import _mode
from jaxcomp.train import _precision


class DenseState(NamedTuple):
    """Training state of the dense and data-parallel modes."""

    params: tuple  # per stage
    model_state: tuple  # per stage: BatchNorm statistics, or {}
    opt_state: Any
    loss_scale: Any = ()  # float16 compute (dense mode): _precision.LossScale


def make_loss(model: _staged.StagedModel):
    """``loss(params, model_state, batch) -> (loss, (accuracy, model_state))`` for training."""

    def loss_fn(params, model_state, batch):
        variables = _mode.join_variables(params, model_state)
        logits, new_vars = model.apply(variables, batch["x"], train=True)
        _, new_state = _mode.split_variables(new_vars)
        loss = model.loss_fn(logits, batch["label"])
        return loss, (_staged.accuracy(logits, batch["label"]), new_state)

    return loss_fn


def make_eval(model: _staged.StagedModel):
    def eval_fn(params, model_state, batch):
        logits, _ = model.apply(_mode.join_variables(params, model_state), batch["x"])
        return _mode.eval_sums(model, logits, batch)

    return eval_fn


def build_dense(
    config: ml_collections.ConfigDict,
    model: _staged.StagedModel,
    mesh: jax.sharding.Mesh,
    num_train_samples: int,
) -> _mode.Mode:
    """Builds the dense data-parallel mode (``config.mode = "dense"``)."""
    del num_train_samples
    _config.check_sub_config("data_parallel", config.data_parallel, {})
    opt = _config.optimizer(config)
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    n_dev = mesh.size
    _config.check_batch_divisible(config, n_dev, f"the {n_dev} devices")

    def init(key):
        params, model_state = _mode.split_variables(model.init(key))
        return DenseState(params, model_state, opt.init(params), _precision.initial(config))

    loss_fn = make_loss(model)
    eval_fn = make_eval(model)
    scaled = _precision.scaled(config)

    def train_step(state, batch, key):
        del key

        def objective(params, model_state, batch):  # float16: the loss times the scale
            loss, aux = loss_fn(params, model_state, batch)
            return (loss * state.loss_scale.scale if scaled else loss), (loss, aux)

        (_, (loss, (acc, model_state))), grads = jax.value_and_grad(objective, has_aux=True)(
            state.params, state.model_state, batch
        )
        if scaled:
            grads = _precision.unscale(grads, state.loss_scale)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new, finite = _mode.commit_if_finite(
            DenseState(params, model_state, opt_state, state.loss_scale), state, loss, grads,
            replicated=True,
        )  # fmt: skip
        if scaled:
            new = new._replace(loss_scale=_precision.adjust(state.loss_scale, finite))
        metrics = {
            "loss": loss,
            "accuracy": acc,
            "finite": finite.astype(jnp.int32),
            "grad_norm": optax.tree.norm(grads),
        }
        return new, metrics

    def eval_step(state, batch):
        return eval_fn(state.params, state.model_state, batch)

    init_jit = _mode.jit_init(init, out_shardings=replicated)
    eval_jit = jax.jit(eval_step)
    # an abstract key: an eager key under the mesh would compile two programs that the
    # trainer's key (outside it) compiles again
    key_abs = jax.eval_shape(jax.random.key, 0)
    abstract = jax.eval_shape(init, key_abs)
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), abstract
    )
    batch_abs = abstract_batch(model, config.batch_size, batch_sharding)
    eval_abs = abstract_batch(model, config.eval_batch_size, batch_sharding, with_mask=True)
    key_data_abs = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
    train_jit = jax.jit(train_step, donate_argnums=0)
    # the step, the init and the evaluation compiled side by side, each as soon as it is
    # lowered; the latter two lowered outside the mesh, as the trainer calls them, so that
    # JAX's caches serve those calls
    compiled = compile_all({
        "train_step": lower_later(train_jit, abstract, batch_abs, key_data_abs, mesh=mesh),
        "init": lower_later(init_jit, key_abs),
        "eval_step": lower_later(eval_jit, abstract, eval_abs),
    })  # fmt: skip
    train_c = compiled["train_step"]
    wire = _mode.compiled_text_bytes(train_c)
    params_abs = abstract.params
    dense = 4.0 * _mode.param_count(params_abs)
    return _mode.Mode(
        name="dense",
        mesh=mesh,
        init=init_jit,
        train_step=lambda state, batch, key, step: train_c(state, batch, key),
        eval_step=lambda s, b, compressed=False: eval_jit(s, b),
        batch_sharding=batch_sharding,
        wire_bytes=wire,
        dense_bytes=max(dense, wire),
        description=f"dense data parallel over {n_dev} device(s), optax.{config.optax_name}",
        extra={"collectives": _collectives.records(train_c.as_text())},
    )


def abstract_batch(model, batch_size, sharding, with_mask=False) -> dict:
    """ShapeDtypeStructs of a training batch (``x``, ``label``, ``ids``)."""
    x = jax.ShapeDtypeStruct((batch_size, *model.input_shape), model.input_dtype, sharding=sharding)
    label_shape = (
        (batch_size, *model.input_shape) if model.task == "language_model" else (batch_size,)
    )
    out = {
        "x": x,
        "label": jax.ShapeDtypeStruct(label_shape, jnp.int32, sharding=sharding),
        "ids": jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=sharding),
    }
    if with_mask:
        out["mask"] = jax.ShapeDtypeStruct((batch_size,), jnp.float32, sharding=sharding)
    return out
