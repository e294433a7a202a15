r"""Paper 1, AQ-SGD's caches filled two other ways on a language model: TopK 10% on the
activations with AQ-SGD without a warm-up (its caches filled by the first compressed epoch, on
2 data replicas), and after its uncompressed warm-up epoch on one pipeline replica (every
revisit finds its cache), with Adam and SGD-momentum.

  python -m jaxcomp.study run text_paper1_aqsgd_caches --workdir runs/text_paper1_aqsgd_caches
  python -m jaxcomp.study report runs/text_paper1_aqsgd_caches

The cells moved here from ``text_paper1_feedback`` (``topk10 aq-sgd``) and
``text_paper1_aqsgd_warmup`` (``topk10 aq-sgd warm 1 replica``) so that each of the three
studies runs within 15 minutes; their overrides are unchanged, so are their runs and their
comparisons (dense, plain TopK, EF, EF21 in ``text_paper1_feedback``; plain, EF21 and AQ-SGD
on 2 replicas with the warm-up in ``text_paper1_aqsgd_warmup``). The byte-level GPT of
``configs/text_gpt_pipeline.py`` in 4 pipeline stages, the training split cut to 3,200 windows
(an epoch is 50 steps of 64), 150 steps, activation-gradients uncompressed (``independent``);
the ``1 replica`` cells run the batch on one pipeline (``stage`` 4, 4 of the 8 devices). Adam
lr 3e-3, SGD-momentum lr 0.1, constant, gradient clipping 1.0; evaluated every 75 steps.
2 variants x 2 optimizers x 2 seeds = 8 runs.

Expected runtime: ~12 min on 2 idle cores (see docs/results/text_paper1_aqsgd_caches/README.md).
``--smoke``: 8 runs of 2 steps. Results: docs/results/text_paper1_aqsgd_caches.

Findings tested (Rudakov et al., 2024, abstract; SPEC.md sections 1.1, 1.5): error feedback,
here AQ-SGD without its warm-up, does not improve training over plain compression, and allows
inference without compression at almost no quality drop; with its warm-up, AQ-SGD trains as
well on one pipeline replica, where no cache is ever split, as on two.
"""

from jaxcomp.study import optimizer_axis

CONFIG = "text_gpt_pipeline"
COMMON = {
    "total_steps": 150,
    "eval_every": 75,
    "checkpoint_every": 75,
    "log_every": 25,
    "data.max_train_windows": 3200,
    "pipeline.backward_mode": "independent",
}
AQ_SGD = {"name": "top_k", "fraction": 0.1, "per_sample": True, "feedback": "aq_sgd"}
VARIANTS = {
    "topk10 aq-sgd": {"pipeline.forward": AQ_SGD},
    "topk10 aq-sgd warm 1 replica": {
        "pipeline.forward": AQ_SGD,
        "pipeline.warmup_epochs": 1,
        "mesh": [("stage", 4)],
    },
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm", lr={"adam": 3e-3, "sgdm": 0.1})}
SEEDS = (0, 1)
BASELINE = "topk10 aq-sgd"
