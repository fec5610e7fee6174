"""Run directory files, written so that an interrupted run never leaves a truncated file.

Whole files (``config.json``, ``summary.json``) go through a temporary file and
``os.replace``; JSONL files (``metrics.jsonl``, ``probes.jsonl``) are appended line by
line with flush + fsync, and on resume :func:`.truncate_jsonl` drops the lines past the
checkpoint step, so a resumed run's files equal an uninterrupted run's. Values go
through ``attnjax.stats.to_jsonable`` (NaN and +-Inf become null); readers pass numbers
through :func:`.finite_or_none`, which also takes older files' +-1e308 as missing.

Guide: :doc:`/guides/training`, section "Run directories".
"""

from attnjax._src.train.rundir import (
  OLD_INF,
  JsonlWriter,
  RunDir,
  dumps,
  finite_or_none,
  read_json,
  read_jsonl,
  resolve_root,
  truncate_jsonl,
  write_atomic,
  write_json,
)

__all__ = [
  "OLD_INF",
  "JsonlWriter",
  "RunDir",
  "dumps",
  "finite_or_none",
  "read_json",
  "read_jsonl",
  "resolve_root",
  "truncate_jsonl",
  "write_atomic",
  "write_json",
]
