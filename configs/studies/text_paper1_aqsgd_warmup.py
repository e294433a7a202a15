r"""Paper 1, AQ-SGD with its uncompressed warm-up epoch on a language model: TopK 10% on the
activations with AQ-SGD after one uncompressed epoch, on 2 data replicas (each with caches of
its own), against plain TopK and EF21 with the same warm-up, with Adam and
SGD-momentum.

  python -m jaxcomp.study run text_paper1_aqsgd_warmup --workdir runs/text_paper1_aqsgd_warmup
  python -m jaxcomp.study report runs/text_paper1_aqsgd_warmup

The setting of ``text_paper1_feedback`` (its cells without a warm-up, and its dense baseline:
8.00 / 10.19 ppl), with ``pipeline.warmup_epochs = 1``: the byte-level GPT of
``configs/text_gpt_pipeline.py`` in 4 pipeline stages, the training split cut to 3,200 windows
(an epoch is 50 steps of 64), 150 steps: one uncompressed epoch that fills AQ-SGD's per-sample
caches (SPEC.md section 1.5), then 2 compressed epochs in which each sample is sent twice.
Activation-gradients travel uncompressed (``independent``). On the mesh's 2 data replicas,
each with its own caches, the trainer's loader keeps sample ``i`` on replica ``i mod 2`` (its
per-replica shards, since 2026-12-05; before, one shuffle of the whole split sent about half
the revisits to the other replica's empty cache). Adam lr 3e-3, SGD-momentum lr 0.1, constant,
gradient clipping 1.0; evaluated every 75 steps. 3 variants x 2 optimizers x 2 seeds = 12 runs;
the same AQ-SGD on one pipeline replica (``topk10 aq-sgd warm 1 replica``) runs in
``text_paper1_aqsgd_caches``, so that each study fits 15 minutes.

Expected runtime: ~13 min on 2 idle cores (see docs/results/text_paper1_aqsgd_warmup/README.md).
``--smoke``: 12 runs of 2 steps. Results: docs/results/text_paper1_aqsgd_warmup.

Finding tested (Rudakov et al., 2024; SPEC.md sections 1.1, 1.5): with its warm-up, AQ-SGD
trains the pipeline with compressed activations better than plain compression and than the
other feedback (``text_paper1_feedback`` found EF21 ahead of AQ-SGD without the warm-up).
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
    "pipeline.warmup_epochs": 1,
}
TOPK = {"name": "top_k", "fraction": 0.1, "per_sample": True}
VARIANTS = {
    "topk10 warm": {"pipeline.forward": TOPK},
    "topk10 ef21 warm": {"pipeline.forward": {**TOPK, "feedback": "ef21"}},
    "topk10 aq-sgd warm": {"pipeline.forward": {**TOPK, "feedback": "aq_sgd"}},
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm", lr={"adam": 3e-3, "sgdm": 0.1})}
SEEDS = (0, 1)
BASELINE = "topk10 warm"
