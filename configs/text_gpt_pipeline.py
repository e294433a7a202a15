r"""The small GPT of ``text_gpt_dense`` as a 4-stage compressed pipeline on Python's bundled text.

The decoder (embedding + block 0 | block 1 | block 2 | block 3 + head) on a ``data`` 2 x
``stage`` 4 mesh of 8 (fake) devices, 4 microbatches; every boundary sends its activations
(``[seq_len, dim]`` per sample) with TopK 10% per sample and the backward reuses the forward
mask (``shared_mask``: paper 1's GPT-2 hooks). Evaluation reports validation loss, accuracy and
perplexity with boundary compression on and off.

  python -m jaxcomp.main --config configs/text_gpt_pipeline.py --workdir runs/text_gpt_pp
The uncompressed pipeline:
  python -m jaxcomp.main --config configs/text_gpt_pipeline.py --workdir runs/text_gpt_pp_id \
      --set 'pipeline.forward="identity"' --set 'pipeline.backward_mode="independent"'

Expected: ~3.5 minutes on 2 shared CPU cores (600 steps, 196 s at load average 3-9); validation
perplexity ~5.6 with compression on and ~8.7 off at step 600 (unigram: 26.1; the dense
``text_gpt_dense``: 4.5), 192.19 KiB per step on the boundaries against 1.50 MiB uncompressed
(8.0x). (docs/results/text_exploration.md, "The configs' runs".)
"""

import pathlib

from jaxcomp.main import load_config


def get_config(arg=None):
    base = pathlib.Path(__file__).with_name("text_gpt_dense.py")
    c = load_config(f"{base}" + (f":{arg}" if arg else ""))
    c.mode = "pipeline"
    c.mesh = [("data", 2), ("stage", 4)]
    c.pipeline = dict(
        num_microbatches=4,
        forward=dict(name="top_k", fraction=0.1, per_sample=True),
        backward_mode="shared_mask",
    )
    if arg == "smoke":  # the one block cut into 2 stages (embed, block0 | head), 2 microbatches
        c.mesh = [("data", 4), ("stage", 2)]
        c.model.cuts = ("block0",)
        c.pipeline.num_microbatches = 2
    return c
