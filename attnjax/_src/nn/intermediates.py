"""The one reader of recorded intermediates: what a forward pass sowed, per layer.

Implementation behind the public module :mod:`attnjax.nn.intermediates`.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

from flax import nnx

# Where TransformerLM keeps its blocks (an nnx.List: integer keys in the tree).
BLOCKS = "blocks"


class Recorded(NamedTuple):
  """Intermediates of one forward pass.

  Attributes:
    model: values recorded outside the blocks (``"log_z"``, ``"__call__"``,
      ``"embed/__call__"``, ...), by path.
    layers: one dict per block, in layer order, by path below the block.
  """

  model: dict[str, Any]
  layers: list[dict[str, Any]]


def last(value: Any) -> Any:
  """The value of one sown name: ``sow`` appends to a tuple; a pass sows each name once.

  Args:
    value: a sown tuple, or a value already unpacked (a NamedTuple is a value).

  Returns:
    The tuple's last element, or ``value`` itself.
  """
  return value[-1] if isinstance(value, tuple) and not hasattr(value, "_fields") else value


def _flatten(tree: Mapping, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
  for name, value in tree.items():
    path = f"{prefix}{name}"
    if isinstance(value, Mapping):  # a submodule
      _flatten(value, f"{path}/", out)
    else:
      out[path] = last(value)
  return out


def read(intermediates: Any, num_layers: Optional[int] = None) -> Recorded:
  """Flat per-model and per-layer dicts of an ``nnx.capture`` intermediates tree.

  Args:
    intermediates: the ``nnx.State`` (or its ``nnx.to_pure_dict``) that
      ``nnx.capture(..., nnx.Intermediate)`` returned for a ``TransformerLM``.
    num_layers: number of blocks; layers that recorded nothing get ``{}``.
      None: as many as the highest block index recorded, plus one.

  Returns:
    A :class:`.Recorded`.
  """
  pure = intermediates if isinstance(intermediates, dict) else nnx.to_pure_dict(intermediates)
  blocks = pure.get(BLOCKS, {})
  if num_layers is None:
    num_layers = 1 + max((int(i) for i in blocks), default=-1)
  layers = [_flatten(blocks.get(i, blocks.get(str(i), {})), "", {}) for i in range(num_layers)]
  model = _flatten({k: v for k, v in pure.items() if k != BLOCKS}, "", {})
  return Recorded(model=model, layers=layers)


def find(record: Mapping[str, Any], name: str, default: Any = None) -> Any:
  """The value recorded under ``name`` (the last path component) in one flat dict.

  Args:
    record: a flat ``{path: value}`` dict (a :class:`.Recorded` field).
    name: the name, e.g. ``"log_z"``.
    default: returned when nothing was recorded under it.

  Returns:
    The first value whose path is ``name`` or ends with ``/name``.
  """
  for path, value in record.items():
    if path == name or path.endswith(f"/{name}"):
      return value
  return default


def fields(record: Mapping[str, Any]) -> dict[str, Any]:
  """One layer's sown values by name, ``AttentionStats`` spread into its non-None fields.

  The ``"sown"`` view of :func:`attnjax.nn.layer_stats`: ``{"sink_mass": ..., "entropy": ...,
  "q_rms": ..., "hidden_max_abs": ..., "weights": ...}``; call outputs
  (``__call__``) are left out.

  Args:
    record: one layer's flat ``{path: value}`` dict.

  Returns:
    ``{name: value}``.
  """
  out: dict[str, Any] = {}
  for path, value in record.items():
    name = path.rsplit("/", 1)[-1]
    if name == "__call__":
      continue
    if hasattr(value, "_asdict"):  # AttentionStats
      out.update({k: v for k, v in value._asdict().items() if v is not None})
    else:
      out[name] = value
  return out
