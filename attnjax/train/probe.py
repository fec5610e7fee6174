"""The loop's bridge to the model probe: every sink statistic on a fixed batch, JSON-ready.

The metric definitions live in ``attnjax.stats`` (pure) and the pass that runs
the model in ``attnjax.nn.probe``; this module calls them and makes their
output JSON-ready. The spike score of a run is ``attnjax.train.metrics``.
"""

from __future__ import annotations

import jax
from flax import nnx

from attnjax.nn import probe as probe_lib
from attnjax.stats import to_jsonable


def run_probe(model: nnx.Module, inputs: jax.Array, to_host=jax.device_get) -> dict:
  """All sink and stability statistics of ``model`` on the fixed probe batch ``inputs`` ``[B, T]``.

  One jitted ``attnjax.nn.probe.probe`` pass (Sink_1^0.3 of Gu et al. on
  row-normalised weights, F-Attn of Qiu et al., entropy, max logit, q/k RMS
  and cosine, sink geometry, massive activations and M-Act of Sun et al.,
  null and gate mass, log Z drift, the probe loss), as JSON-ready values keyed
  ``"<metric>/<field>"``. Metrics a family cannot define are NaN (JSON null).
  ``to_host`` reads the device values (the loop's gathers arrays spread over processes).
  """
  return to_jsonable(to_host(probe_lib.probe(model, inputs, length=None)))
