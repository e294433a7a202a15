r"""Paper 1, AQ-SGD with TopK: activations compressed by TopK at 30, 10 and 5% with AQ-SGD
(each sample's activation sent as a compressed change against the last value seen for that
sample) and without it, against an uncompressed pipeline, with Adam and SGD-momentum.

  python -m jaxcomp.study run paper1_aqsgd --workdir runs/paper1_aqsgd
  python -m jaxcomp.study report runs/paper1_aqsgd

The digits MLP cut into 4 pipeline stages on 8 fake CPU devices (``configs/digits_pipeline.py``),
400 steps (~36 passes over the 1,438 training digits, so every sample's buffer is refreshed
often), evaluated every 100 steps with compression on and off; activation-gradients are sent
uncompressed, so that the forward compression is the only difference; 7 variants x 2
optimizers x 2 seeds = 28 runs.

Expected runtime: 440 s (7.3 min) measured for the whole study on 2 shared CPU cores (load
average 5.8-6.1; docs/results/paper1_aqsgd/report.md). ``--smoke``: 28 runs of 2 steps.

Finding tested (Rudakov et al., 2024, abstract; SPEC.md section 1.1): with AQ-SGD + TopK, a
TopK stronger than K = 30% (keeping fewer than 30%) hurts significantly.
"""

from jaxcomp.study import optimizer_axis

CONFIG = "digits_pipeline"
COMMON = {
    "total_steps": 400,
    "eval_every": 100,
    "checkpoint_every": 200,
    "log_every": 50,
    "pipeline.backward": "identity",
}
LEVELS = (0.3, 0.1, 0.05)


def _topk(fraction, **feedback):
    return {"pipeline.forward": {"name": "top_k", "fraction": fraction, "per_sample": True,
                                 **feedback}}  # fmt: skip


VARIANTS = {
    "dense": {"pipeline.forward": "identity"},
    **{f"topk{round(f * 100)}": _topk(f) for f in LEVELS},
    **{f"topk{round(f * 100)} aq-sgd": _topk(f, feedback="aq_sgd") for f in LEVELS},
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm")}
SEEDS = (0, 1)
BASELINE = "dense"
