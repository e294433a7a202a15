r"""A small GPT on the text that ships with Python: dense data parallelism on 8 devices, the
uncompressed baseline of the language-model studies.

A byte-level GPT-2-style decoder (4 blocks, width 64, 4 heads, context 32 bytes)
on ``pydoc_text``: Python's bundled help topics, split by document so that no validation text
is trained on (``jaxcomp.data.pydoc_text``; the split's identity and the validation split's
unigram perplexity go into ``summary.json``). Adam with a constant learning rate (Accordion's
detector reads the schedule: a decaying one marks every check critical), gradient clipping 1.0.

  python -m jaxcomp.main --config configs/text_gpt_dense.py --workdir runs/text_gpt_dense

Expected: ~1 minute on 2 idle CPU cores (600 steps at ~12 steps/s, 58 s in all with the
compiles); validation perplexity ~4.5 at step 600 (6.8 at 200, 5.0 at 400) against the
validation split's unigram perplexity of 26.1: 5.8x below it. Next-byte accuracy ~0.58.
(docs/results/text_exploration.md, "The dense run".)
"""

import ml_collections


def get_config(arg=None):
    smoke = arg == "smoke"
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.mode = "dense"
    c.mesh = [("data", 8)]
    c.model_name = "gpt"
    c.model = dict(
        vocab_size=256, seq_len=32, dim=64, num_blocks=4, num_heads=4,
        cuts=("block0", "block1", "block2"),
    )  # fmt: skip
    c.data_name = "pydoc_text"
    c.data = dict(seq_len=32)
    c.batch_size = 64
    c.eval_batch_size = 128
    c.optax_name = "adam"
    c.lr = 3e-3
    c.grad_clip_norm = 1.0
    c.total_steps = 2 if smoke else 600
    c.log_every = 1 if smoke else 50
    c.eval_every = 0 if smoke else 200
    c.checkpoint_every = 0 if smoke else 200
    if smoke:
        # the wiring on one block: each block adds per-leaf codecs and factorised layers in
        # the configs built on this one
        c.model.update(seq_len=16, dim=16, num_heads=2, num_blocks=1, cuts=())
        c.data.seq_len = 16
        c.batch_size = 16
    return c
