"""The README's first two commands are the main job and the test command; CI runs the latter."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_commands():
  text = (ROOT / "README.md").read_text()
  return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_first_two_commands_install_then_run():
  main_job, tests = readme_commands()[:2]
  for cmd in (main_job, tests):
    assert cmd.startswith("python3 -m venv .venv") and "pip install -e" in cmd
  assert "experiments/" in main_job
  assert "pytest" in tests


def test_ci_runs_the_readme_test_command():
  tests = readme_commands()[1]
  assert tests in (ROOT / ".ci" / "run").read_text()
