"""What AQ-SGD's per-sample caches see in the text studies (not a test, not a study).

Replays the trainer's loader (``jaxcomp.data.Loader``) for the 3,200 training windows, batch
64, 150 steps of ``text_paper1_feedback`` / ``text_paper1_aqsgd_warmup``, with the batch's
halves on the 2 data replicas (``P("data")``: each replica keeps its own caches) and counts, per
epoch, each send of a sample by what its replica's cache holds: nothing yet (first visit), the
sample's last value (it came to the same replica last time), an older one, or nothing while the
other replica has it. Two loaders: ``global`` (the whole split shuffled every epoch with
``default_rng([seed, epoch])``, what the trainer fed AQ-SGD until 2026-12-05) and ``shards``
(``Loader(shards=2)``: sample ``i`` on replica ``i mod 2``, what it feeds per-sample buffers
on 2 replicas since). Pure numpy, a second.

  PYTHONPATH=. python docs/results/text_paper1_aqsgd_warmup/revisits.py
"""

import numpy as np

from jaxcomp import data

N, B, STEPS, R = 3200, 64, 150, 2


class Windows:
    def __len__(self):
        return N

    def __getitems__(self, ids):
        return {"x": np.zeros((len(ids), 1))}


for seed, shards in ((0, 1), (1, 1), (0, R), (1, R)):
    loader = data.Loader(Windows(), B, seed=seed, shards=shards)
    state = loader.initial_state()
    last, anywhere, ages, epochs = {}, {}, [], {}
    for step in range(STEPS):
        batch, state = loader.next(state)
        counts = epochs.setdefault(step // loader.steps_per_epoch, {})
        for r in range(R):
            for i in map(int, batch["ids"][r * B // R : (r + 1) * B // R]):
                if i not in anywhere:
                    kind = "first visit"
                elif (r, i) not in last:
                    kind = "no cache here (other replica's)"
                else:
                    kind = "current" if last[r, i] == anywhere[i] else "older"
                    ages.append(step - last[r, i])
                counts[kind] = counts.get(kind, 0) + 1
                last[r, i] = anywhere[i] = step
    kind = "global" if shards == 1 else "shards"
    print(f"{kind}, seed {seed}: {loader.steps_per_epoch} steps per epoch")
    for epoch, counts in sorted(epochs.items()):
        print(f"  epoch {epoch}: {counts}")
    print(f"  age of a cache found (steps): median {np.median(ages):.0f}, {min(ages)}-{max(ages)}")
