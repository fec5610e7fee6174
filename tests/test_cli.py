"""Entry points' command line: ``--help`` documents the config options; no ``sys.path`` edits."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from attnjax._src.train import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPARE = "experiments/configs/compare.py:preset=cpu"


@pytest.mark.parametrize("sweep", [True, False], ids=["sweep", "single"])
def test_help_documents_both_config_options(sweep):
  text = cli.build_parser("doc", COMPARE, sweep=sweep).format_help()
  for words in ("--config FILE.py:ARG", "--config.key=value", "--out", COMPARE):
    assert words in text, (words, text)
  assert ("--processes" in text) == sweep


def test_entry_points_run_from_the_repo_root_and_show_config_help():
  """``python experiments/X.py --help`` with the package importable and nothing else."""
  env = dict(os.environ, PYTHONPATH=str(ROOT))  # what `pip install -e .` provides
  for script in ("experiments/compare.py", "experiments/train.py"):
    proc = subprocess.run(
      [sys.executable, script, "--help"],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--config FILE.py:ARG" in proc.stdout and "--config.key=value" in proc.stdout
    assert "usage: " + os.path.basename(script) in proc.stdout


def test_no_experiment_edits_sys_path():
  offenders = [p.name for p in (ROOT / "experiments").rglob("*.py") if "sys.path" in p.read_text()]
  assert not offenders, offenders


def test_parse_applies_overrides_and_reports_bad_keys(capsys):
  cfg, args = cli.parse(
    "doc", str(ROOT / COMPARE), ["--config.opt.lr=3e-3", "--config.train.steps", "7", "--out", "x"]
  )
  assert cfg.opt.lr == 3e-3 and cfg.train.steps == 7 and args.out == "x"
  assert args.config_overrides == ["opt.lr=3e-3", "train.steps=7"]
  with pytest.raises(SystemExit):
    cli.parse("doc", str(ROOT / COMPARE), ["--config.opt.lrr=1"])
  assert "did you mean 'opt.lr'" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.parse("doc", str(ROOT / COMPARE), ["--config"])
  assert "--config needs a value" in capsys.readouterr().err


def test_bench_memory_alone_runs_no_timing_suite():
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  proc = subprocess.run(
    [sys.executable, "experiments/bench.py", "--memory", "--memory-filter", "matches no case"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr
  assert "## memory" in proc.stdout and "matmul rate" not in proc.stdout, proc.stdout


def test_default_config_is_found_from_any_directory(tmp_path, monkeypatch):
  """An entry point's default ``experiments/configs/...`` is read from the repository when the
  working directory is elsewhere; a config the user names is taken as given."""
  monkeypatch.chdir(tmp_path)
  cfg, args = cli.parse("doc", COMPARE, ["--config.train.steps", "3"])
  assert cfg.train.steps == 3 and args.config == str(ROOT / COMPARE)
  assert cli.in_repository("missing.py:x") == "missing.py:x"
  with pytest.raises(SystemExit):
    cli.parse("doc", COMPARE, ["--config", COMPARE])  # named by the user: relative to here
