"""attnjax's settings: ``attnjax.config``.

``attnjax.config.kernels`` says when auto-dispatch (``implementation=None``) may take
attnjax's own Pallas kernels (``pallas_gpu``, ``mosaic_gpu``, ``pallas_tpu``):
``"checked"`` (the default: where a current verdict of ``python -m attnjax.check``
passed the call's case class), ``"all"`` (wherever they cover the call) or ``"jax"``
(never; formerly ``"trusted"``, which warns once). ``ATTNJAX_KERNELS`` gives the default;
setting the attribute overrides it for this process (``None`` restores the environment's).
A named ``implementation=`` always runs what it names. See :doc:`/guides/kernels`.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

from attnjax._src import deprecation as _deprecation

#: The values of ``attnjax.config.kernels`` (see the module docstring).
KERNELS = ("checked", "all", "jax")
#: The old values still accepted, each warning once (old value to new value).
RENAMED_KERNELS = {"trusted": "jax"}
#: The environment variable that gives ``attnjax.config.kernels``'s default.
ENV_KERNELS = "ATTNJAX_KERNELS"


class Config:
  """The settings object ``attnjax.config``.

  Attributes:
    kernels: one of :data:`KERNELS` (see the module docstring). Dispatch reads it when a
      function is traced, so a change clears jax's caches (``jax.clear_caches()``): the
      functions traced before it are traced again on their next call.
  """

  def __init__(self):
    self._kernels: Optional[str] = None

  @property
  def kernels(self) -> str:
    if self._kernels is not None:
      return self._kernels
    value = os.environ.get(ENV_KERNELS, "").strip().lower() or "checked"
    if value in RENAMED_KERNELS:
      new = RENAMED_KERNELS[value]
      _deprecation.warn_renamed(f"{ENV_KERNELS}={value}", f"{ENV_KERNELS}={new}")
      value = new
    if value not in KERNELS:
      raise ValueError(
        f"{ENV_KERNELS}={value!r} is not one of: " + ", ".join(repr(k) for k in KERNELS)
      )
    return value

  @kernels.setter
  def kernels(self, value: Optional[str]) -> None:
    if value in RENAMED_KERNELS:
      new = RENAMED_KERNELS[value]
      _deprecation.warn_renamed(
        f"attnjax.config.kernels = {value!r}", f"attnjax.config.kernels = {new!r}", stacklevel=2
      )
      value = new
    if value is not None and value not in KERNELS:
      raise ValueError(
        f"attnjax.config.kernels={value!r} is not one of: "
        + ", ".join(repr(k) for k in (*KERNELS, None))
      )
    before = self._kernels or os.environ.get(ENV_KERNELS)
    self._kernels = value
    if (self._kernels or os.environ.get(ENV_KERNELS)) != before:
      jax.clear_caches()

  def __repr__(self) -> str:
    return f"attnjax.config(kernels={self.kernels!r})"


config = Config()
