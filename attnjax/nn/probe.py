"""Statistics per layer of an ``attnjax.nn.TransformerLM``: :func:`attnjax.nn.layer_stats`.

One forward pass on a fixed batch, seen four ways (``view=``): ``"summary"``,
every statistic of ``attnjax.stats`` over the layers (sink rate, F-Attn,
entropy, q/k geometry, massive activations, ...) and the batch loss; ``"sown"``,
what each layer sowed (``AttentionStats`` fields per batch row and head);
``"streaming"``, the fused statistics of a long sequence in O(T) memory; and
``"capture"``, the :class:`~attnjax.stats.ProbeCapture` the summary is computed
from. A ``ProbeCapture`` filled from any other model's forward pass gives its
summary too. Each layer is asked what it does instead of re-deriving it:
``Attention.allowed_mask`` gives the pairs it allows and ``Attention.compared_qk``
the q and k its attention function compares (QK norm, gains, RoPE).

For example:

>>> import json
>>> import jax
>>> from flax import nnx
>>> from attnjax import nn, stats
>>> cfg = nn.ModelConfig(vocab_size=64, d_model=32, num_layers=2,
...                      attention=nn.AttentionConfig(num_heads=4))
>>> model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
>>> probe_tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 64)  # usually [B, >= 64]
>>> out = nn.layer_stats(model, probe_tokens)
>>> flat = json.dumps(stats.to_jsonable(out))
>>> len(out["f_attn/per_layer"]), bool(0 <= out["sink_rate/rate"] <= 100)
(2, True)
>>> sown = nn.layer_stats(model, probe_tokens, view="sown")
>>> len(sown["layers"]), sown["layers"][0]["sink_mass"].shape
(2, (2, 4))

``probe``, ``capture_from_model``, ``attnjax.nn.collect_stats``,
``attnjax.models.probe.layer_statistics``, ``attnjax.train.probe.run_probe``
and ``attnjax.stats.probe_statistics`` are deprecated aliases of views of
:func:`attnjax.nn.layer_stats`: each warns once and returns what it always did.
"""

from attnjax._src.nn.probe import VIEWS, capture_from_model, layer_stats, probe

__all__ = ["VIEWS", "capture_from_model", "layer_stats", "probe"]
