"""The table of language_model.md: the GPT on the embedded text in the lab (run.sh's ``gpt``
cells), per rate and cell: the median step time beside the cost model's prediction, the bytes
per step, and the time to each target validation loss (training seconds, and the prediction:
the steps the run took to reach it times the predicted step).

  PYTHONPATH=. python docs/results/network/gpt_table.py
"""

import glob
import os

from jaxcomp.study import _network

HERE = os.path.dirname(os.path.abspath(__file__))
RATES = ("unlimited", "100mbit", "10mbit")


def main():
    runs = sorted(glob.glob(os.path.join(HERE, "cells", "gpt-*")))
    recs = _network.predict([_network.read_lab_run(w) for w in runs])
    by = {(r["network"]["rate"], r["variant"]): r for r in recs}
    targets = sorted({t for r in recs for t in r.get("loss_targets", ())}, reverse=True)
    print("| rate | cell | step ms median [q25, q75] | predicted ms | measured / predicted | "
          "slow-link bytes/step | final val loss | "
          + " | ".join(f"to loss {t:g}: step, train s (pred s)" for t in targets)
          + " | load before / after |")  # fmt: skip
    print("|---" * (8 + len(targets)) + "|")
    for rate in RATES:
        for (r_rate, cell), r in sorted(by.items()):
            if r_rate != rate:
                continue
            m, p = r["measured"], r.get("prediction") or {}
            st = m["step_time"]
            ms = [_network._ms(st[k]) for k in ("median_s", "q25_s", "q75_s")]
            ratio = p.get("measured_over_predicted")
            final = _network._jsonl(os.path.join(r["workdir"], "metrics.jsonl"))
            final = [x["loss"] for x in final if x.get("split") == "eval"]
            hits = []
            for t in targets:
                h = m["time_to_loss"].get(f"{t:g}")
                pred = "" if not (h and p.get("step_s")) else f" ({h['step'] * p['step_s']:.1f})"
                hits.append("not reached" if not h else f"{h['step']}, {h['train_s']:.1f}{pred}")
            pred_ms = _network._ms(p.get("step_s"))
            print(f"| {rate} | {cell} | {ms[0]} [{ms[1]}, {ms[2]}] | {pred_ms}"
                  f" | {'—' if ratio is None else f'{ratio:.2f}'} | "
                  f"{m['wire_bytes_per_step']:,.0f} | {final[-1]:.3f} | " + " | ".join(hits)
                  + f" | {r['load_before'][0]} / {r['load_after'][0]} |")  # fmt: skip


if __name__ == "__main__":
    main()
