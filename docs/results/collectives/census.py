"""Tabulates the collectives of XLA's optimised programs in a dump directory (run by census.sh).

    python census.py HLO_DUMP_DIR LABEL > census.json

For every ``*after_optimizations.txt`` module holding a collective: per kind, the number of
collective instructions, how many arrays they carry (a combined collective carries a tuple),
their group sizes, and the bytes one device sends per call (``jaxcomp.comm.collective_report``:
loops multiplied by their trip counts, each branch of a ``conditional`` counted once).
"""

import collections
import json
import pathlib
import re
import sys

from jaxcomp import comm

_ARRAY = re.compile(r"\b(?:pred|[suf]\d+|bf16|c64|c128)\[[\d,]*\]")


def census(dump: pathlib.Path) -> dict:
    programs = {}
    for path in sorted(dump.glob("*after_optimizations.txt")):
        report = comm.collective_report(path.read_text())
        if not report.records:
            continue
        name = path.name.split(".", 1)[1].removesuffix(".cpu_after_optimizations.txt")
        kinds = collections.defaultdict(lambda: collections.Counter())
        for r in report.records:
            k = kinds[r.kind]
            k["instructions"] += 1
            k["arrays"] += len(_ARRAY.findall(r.shape))
            k["executions"] += r.executions
            k["bytes"] += r.total_bytes
            k[f"group_{r.group_size}"] += r.executions
        programs[name] = {kind: dict(c) for kind, c in kinds.items()}
    return programs


if __name__ == "__main__":
    out = {"run": sys.argv[2], "programs": census(pathlib.Path(sys.argv[1]))}
    json.dump(out, sys.stdout, indent=1)
    print()
