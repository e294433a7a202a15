r"""Paper 1, error feedback on a language model: TopK 10% on the activations with no feedback,
with error feedback (EF) and with EF21, against an uncompressed pipeline, with Adam and
SGD-momentum; evaluation with compression on and off.

  python -m jaxcomp.study run text_paper1_feedback --workdir runs/text_paper1_feedback
  python -m jaxcomp.study report runs/text_paper1_feedback

The byte-level GPT of ``configs/text_gpt_pipeline.py`` cut into 4 pipeline stages on 8 fake
CPU devices, on Python's bundled help text split by document. AQ-SGD (each sample's activation
sent as a compressed change against the last value seen for that sample) needs each sample seen
several times, which a full epoch (201 steps) per visit does not allow in a short study: the
training split is cut to 3,200 of its 12,864 windows, evenly spaced (``data.max_train_windows``;
the validation split is unchanged), so that 150 steps of 64 make 3 epochs. Activation-gradients
travel uncompressed (``backward_mode = "independent"``), so that the forward channel is the
only difference. Adam lr 3e-3, SGD-momentum lr 0.1, constant, gradient clipping 1.0; evaluated
every 75 steps. 4 variants x 2 optimizers x 2 seeds = 16 runs; AQ-SGD's cells in this setting
(``topk10 aq-sgd``) run in ``text_paper1_aqsgd_caches``, so that each study fits 15 minutes.

Expected runtime: ~12 min on 2 idle cores (see docs/results/text_paper1_feedback/README.md).
``--smoke``: 16 runs of 2 steps. Results: docs/results/text_paper1_feedback.

Findings tested (Rudakov et al., 2024, abstract; SPEC.md sections 1.1, 1.5): error feedback
(EF, EF21; AQ-SGD in ``text_paper1_aqsgd_caches``) does not improve training over plain
compression, but it allows inference without compression at almost no quality drop (the
report's "off" column close to its "on").
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
TOPK = {"name": "top_k", "fraction": 0.1, "per_sample": True}
VARIANTS = {
    "dense": {"pipeline.forward": "identity"},
    "topk10": {"pipeline.forward": TOPK},
    "topk10 ef": {"pipeline.forward": {**TOPK, "feedback": "ef"}},
    "topk10 ef21": {"pipeline.forward": {**TOPK, "feedback": "ef21"}},
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm", lr={"adam": 3e-3, "sgdm": 0.1})}
SEEDS = (0, 1)
BASELINE = "dense"
