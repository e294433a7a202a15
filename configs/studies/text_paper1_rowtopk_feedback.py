r"""TopK by rows with feedback or a shared mask: does EF21, AQ-SGD or sending the gradient back
at the kept positions add to the blow-up remedy of ``text_paper1_rowtopk``? TopK 10% of the
activations by token rows (``row_axis=-1``) with EF21, with AQ-SGD after its uncompressed warm-up
epoch (``pipeline.warmup_epochs = 1``, as ``text_paper1_aqsgd_warmup``), and with the backward on
the forward's mask (``pipeline.backward_mode = "shared_mask"``), with Adam and SGD-momentum.

  python -m jaxcomp.study run text_paper1_rowtopk_feedback --workdir runs/rowtopk_feedback
  python -m jaxcomp.study report runs/rowtopk_feedback

The setting of ``text_paper1_rowtopk`` and ``text_paper1_feedback``: the byte-level GPT of
``configs/text_gpt_pipeline.py`` in 4 pipeline stages on 8 fake CPU devices, the training split
cut to 3,200 windows, 150 steps of 64, activation-gradients uncompressed
(``backward_mode = "independent"``) but in the shared-mask cells. Adam lr 3e-3, SGD-momentum lr
0.1, constant, gradient clipping 1.0; evaluated and checkpointed every 75 steps. 3 variants x 2
optimizers x 2 seeds = 12 runs; the comparisons (rows alone, EF21 and AQ-SGD on per-sample TopK,
dense) are those studies' cells of the same setting.

Expected runtime: ~10 min on 2 idle cores (see docs/results/text_paper1_rowtopk_feedback/README.md).
``--smoke``: 12 runs of 2 steps. Results: docs/results/text_paper1_rowtopk_feedback.

Findings tested: error feedback does not improve training over plain compression (Rudakov et al.,
2024, abstract; SPEC.md section 1.5; here: over TopK by rows, which already trains); and issue
35's stage-0 probe (``stage0_probe.py`` in the results): Adam's excess gradient norm by rows
comes from the straight-through gradient at the 90% of entries that were zeroed, so sending the
gradient back at the kept positions only should remove it.
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
ROWS = {"name": "top_k", "fraction": 0.1, "row_axis": -1}
VARIANTS = {
    "topk10 rows ef21": {"pipeline.forward": {**ROWS, "feedback": "ef21"}},
    "topk10 rows aq-sgd warm": {
        "pipeline.forward": {**ROWS, "feedback": "aq_sgd"},
        "pipeline.warmup_epochs": 1,
    },
    "topk10 rows shared-mask": {"pipeline.forward": ROWS, "pipeline.backward_mode": "shared_mask"},
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm", lr={"adam": 3e-3, "sgdm": 0.1})}
SEEDS = (0, 1)
BASELINE = "topk10 rows ef21"
