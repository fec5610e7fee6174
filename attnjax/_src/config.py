"""attnjax's settings: ``attnjax.config``.

``attnjax.config.auto_kernels`` says which kernels auto-dispatch (``implementation=None``)
may take: ``"checked"`` (the default: jax's, and attnjax's own Pallas kernels ``pallas_gpu``,
``mosaic_gpu``, ``pallas_tpu`` where a current verdict of ``python -m attnjax.check`` passed
the call's case class), ``"all"`` (attnjax's too, wherever they cover the call) or ``"jax"``
(jax's only). ``ATTNJAX_AUTO_KERNELS`` gives the default; setting the attribute overrides it
for this process (``None`` restores the environment's). A named ``implementation=`` always
runs what it names. The old spellings (``config.kernels``, ``ATTNJAX_KERNELS``, the value
``"trusted"``) work and warn once. See :doc:`/guides/kernels`.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

from attnjax._src import deprecation

#: The values of ``attnjax.config.auto_kernels`` (see the module docstring).
AUTO_KERNELS = ("checked", "all", "jax")
#: The old values still accepted, each warning once (old value to new value).
RENAMED_VALUES = {"trusted": "jax"}
#: The environment variable that gives ``attnjax.config.auto_kernels``'s default.
ENV_AUTO_KERNELS = "ATTNJAX_AUTO_KERNELS"
#: Its old name, read when the new one is not set (warning once).
OLD_ENV_AUTO_KERNELS = "ATTNJAX_KERNELS"


def _environment() -> Optional[str]:
  """The environment's setting (the new variable's, else the old one's), or None."""
  value = os.environ.get(ENV_AUTO_KERNELS)
  if value is None and os.environ.get(OLD_ENV_AUTO_KERNELS) is not None:
    deprecation.warn_renamed(OLD_ENV_AUTO_KERNELS, ENV_AUTO_KERNELS)
    value = os.environ[OLD_ENV_AUTO_KERNELS]
  return value


class Config:
  """The settings object ``attnjax.config``.

  Attributes:
    auto_kernels: one of :data:`AUTO_KERNELS` (see the module docstring). Dispatch reads it
      when a function is traced, so a change clears jax's caches (``jax.clear_caches()``):
      the functions traced before it are traced again on their next call.
    kernels: the old name of ``auto_kernels`` (warns once).
  """

  def __init__(self):
    self._auto_kernels: Optional[str] = None

  @property
  def auto_kernels(self) -> str:
    if self._auto_kernels is not None:
      return self._auto_kernels
    env = _environment()
    value = (env or "").strip().lower() or "checked"
    if value in RENAMED_VALUES:
      new = RENAMED_VALUES[value]
      deprecation.warn_renamed(f"{ENV_AUTO_KERNELS}={value}", f"{ENV_AUTO_KERNELS}={new}")
      value = new
    if value not in AUTO_KERNELS:
      raise ValueError(
        f"{ENV_AUTO_KERNELS}={value!r} is not one of: " + ", ".join(repr(k) for k in AUTO_KERNELS)
      )
    return value

  @auto_kernels.setter
  def auto_kernels(self, value: Optional[str]) -> None:
    self._set(value, "auto_kernels")

  def _set(self, value: Optional[str], spelled: str) -> None:
    if value in RENAMED_VALUES:
      new = RENAMED_VALUES[value]
      deprecation.warn_renamed(
        f"attnjax.config.{spelled} = {value!r}",
        f"attnjax.config.auto_kernels = {new!r}",
        stacklevel=3,
      )
      value = new
    if value is not None and value not in AUTO_KERNELS:
      raise ValueError(
        f"attnjax.config.auto_kernels={value!r} is not one of: "
        + ", ".join(repr(k) for k in (*AUTO_KERNELS, None))
      )
    environment = os.environ.get(ENV_AUTO_KERNELS, os.environ.get(OLD_ENV_AUTO_KERNELS))
    before = self._auto_kernels or environment
    self._auto_kernels = value
    if (self._auto_kernels or environment) != before:
      jax.clear_caches()

  @property
  def kernels(self) -> str:
    deprecation.warn_renamed("attnjax.config.kernels", "attnjax.config.auto_kernels", stacklevel=2)
    return self.auto_kernels

  @kernels.setter
  def kernels(self, value: Optional[str]) -> None:
    deprecation.warn_renamed("attnjax.config.kernels", "attnjax.config.auto_kernels", stacklevel=2)
    self._set(value, "kernels")

  def __repr__(self) -> str:
    return f"attnjax.config(auto_kernels={self.auto_kernels!r})"


config = Config()
