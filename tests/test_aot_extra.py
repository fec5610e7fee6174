"""`attnjax.targets.missing` names what is missing instead of raising, so the suite collects and
skips the real-target compiles on an install without the 'aot' extra."""

import importlib.util

import pytest

from attnjax._src import targets


def test_a_dotted_module_whose_parent_is_absent_is_not_installed():
  assert targets._installed("attnjax_no_such_package.plugin") is False
  assert targets._installed("attnjax._src.targets") is True


@pytest.mark.parametrize("platform,module", [("cuda", "jax_plugins.xla_cuda12"), ("tpu", "libtpu")])
def test_missing_plugins_give_a_reason(monkeypatch, platform, module):
  real = importlib.util.find_spec

  def find_spec(name, *args, **kwargs):
    if name == module:  # as find_spec does for a dotted name whose parent is not installed
      raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")
    return real(name, *args, **kwargs)

  monkeypatch.setattr(importlib.util, "find_spec", find_spec)
  reason = targets.missing(platform)
  assert isinstance(reason, str) and "attnjax[aot]" in reason


def test_missing_names_the_platforms():
  with pytest.raises(ValueError, match="'cuda' or 'tpu'"):
    targets.missing("rocm")
