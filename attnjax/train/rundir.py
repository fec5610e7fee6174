"""Run directory files, written so that an interrupted run never leaves a truncated file.

Layout of one run::

    config.json      resolved config
    metrics.jsonl    one line per training step (and validation lines, "kind": "val")
    probes.jsonl     one line per sink probe
    summary.json     status (running / finished / diverged / stopped), final numbers
    checkpoints/     orbax, one folder per saved step
    plots/           PNGs

Whole files go through a temporary file and ``os.replace`` (atomic on POSIX).
JSONL files are appended line by line with flush + fsync, and on resume
:func:`.truncate_jsonl` rewrites them (atomically) without the lines past the
checkpoint step, so the resumed run appends exactly what an uninterrupted run
would have written. A line cut by a kill mid-write is dropped on read.

Every value goes through ``attnjax.stats.to_jsonable``, the one JSON rule of
attnjax: arrays become lists, NaN and +-Inf become null. Files written before
this rule hold +-1e308 for +-Inf; readers of numbers from run files pass them
through :func:`.finite_or_none`, which takes both (and NaN, and +-Inf) as missing.
"""

from attnjax._src.train.rundir import (OLD_INF, JsonlWriter, RunDir, dumps, finite_or_none,
                                       read_json, read_jsonl, truncate_jsonl, write_atomic,
                                       write_json)

__all__ = ["OLD_INF", "JsonlWriter", "RunDir", "dumps", "finite_or_none", "read_json",
    "read_jsonl", "truncate_jsonl", "write_atomic", "write_json"]
