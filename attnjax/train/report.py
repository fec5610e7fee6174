"""Reports: run directories -> one markdown table per experiment, and PNG plots.

    python experiments/report.py runs/compare       # writes runs/compare/report.md + plots/

Every number comes from the run directories (``summary.json``,
``metrics.jsonl``, ``probes.jsonl``), so a report can be rebuilt at any time,
including for a sweep that is still running.
"""

from attnjax._src.train.report import (
  COLUMNS,
  PROBE_PANELS,
  find_runs,
  lr_sweep_rows,
  lr_sweep_table,
  markdown_table,
  plot_curves,
  plot_lr_sweep,
  plot_probes,
  row_of,
  significant,
  write_lr_sweep_report,
  write_report,
)

__all__ = [
  "COLUMNS",
  "PROBE_PANELS",
  "find_runs",
  "lr_sweep_rows",
  "lr_sweep_table",
  "markdown_table",
  "plot_curves",
  "plot_lr_sweep",
  "plot_probes",
  "row_of",
  "significant",
  "write_lr_sweep_report",
  "write_report",
]
