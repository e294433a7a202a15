"""The collectives of every program a trainer config compiles, as one process of a 2-process run.

    python census.py PROCESS_ID PORT DEVICES OUT.json CONFIG [--set KEY=VALUE ...]

Joins a 2-process JAX system (gloo) as the trainer's CLI does, builds the config's mode
(``jaxcomp.train.setup``: every program compiled) and writes, from process 0, each compiled
program's collective instructions (kind, operand shape, group size, bytes per execution,
executions per call) to OUT.json. Run by ``census.sh``.
"""

import json
import sys


def main(process_id, port, devices, out, config, sets):
    from jaxcomp import main as cli

    argv = ["--config", config, "--workdir", "unused", "--cpu_devices", str(devices),
            "--num_processes", "2", "--process_id", str(process_id),
            "--coordinator_address", f"127.0.0.1:{port}"]  # fmt: skip
    cli.setup_devices(cli.parse_args(argv))
    from jaxcomp import _compile
    from jaxcomp import comm
    from jaxcomp import train

    compiled = {}
    compile_all = _compile.compile_all

    def keep(lowered):
        done = compile_all(lowered)
        compiled.update(done)
        return done

    _compile.compile_all = keep  # before the mode modules import it
    cfg = train.apply_overrides(cli.load_config(config), train.parse_overrides(sets))
    s = train.setup(cfg)
    report = {}
    for name, c in compiled.items():
        if not hasattr(c, "as_text"):  # a split state init (no collectives)
            continue
        records = comm.collective_report(c.as_text()).records
        report[name] = [
            {"kind": r.kind, "shape": r.shape, "group_size": r.group_size,
             "bytes": r.bytes_per_execution, "executions": r.executions,
             "computation": r.computation}
            for r in records
        ]  # fmt: skip
    if process_id == 0:
        with open(out, "w") as f:
            json.dump({"config": config, "set": sets, "mesh": dict(s.mesh.shape),
                       "programs": report}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    a = sys.argv
    sets = [v for k, v in zip(a[6:], a[7:]) if k == "--set"]
    main(int(a[1]), int(a[2]), int(a[3]), a[4], a[5], sets)
