"""Deprecated: the loop probes with ``attnjax.nn.layer_stats`` (see :func:`run_probe`).

The metric definitions live in ``attnjax.stats`` (pure) and the pass that runs
the model in ``attnjax.nn.layer_stats``. The spike score of a run is
``attnjax.train.metrics``.
"""

from __future__ import annotations

import jax
from flax import nnx

from attnjax._src.deprecation import warn_once
from attnjax._src.nn import probe as probe_lib
from attnjax._src.stats import to_jsonable


def run_probe(model: nnx.Module, inputs: jax.Array, to_host=jax.device_get) -> dict:
  """Deprecated: ``to_jsonable(to_host(attnjax.nn.layer_stats(model, inputs)))``.

  All sink and stability statistics of ``model`` on the fixed probe batch
  ``inputs`` ``[B, T]``: one jitted ``attnjax.nn.layer_stats`` pass (Sink_1^0.3 of Gu et al. on
  row-normalised weights, F-Attn of Qiu et al., entropy, max logit, q/k RMS
  and cosine, sink geometry, massive activations and M-Act of Sun et al.,
  null and gate mass, log Z drift, the probe loss), as JSON-ready values keyed
  ``"<metric>/<field>"``. Metrics a family cannot define are NaN (JSON null).
  ``to_host`` reads the device values (the loop's gathers arrays spread over processes).
  """
  warn_once(
    "attnjax.train.probe.run_probe",
    "attnjax.stats.to_jsonable(attnjax.nn.layer_stats(model, inputs))",
  )
  return to_jsonable(to_host(probe_lib.layer_stats(model, inputs)))
