r"""Paper 1, error feedback: TopK 10% on both directions with no feedback, with error feedback
(EF, one buffer per microbatch slot), with EF keyed by sample id (per-sample buffers) and with
EF21, against an uncompressed pipeline, with Adam and SGD-momentum.

  python -m jaxcomp.study run paper1_error_feedback --workdir runs/paper1_error_feedback
  python -m jaxcomp.study report runs/paper1_error_feedback

The digits MLP cut into 4 pipeline stages on 8 fake CPU devices (``configs/digits_pipeline.py``),
400 steps, evaluated every 100 steps with compression on and off; 5 variants x 2 optimizers x
2 seeds = 20 runs.

Expected runtime: 303 s (5.1 min) measured for the whole study on 2 shared CPU cores (load
average 5.8-6.7; docs/results/paper1_error_feedback/report.md). ``--smoke``: 20 runs of 2 steps.

Findings tested (Rudakov et al., 2024, abstract; SPEC.md sections 1.1, 1.5): error feedback
does not improve training over plain compression, but it allows inference without compression
at almost no quality drop (the report's "off" column close to its "on" column).
"""

from jaxcomp.study import optimizer_axis

CONFIG = "digits_pipeline"
COMMON = {"total_steps": 400, "eval_every": 100, "checkpoint_every": 200, "log_every": 50}
TOPK = {"name": "top_k", "fraction": 0.1, "per_sample": True}


def _both(**feedback):
    codec = {**TOPK, **feedback}
    return {"pipeline.forward": codec, "pipeline.backward": codec}


VARIANTS = {
    "dense": {"pipeline.forward": "identity", "pipeline.backward": "identity"},
    "topk10": _both(),
    "topk10 ef": _both(feedback="ef"),
    "topk10 ef per-sample": _both(feedback="ef", per_sample_buffers=True),
    "topk10 ef21": _both(feedback="ef21"),
}
AXES = {"optimizer": optimizer_axis("adam", "sgdm")}
SEEDS = (0, 1)
BASELINE = "dense"
