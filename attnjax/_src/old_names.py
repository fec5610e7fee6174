"""The old names of the public modules: each warns once, or raises naming its new spelling.

A public module with old names takes its ``__getattr__`` (PEP 562) from here
(``from attnjax._src.old_names import linear as __getattr__``); see
:func:`attnjax._src.deprecation.old_names`. A name whose spelling now means another concept
(*parallel* is context parallelism only, *probe* the training loop's periodic statistics
only) is :class:`~attnjax._src.deprecation.Removed`; any other old name keeps working until
the next minor release (CHANGELOG).
"""

from __future__ import annotations

from attnjax._src.deprecation import Deprecated, Removed, Renamed, old_names

_PARALLEL = "'parallel' names context parallelism only (attnjax.parallel)"
_PROBE = "'probe' names the training loop's periodic statistics only"
_FUNCTIONS_LAYER = (
  "attnjax.stats is the functions layer and imports neither flax nor attnjax.nn / attnjax.train"
)


def _quadratic(family: str) -> dict:
  return {
    "parallel": Removed(f"attnjax.{family}.quadratic (the same computation)", _PARALLEL),
    "REFERENCE_FORM": Renamed(
      f"attnjax.{family}.REFERENCE_ENGINE", f"attnjax._src.ops.{family}.attention:REFERENCE_ENGINE"
    ),
  }


linear = old_names("attnjax.linear", _quadratic("linear"))
gated_linear = old_names("attnjax.gated_linear", _quadratic("gated_linear"))
delta_rule = old_names("attnjax.delta_rule", _quadratic("delta_rule"))

stats = old_names(
  "attnjax.stats",
  {
    "ProbeCapture": Renamed(
      "attnjax.stats.LayerCapture", "attnjax._src.stats.capture:LayerCapture"
    ),
    "probe_statistics": Removed("attnjax.nn.layer_stats(capture), which returns the same", _PROBE),
    "probe": Removed("attnjax.nn.layer_stats", _PROBE),
    "capture_from_model": Removed(
      "attnjax.nn.layer_stats(model, tokens, view='capture')", _FUNCTIONS_LAYER
    ),
    **{
      name: Removed(f"attnjax.train.metrics.{name}", _FUNCTIONS_LAYER)
      for name in ("lr_sensitivity", "max_stable_lr", "spike_score", "is_diverged")
    },
  },
)

# attnjax.nn.probe, now attnjax.nn.statistics (and attnjax.nn.layer_stats).
nn_probe = old_names(
  "attnjax.nn.probe",
  {
    "layer_stats": Renamed("attnjax.nn.layer_stats", "attnjax._src.nn.statistics:layer_stats"),
    "VIEWS": Renamed("attnjax.nn.statistics.VIEWS", "attnjax._src.nn.statistics:VIEWS"),
    "capture_from_model": Deprecated("attnjax._src.nn.statistics:capture_from_model"),
    "probe": Removed(
      "attnjax.nn.layer_stats(model, tokens, length=64), which returns the same", _PROBE
    ),
  },
)

# attnjax.models.probe (a token NLL), now attnjax.models.token_nll.
models = old_names(
  "attnjax.models", {"probe": Renamed("attnjax.models.token_nll", "attnjax._src.models.perplexity")}
)
models_probe = old_names(
  "attnjax.models.probe",
  {
    "token_nll": Renamed("attnjax.models.token_nll", "attnjax._src.models.perplexity:token_nll"),
    "layer_statistics": Deprecated("attnjax._src.models.perplexity:layer_statistics"),
  },
)

# attnjax.train.probe held the loop's statistics pass before attnjax.nn.layer_stats.
train_probe = old_names(
  "attnjax.train.probe",
  {
    "run_probe": Removed(
      "attnjax.stats.to_jsonable(attnjax.nn.layer_stats(model, inputs)), which returns the same",
      "the training loop runs its probes itself (attnjax.train.Trainer)",
    )
  },
)

train_mesh = old_names(
  "attnjax.train.mesh",
  {"MeshParallel": Renamed("attnjax.train.mesh.RunMesh", "attnjax._src.train.mesh:RunMesh")},
)
