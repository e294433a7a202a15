"""AB-Training (Coquelin et al., 2024): all of its code, in one place.

Its public names are exported where a user looks for them: the optax transform, its config,
state, schedule and metrics by :mod:`jaxcomp.transforms` (``ab_training``, ``ABConfig``, ...),
the grouped data-parallel step by :mod:`jaxcomp.parallel` (``ab_data_parallel``, ``ab_mesh``,
...). Import them from there; the modules here are private.

* :mod:`._config`, :mod:`._schedule`: the settings and the phase schedule;
* :mod:`._layout`, :mod:`._factor`: which parameters are factorised, ``W = A B`` by SVD, the
  factor gradients;
* :mod:`._topology`: groups and their collectives;
* :mod:`._step`, :mod:`._sync`: the dense and AB steps, the phase transitions;
* :mod:`._transform`: the optax transform (one program, the step kind a ``lax.switch``);
* :mod:`._forward`: the factorised forward, ``(x A) B`` instead of ``x W`` in the grouped
  step's AB programs (:func:`jaxcomp.models.factored_dense` for Flax ``nn.Dense``);
* :mod:`._metrics`: metrics and collective bytes per step kind;
* :mod:`._programs`, :mod:`._parallel`: the grouped step, as compiled programs the host strings
  together by the step index.

Layer: below :mod:`jaxcomp.transforms` and :mod:`jaxcomp.parallel`, which re-export it, above
:mod:`jaxcomp.comm`; the grouped step runs on :mod:`jaxcomp._driver`, the step builders' shared
driver.
"""
