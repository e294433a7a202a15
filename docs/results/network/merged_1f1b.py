"""1F1B with both directions of a tick in one permute: how many permutes, and what the cost model
says it would save on the lab's links (costsize, 2026-12-05; an estimate). The engine merges
since e58b298 (merged1f1b; the lab's measurement is in README.md): the per-direction column
plays the moves as they were before, the merged one checks its count against the engine's.

A 1F1B tick's forward sends go from the stages that ran a forward (tick parity = stage parity)
and its backward sends from those that ran a backward (the other parity), so no stage receives
from both sides in one tick and the two moves' pairs together are one permutation. Merged, a
tick is cut at the distinct sizes of both directions' payloads (`pipeline._ticks.move_pieces`).

  tools/cpu-slot env PYTHONPATH=$PWD python docs/results/network/merged_1f1b.py
"""

import json
import os

from jaxcomp import pipeline
from jaxcomp.lab import _calibrate
from jaxcomp.pipeline._ticks import move_pieces
from jaxcomp.study import _fits
from jaxcomp.study import _moves
from jaxcomp.study import _pipeline_model

HERE = os.path.dirname(os.path.abspath(__file__))
PAYLOADS = {"1 KiB both ways": (1024, 1024), "identity 32 KiB": (32768, 32768),
            "quantize 4 / 8 (4,608 / 8,196 B)": (4608, 8196)}  # fmt: skip


def per_direction_moves(schedule, stages, microbatches, fwd, bwd):
    """The moves as the engine made them before merging (to e58b298): a tick's forward
    sends, then its backward sends, each cut at its own payload sizes."""
    out = []
    for row in pipeline.ticks(schedule, stages, microbatches):
        for kind, size in (("F", fwd), ("B", bwd)):
            step = 1 if kind == "F" else -1
            pairs = tuple((s, s + step) for s in range(stages) if 0 <= s + step < stages
                          and row[s] is not None and row[s].kind == kind)  # fmt: skip
            if pairs:
                pieces = move_pieces([size] * len(pairs))
                out.append(tuple(_moves.Permute(tuple(pairs[i] for i in members), high - low)
                                 for low, high, members in pieces))  # fmt: skip
    return out


def merged_moves(schedule, stages, microbatches, fwd, bwd):
    out = []
    for row in pipeline.ticks(schedule, stages, microbatches):
        pairs, sizes = [], []
        for b in range(stages - 1):
            if row[b] is not None and row[b].kind == "F":
                pairs.append((b, b + 1))
                sizes.append(fwd)
            if row[b + 1] is not None and row[b + 1].kind == "B":
                pairs.append((b + 1, b))
                sizes.append(bwd)
        receivers = [d for _, d in pairs]
        assert len(set(receivers)) == len(receivers), "a stage receives twice in one tick"
        if pairs:
            out.append(tuple(_moves.Permute(tuple(pairs[i] for i in members), high - low)
                             for low, high, members in move_pieces(sizes)))  # fmt: skip
    return out


def main() -> None:
    print(
        "| S x M | payloads | rate | permutes per direction / merged | sends per direction ms "
        "| merged ms | saved |"
    )
    print("|---|---|---|---|---|---|---|")
    for stages, m in ((4, 4), (4, 16)):
        for label, (fwd, bwd) in PAYLOADS.items():
            sizes = [(fwd, bwd)] * (stages - 1)
            now = per_direction_moves("1f1b", stages, m, fwd, bwd)
            merged = merged_moves("1f1b", stages, m, fwd, bwd)
            engine = _moves.pipeline_moves("1f1b", stages, m, sizes)
            assert sum(map(len, engine)) == sum(map(len, merged)), "the engine no longer merges"
            counts = sum(map(len, now)), sum(map(len, merged))
            for rate in ("100mbit", "10mbit"):
                with open(os.path.join(HERE, "calibrations", f"per_host-4x1-{rate}.json")) as f:
                    cal = _calibrate.refit(json.load(f))
                fit = cal["fits"]["collective-permute"]
                link = _fits.links({"p2p": fit})["p2p"]
                burst, chain = float(fit.get("burst_bytes", 0.0)), cal.get("chain")

                def delay(n, chain=chain):
                    return _fits.chain_delay_s(chain, n)

                a = _pipeline_model.play_permutes(now, stages, link, burst, delay)
                b = _pipeline_model.play_permutes(merged, stages, link, burst, delay)
                print(f"| {stages} x {m} | {label} | {rate} | {counts[0]} / {counts[1]} | "
                      f"{1e3 * a:.1f} | {1e3 * b:.1f} | {1e3 * (a - b):.1f} ms "
                      f"({100 * (a - b) / a:.0f}%) |")  # fmt: skip


if __name__ == "__main__":
    main()
