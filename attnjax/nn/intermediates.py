"""The one reader of recorded intermediates: what a forward pass sowed, per layer.

``nnx.capture(fn, nnx.Intermediate)`` returns the values the modules sowed
(``attention_stats``, ``q_rms``, ``weights``, ``hidden_max_abs``, ``log_z``,
...), and with ``method_outputs=nnx.Intermediate`` every module's call output
(``__call__``), nested as the modules are. :func:`.read` turns that tree into
one flat dict for the model and one per block of the ``TransformerLM``, keyed
by the path below it (``"attention/attention_stats"``,
``"attention/q_proj/__call__"``, ``"hidden_max_abs"``, ``"__call__"``), each
value the last one sown in the pass. Every view of ``attnjax.nn.layer_stats``
and the train step's statistics (``attnjax/_src/train/step.py``) read
through it.
"""

from attnjax._src.nn.intermediates import BLOCKS, Recorded, fields, find, last, read

__all__ = ["BLOCKS", "Recorded", "fields", "find", "last", "read"]
