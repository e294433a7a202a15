"""grain against jaxcomp.data.Loader on the digits train split (batch 128): time, order, resume.

PYTHONPATH=. tools/cpu-slot python tools/grain_vs_loader.py   (needs `pip install grain`)
"""
# ruff: noqa: E402  (imports timed where they happen)

import time

t = time.perf_counter()
import numpy as np

from jaxcomp.data import _loader

t_jc = time.perf_counter() - t
t = time.perf_counter()
import grain

t_grain = time.perf_counter() - t
print(f"import: jaxcomp.data {t_jc:.2f} s (numpy first), grain {t_grain:.2f} s")

src = _loader.get_dataset("digits", "train", flat=True)
B, SEED = 128, 0
loader = _loader.Loader(src, B, seed=SEED)
n = len(src)


class Src:
    def __len__(self):
        return n

    def __getitem__(self, i):
        out = {k: v for k, v in src.__getitems__(np.array([i])).items()}
        return {k: v[0] for k, v in out.items()} | {"ids": np.int32(i)}


def grain_ds(seed):
    return grain.MapDataset.source(Src()).shuffle(seed=seed).repeat().batch(B, drop_remainder=True)


def loader_epochs(k):
    st = loader.initial_state()
    out = []
    for _ in range(k * loader.steps_per_epoch):
        b, st = loader.next(st)
        out.append(b)
    return out


def grain_epochs(k):
    # batch() over repeat(): a batch may straddle two epochs; index per step
    ds = grain_ds(SEED)
    return [ds[i] for i in range(k * loader.steps_per_epoch)]


for name, fn in (("Loader", loader_epochs), ("grain MapDataset", grain_epochs)):
    fn(1)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        fn(2)
        ts.append(time.perf_counter() - t)
    batches = 2 * loader.steps_per_epoch
    print(f"{name}: 2 epochs ({batches} batches of {B}) median {np.median(ts) * 1e3:.1f} ms")

# the orders: grain's shuffle is its own (index shuffle), not numpy's permutation
g = grain_epochs(2)
ref = loader_epochs(2)
same = all(np.array_equal(a["ids"], b["ids"]) for a, b in zip(g, ref))
print("grain order == Loader order:", same)
e0 = np.concatenate([b["ids"] for b in g[: loader.steps_per_epoch]])
e1 = np.concatenate([b["ids"] for b in g[loader.steps_per_epoch :]])
print("grain epoch 1 reshuffled:", not np.array_equal(e0, e1))

# iterator state: resume bit-identical?
it = iter(grain_ds(SEED).to_iter_dataset())
for _ in range(5):
    next(it)
state = it.get_state()
a = [next(it) for _ in range(4)]
it2 = iter(grain_ds(SEED).to_iter_dataset())
it2.set_state(state)
b = [next(it2) for _ in range(4)]
print(
    "grain iterator resume identical:",
    all(
        np.array_equal(x["x"], y["x"]) and np.array_equal(x["ids"], y["ids"]) for x, y in zip(a, b)
    ),
    "state:",
    state,
)
