"""``from_pretrained``: a Hugging Face checkpoint directory as an ``attnjax.nn.TransformerLM``.

The order of work: read ``config.json`` and every tensor header; check the
model type, the config keys, the tensor names and shapes against what the
config implies (all before any weight is read or anything computed); build
the model's structure without allocating it (``nnx.eval_shape``); then read
the tensors one at a time, convert each to our layout and dtype and place it
(on the default device, or sharded over ``mesh`` so that no device holds a
full copy).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnjax._src.nn import specs
from attnjax._src.nn.config import AttentionConfig, EncoderConfig, ModelConfig
from attnjax._src.nn.config import COMMON_FIELDS, LEGACY_DEFAULTS
from attnjax._src.nn.encoder import EncoderLM
from attnjax._src.nn.transformer import LOGICAL_AXIS_RULES, TransformerLM, state_shardings
from attnjax._src.models import architectures
from attnjax._src.models.architectures import Architecture, Rule
from attnjax._src.models.checkpoint import Checkpoint, CheckpointError, torch_dtype_name

DTYPES = ("float32", "bfloat16", "float16")
logger = logging.getLogger("attnjax.models")


def _dtype_name(dtype: Any, checkpoint: Checkpoint, config: dict) -> str:
  """The model's parameter and compute dtype: ``dtype``, else the checkpoint's."""
  if dtype is not None:
    try:
      name = jnp.dtype(dtype).name
    except TypeError:
      raise TypeError(
        f"dtype must be a floating dtype ({', '.join(DTYPES)}), got {dtype!r}"
      ) from None
    if name not in DTYPES:
      raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return name
  declared = torch_dtype_name(config)
  if declared in DTYPES:
    return declared
  stored = {checkpoint.dtype(n) for n in checkpoint.names()}
  for tag, name in (("BF16", "bfloat16"), ("F16", "float16")):
    if tag in stored:
      return name
  return "bfloat16" if config.get("quantization_config") else "float32"


def _strip(name: str, prefixes: tuple[str, ...]) -> str:
  for prefix in prefixes:
    if name.startswith(prefix):
      return name[len(prefix) :]
  return name


def check_tensors(
  checkpoint: Checkpoint, arch: Architecture, rules: dict[tuple, Rule], tied: bool
) -> dict[str, str]:
  """``{our source name: checkpoint name}``, after checking names and shapes.

  Raises:
    CheckpointError: naming missing tensors, unexpected tensors, and every
      tensor whose shape differs from what the config implies (both shapes).
  """
  present: dict[str, str] = {}
  prefix = ""  # the prefix the checkpoint's names carry (to name missing tensors as it would)
  for name in checkpoint.names():
    short = _strip(name, arch.prefixes)
    if short != name:
      prefix = name[: len(name) - len(short)]
    if arch.skipped(checkpoint.config, short):
      continue
    if tied and short in arch.tied_names:
      continue  # tied: transformers uses the embedding (some exports store both)
    present[short] = name
  expected: dict[str, tuple] = {}
  for rule in rules.values():
    for source, shape in zip(rule.sources, rule.shapes):
      expected[source] = shape
  missing = sorted(set(expected) - set(present))
  unexpected = sorted(set(present) - set(expected))
  problems = []
  if missing:
    problems.append(f"missing tensors {[prefix + m for m in missing]}")
  if unexpected:
    problems.append(
      f"unexpected tensors {[present[u] for u in unexpected]} (not used by this config)"
    )
  for source in sorted(set(expected) & set(present)):
    shape = checkpoint.shape(present[source])
    if shape != tuple(expected[source]):
      problems.append(
        f"tensor {present[source]!r} has shape {shape}, the config implies "
        f"{tuple(expected[source])}"
      )
  if problems:
    raise CheckpointError(
      f"{checkpoint.path}: model_type={arch.model_type!r}: " + "; ".join(problems)
    )
  return present


# ---------------------------------------------------------------------------
# attention=


def _spec_defaults(spec_class) -> dict[str, Any]:
  return {f.name: f.default for f in dataclasses.fields(spec_class)}


def override_attention(config: AttentionConfig, options: Mapping[str, Any]) -> AttentionConfig:
  """``config`` with attnjax attention ``options`` applied (see :func:`from_pretrained`).

  The same family: ``config.replace(**options)``. Another ``family``: the
  common fields and every option the new family also has are kept (the logit
  ``scale`` among them); an option of the
  checkpoint's attention that the new family cannot express raises.
  """
  options = dict(options)
  family = options.pop("family", config.family)
  if family == config.family:
    return config.replace(**options)
  if family not in specs.FAMILY_SPECS:
    raise ValueError(f"family={family!r} is not one of {sorted(specs.FAMILY_SPECS)}")
  new_fields = set(_spec_defaults(specs.FAMILY_SPECS[family]))
  old_defaults = _spec_defaults(type(config.spec))
  carried, lost = {}, {}
  for name, value in config.spec.to_dict().items():
    if name in new_fields:
      carried[name] = value
    elif value != old_defaults.get(name):
      lost[name] = value
  lost = {k: v for k, v in lost.items() if k not in options}
  if lost:
    raise ValueError(
      f"family={family!r} cannot express the checkpoint's attention options "
      f"{lost} (family {config.family!r}); choose another family or set them"
    )
  carried = specs.FAMILY_SPECS[family].options_from_json(carried)
  carried.update(options)
  return config.replace(family=family, **carried)


def _split_targets(options: Mapping[str, Any], present: list[str]):
  """``(options for every layer, {layer type: its own options})`` of ``attention=``."""
  if not isinstance(options, Mapping):
    raise TypeError(
      f"attention must be a mapping of attnjax attention options (e.g. "
      f"{{'implementation': 'reference'}}), optionally per layer type (e.g. "
      f"{{'full_attention': {{...}}}}), got {type(options).__name__}"
    )
  shared = {k: v for k, v in options.items() if k not in architectures.LAYER_TYPES}
  fields = set(COMMON_FIELDS) | set(LEGACY_DEFAULTS)
  for spec in specs.FAMILY_SPECS.values():
    fields |= set(_spec_defaults(spec))
  for key, value in shared.items():
    if isinstance(value, Mapping) and key not in fields:  # a layer type's options, by its look
      raise ValueError(
        f"attention[{key!r}]: {key!r} is not a layer type of this checkpoint (its layer "
        f"types: {sorted(set(present))}) nor an attention option; options of one layer type "
        f"go under its name, e.g. attention={{{sorted(set(present))[0]!r}: {{...}}}}"
      )
  targeted = {}
  for layer_type in architectures.LAYER_TYPES:
    if layer_type not in options:
      continue
    own = options[layer_type]
    if not isinstance(own, Mapping):
      raise TypeError(
        f"attention[{layer_type!r}] must be a mapping of attnjax attention "
        f"options, got {type(own).__name__}"
      )
    nested = sorted(set(own) & set(architectures.LAYER_TYPES))
    if nested:
      raise TypeError(
        f"attention[{layer_type!r}] holds the layer types {nested}: options "
        f"of one layer type are attention options, not nested types"
      )
    if layer_type not in present:
      raise ValueError(
        f"attention[{layer_type!r}]: this checkpoint has no {layer_type} "
        f"layers (its layer types: {sorted(set(present))})"
      )
    targeted[layer_type] = dict(own)
  return shared, targeted


def _apply_attention(
  mcfg: ModelConfig, options: Optional[Mapping[str, Any]], layer_types: list[str]
):
  """``mcfg`` with ``attention=`` applied: the shared options to every layer, then each
  layer type's own (see :func:`from_pretrained`)."""
  if options is None:
    return mcfg
  shared, targeted = _split_targets(options, layer_types)
  layers, failed = [], {}
  for i, layer_type in enumerate(layer_types):
    chosen = dict(shared, **targeted.get(layer_type, {}))
    try:
      layers.append(override_attention(mcfg.attention_for(i), chosen))
    except (TypeError, ValueError) as e:
      failed.setdefault(layer_type, ([], e))[0].append(i)
  if failed:
    raise _attention_error(options, shared, targeted, layer_types, failed)
  same = all(c == layers[0] for c in layers)
  return mcfg.replace(
    attention=layers[0],
    layer_attention=(None if same and mcfg.layer_attention is None else tuple(layers)),
  )


def _attention_error(options, shared, targeted, layer_types, failed) -> Exception:
  """The error of ``attention=`` options that some layers cannot take, naming their type."""
  layer_type, (indices, error) = next(iter(failed.items()))
  if layer_type in targeted:
    return type(error)(f"attention[{layer_type!r}] (layers {indices}): {error}")
  if set(failed) == set(layer_types):
    return type(error)(f"attention={dict(options)}: {error}")
  # A mixed model: name the layers, and how to apply the options to the others only.
  others = sorted(set(layer_types) - set(failed))
  return type(error)(
    f"attention={dict(options)}: the {layer_type} layers {indices} cannot take these "
    f"options: {error}. To apply them to the other layers only, target those by layer "
    f"type: attention={{{others[0]!r}: {dict(shared)}}} (a layer type's own options go "
    f"under its name, e.g. attention={{{layer_type!r}: {{...}}}})"
  )


# ---------------------------------------------------------------------------
# mesh=


def logical_rules(mesh: jax.sharding.Mesh) -> tuple:
  """Logical axis rules for a mesh: ``("data", "model")`` meshes as ``nn.LOGICAL_AXIS_RULES``;
  a training mesh (``fsdp``, ``tensor``) puts ``embed`` on fsdp and heads, MLP and vocabulary
  on tensor; axes a mesh lacks are replicated."""
  names = set(mesh.axis_names)
  if "model" in names:
    return LOGICAL_AXIS_RULES
  tensor = "tensor" if "tensor" in names else None
  return (
    ("embed", "fsdp" if "fsdp" in names else None),
    ("heads", tensor),
    ("mlp", tensor),
    ("vocab", tensor),
  )


def _fit(sharding: jax.sharding.NamedSharding, shape: tuple) -> jax.sharding.NamedSharding:
  """The sharding with axes that do not divide their dimension replaced by replication."""
  mesh = sharding.mesh
  spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  for d, axes in enumerate(spec):
    if axes is None:
      continue
    size = int(np.prod([mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,))]))
    if shape[d] % size:
      spec[d] = None
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


# ---------------------------------------------------------------------------
# Loading.


def _paths(pure: Any, prefix: tuple = ()) -> dict[tuple, Any]:
  out = {}
  for key, value in pure.items():
    if isinstance(value, Mapping):
      out.update(_paths(value, prefix + (key,)))
    else:
      out[prefix + (key,)] = value
  return out


def _set(pure: dict, path: tuple, value) -> None:
  node = pure
  for key in path[:-1]:
    node = node[key]
  node[path[-1]] = value


def _place(host: np.ndarray, sharding) -> jax.Array:
  if sharding is None:
    return jax.device_put(host)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def model_class(mcfg: ModelConfig) -> type:
  """``EncoderLM`` for an ``EncoderConfig`` (BERT, RoBERTa, ModernBERT), else
  ``TransformerLM``."""
  return EncoderLM if isinstance(mcfg, EncoderConfig) else TransformerLM


def from_pretrained(
  path,
  *,
  dtype=None,
  attention: Optional[Mapping[str, Any]] = None,
  mesh: Optional[jax.sharding.Mesh] = None,
) -> TransformerLM:
  """A Hugging Face format checkpoint directory as an ``attnjax.nn.TransformerLM``.

  Reads ``config.json`` and ``model.safetensors`` (or the shards of
  ``model.safetensors.index.json``) with ``safetensors``' numpy API; no torch,
  no network. The model's logits equal ``transformers``' for the same weights
  (float32: to rounding; see ``attnjax.models`` for the supported types).

  Example::

    model = attnjax.models.from_pretrained("path/to/Llama-3.2-1B", dtype="float32")
    logits = model(tokens)                                  # [B, T, V] float32
    blockwise = attnjax.models.from_pretrained(
        path, attention={"implementation": "blockwise"})     # O(T) memory at 32k tokens
    streaming = attnjax.models.from_pretrained(
        path, attention={"cache_policy": "sinks_window", "cache_budget": 1024})
    gemma_streaming = attnjax.models.from_pretrained(   # the global layers; windows stay
        gemma_path, attention={"full_attention": {"cache_policy": "sinks_window",
                                                  "cache_budget": 1024}})

  Args:
    path: the checkpoint directory.
    dtype: parameter and compute dtype (``"float32"``, ``"bfloat16"``,
      ``"float16"`` or a jnp dtype); None = the checkpoint's (its
      ``dtype``/``torch_dtype``, else the tensors'; MXFP4 experts: bfloat16).
      Logits and attention statistics are float32 either way.
    attention: attnjax attention options applied to every layer's
      :class:`~attnjax.nn.AttentionConfig` (validated by it, so errors name the
      field): ``implementation``, ``normalizer``, ``window``, ``cache_policy``
      / ``cache_budget``, ``softcap``, ... or ``family`` (another family keeps
      the options it shares with the checkpoint's and refuses to drop one it
      cannot express). Options under a layer type's name apply to the layers
      of that type only, after the shared ones: ``{"full_attention": {...},
      "sliding_attention": {...}}`` (the checkpoint's ``layer_types``; every
      layer of a model without windows is ``full_attention``, every layer of
      Mistral's is ``sliding_attention``). Shared options that some layer
      types cannot take (``cache_policy="sinks_window"`` on a layer that has
      a window) raise, naming those layers and the targeted form. Parameters
      such an option adds (an output gate, a k/v bias, QK-norm gains) start
      from their initial values and are named in a warning; checkpoint
      tensors it makes unused (``sink_logits=False``) are dropped, also with a
      warning.
    mesh: a ``jax.sharding.Mesh``: each parameter is placed with the
      ``NamedSharding`` of its logical axes (:func:`logical_rules`) as it is
      read (``jax.make_array_from_callback``), so no device holds a full copy.
      A dimension its mesh axes do not divide is replicated. Build the mesh with
      ``Auto`` axis types (``jax.sharding.Mesh(devices, names)``, as
      ``attnjax.train`` does): under ``Explicit`` axes (``jax.make_mesh``'s
      default) the embedding lookup of a vocabulary-sharded table needs an
      explicit output sharding.

  Returns:
    The :class:`attnjax.nn.TransformerLM`.

  Raises:
    CheckpointError: (a ``ValueError``) not a checkpoint directory, unknown
      ``model_type`` (lists SUPPORTED), a config key that is not understood,
      missing or unexpected tensors, a tensor whose shape differs from the
      config (both shapes named); all before any weight is read.
    ValueError: a bad ``dtype``, ``attention`` or ``mesh`` value (a layer type
      the checkpoint does not have, options some layers cannot take).
    TypeError: an ``attention`` option or ``mesh`` of the wrong type.
  """
  checkpoint = Checkpoint(path)
  config = checkpoint.config
  arch = architectures.architecture(config)
  arch.check_keys(config)
  arch.quant_method(config)
  native = arch.build(config)
  layer_types = arch.layer_types(config)
  rules = arch.tensors(config, native)
  names = check_tensors(checkpoint, arch, rules, native.tie_embeddings)
  dtype_name = _dtype_name(dtype, checkpoint, config)
  mcfg = _apply_attention(
    native.replace(dtype=dtype_name, param_dtype=dtype_name), attention, layer_types
  )
  if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")

  abstract = nnx.eval_shape(lambda: model_class(mcfg)(mcfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  pure = nnx.to_pure_dict(state)
  leaves = _paths(pure)
  shardings = None
  if mesh is not None:
    shardings = _paths(nnx.to_pure_dict(state_shardings(abstract, mesh, logical_rules(mesh))))
  for leaf_path, leaf in leaves.items():
    rule = rules.get(leaf_path)
    if rule is None:
      continue
    host = rule.convert(*(checkpoint.read(names[s]) for s in rule.sources))
    if tuple(host.shape) != tuple(leaf.shape):
      raise CheckpointError(
        f"parameter {'/'.join(map(str, leaf_path))}: the checkpoint gives "
        f"shape {tuple(host.shape)}, the model expects {tuple(leaf.shape)}"
      )
    host = np.asarray(host).astype(leaf.dtype, copy=False)
    sharding = None if shardings is None else _fit(shardings[leaf_path], host.shape)
    _set(pure, leaf_path, _place(host, sharding))
    del host
  fresh = [p for p in leaves if p not in rules]
  unused = sorted("/".join(map(str, p)) for p in rules if p not in leaves)
  if unused:
    warnings.warn(
      f"attention={dict(attention or {})}: checkpoint parameters not used by the model: {unused}",
      stacklevel=2,
    )
  if fresh:
    warnings.warn(
      f"attention={dict(attention or {})}: parameters not in the checkpoint start "
      f"from their initial values: {sorted('/'.join(map(str, p)) for p in fresh)}",
      stacklevel=2,
    )
    for leaf_path, value in _initial_values(mcfg, fresh, shardings, leaves).items():
      _set(pure, leaf_path, value)
  nnx.replace_by_pure_dict(state, pure)
  note = arch.loaded_note(config)
  if note is not None:
    logger.info("%s: %s", checkpoint.path, note)
  return nnx.merge(graphdef, state)


def _initial_values(mcfg: ModelConfig, paths: list, shardings, leaves: dict) -> dict:
  """The initial values of some parameters (the rest of the initialisation is compiled away).

  ``leaves`` are the abstract parameters by path (their shapes fit the shardings).
  """

  def init():
    model = model_class(mcfg)(mcfg, rngs=nnx.Rngs(0))
    values = _paths(nnx.to_pure_dict(nnx.state(model)))
    return {"/".join(map(str, p)): values[p] for p in paths}

  out_shardings = None
  if shardings is not None:
    out_shardings = {"/".join(map(str, p)): _fit(shardings[p], leaves[p].shape) for p in paths}
  values = jax.jit(init, out_shardings=out_shardings)()
  return {p: values["/".join(map(str, p))] for p in paths}


def tokenizer(path: str):
  """The ``tokenizers.Tokenizer`` of a checkpoint directory's ``tokenizer.json``.

  Raises:
    ImportError: the optional ``tokenizers`` package is not installed.
    FileNotFoundError: the directory has no ``tokenizer.json``.
  """
  file = os.path.join(os.fspath(path), "tokenizer.json")
  if not os.path.isfile(file):
    raise FileNotFoundError(
      f"{file} does not exist: text needs the checkpoint's tokenizer "
      f"(copy its tokenizer.json into {os.fspath(path)!r}, e.g. from the "
      f"model's Hugging Face repository), or pass token ids instead (a "
      f".npy or .bin file)"
    )
  try:
    from tokenizers import Tokenizer
  except ImportError:
    raise ImportError(
      f"reading text through {file} needs the 'tokenizers' package (pip install "
      f"'attnjax[pretrained]', or pip install tokenizers); or pass token ids "
      f"(a .npy or .bin file)"
    ) from None
  return Tokenizer.from_file(file)
