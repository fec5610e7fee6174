"""Reports: run directories -> one markdown report per experiment, and PNG plots.

    python experiments/report.py runs/compare       # writes runs/compare/report.md + plots/

Every number comes from the run directories (``summary.json``, ``metrics.jsonl``,
``probes.jsonl``) and the sweep's ``host.json`` and ``throughput.json``, so a report can be
rebuilt at any time, including for a sweep that is still running. Runs in ``seed=<n>``
folders are the seeds of one arm: mean ± spread over them, differences judged against it.
"""

from attnjax._src.train.arm_report import (
  arm_folder,
  arm_rows,
  sink_formed,
  summary_table,
  targets_section,
)
from attnjax._src.train.baselines import uniform_baselines
from attnjax._src.train.report import (
  COLUMNS,
  PROBE_PANELS,
  RUN_COLUMNS,
  find_runs,
  lr_sweep_rows,
  lr_sweep_table,
  markdown_table,
  plot_curves,
  plot_lr_sweep,
  plot_probes,
  plot_summary,
  row_of,
  significant,
  write_lr_sweep_report,
  write_report,
)
from attnjax._src.train.spread import Spread, differs, fmt_spread, spread

__all__ = [
  "COLUMNS",
  "PROBE_PANELS",
  "RUN_COLUMNS",
  "Spread",
  "arm_folder",
  "arm_rows",
  "differs",
  "find_runs",
  "fmt_spread",
  "lr_sweep_rows",
  "lr_sweep_table",
  "markdown_table",
  "plot_curves",
  "plot_lr_sweep",
  "plot_probes",
  "plot_summary",
  "row_of",
  "significant",
  "sink_formed",
  "spread",
  "summary_table",
  "targets_section",
  "uniform_baselines",
  "write_lr_sweep_report",
  "write_report",
]
