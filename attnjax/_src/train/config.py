"""One config mechanism: big_vision-style Python configs, ``:arg`` presets, ``--config.x=y``
overrides.

Implementation behind the public module :mod:`attnjax.train.config`.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
from typing import Any, Iterable, Optional, Sequence

import ml_collections

PRESETS = ("cpu", "gpu", "tpu")
DTYPES = ("float32", "bfloat16")


def base_config() -> ml_collections.ConfigDict:
  """Every key a run reads, with the protocol's defaults (cpu-sized).

  Returns:
    A new ``ml_collections.ConfigDict`` (its keys are listed in the training guide).
  """
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.preset = "cpu"
  c.variant = "dense"  # a name from attnjax.train.variants.VARIANTS, or a registered normaliser
  c.run_dir = ""  # entry points fill this in: runs/<experiment>/<arm>
  # Comma-separated modules (dotted names or .py paths) imported before the run, e.g. one
  # that registers a normaliser of your own (attnjax.normalizers.register).
  c.imports = ""

  c.data = ml_collections.ConfigDict()
  c.data.name = "shakespeare"  # shakespeare | text | bin | bigram_backcopy
  c.data.path = ""
  c.data.tokenizer = "char"  # char | byte
  c.data.val_fraction = 0.1
  c.data.seq_len = 64  # tokens per sequence, BOS included
  c.data.batch_size = 32  # global batch (all devices and hosts)
  c.data.vocab_size = 0  # .bin only: ids are < vocab_size
  c.data.bin_dtype = "uint16"
  c.data.bb_vocab_size = 64
  c.data.bb_num_triggers = 3
  c.data.bb_task_seed = 0
  c.data.bb_concentration = 0.1
  c.data.pack = False  # pack whole documents (lines), segment ids + positions
  c.data.objective = "causal"  # causal (next token, a decoder) | mlm (masked LM, an encoder)
  c.data.mask_rate = 0.15  # mlm: share of positions predicted (80% [MASK], 10% random, 10% kept)

  c.model = ml_collections.ConfigDict()
  c.model.d_model = 64
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 0  # 0: same as num_heads
  c.model.mlp = "gelu"  # gelu | swiglu | none (attention-only blocks)
  c.model.mlp_ratio = 4
  c.model.norm = "rms"  # rms | layer
  c.model.rope = True
  c.model.tie_embeddings = True
  c.model.remat = False
  c.model.dtype = "float32"  # compute dtype: float32 | bfloat16 (params stay float32)
  c.model.window = 0  # > 0: causal sliding window of this many past keys
  c.model.implementation = ""  # attention implementation: "" (auto), reference, xla, blockwise, ...
  c.model.norm_placement = ""  # "" (pre; an mlm encoder: post_residual, BERT) | pre | post_residual

  c.opt = ml_collections.ConfigDict()
  c.opt.lr = 1e-2
  c.opt.warmup_frac = 0.05
  c.opt.min_lr_frac = 0.1  # cosine decays to lr * min_lr_frac
  c.opt.b1 = 0.9
  c.opt.b2 = 0.95
  c.opt.eps = 1e-8
  c.opt.weight_decay = 1e-4  # independent of the peak LR (see attnjax.train.optim)
  c.opt.clip = 1.0  # global-norm clipping; 0 disables
  c.opt.z_loss = 0.0  # coef of mean (log Z)^2 on the output logits

  c.train = ml_collections.ConfigDict()
  c.train.steps = 240
  c.train.log_every = 10  # host reads the device metrics every N steps
  c.train.eval_every = 100
  c.train.eval_batches = 4
  c.train.probe_every = 100
  c.train.probe_batch = 16
  c.train.probe_len = 64  # sink statistics on fixed length-64 sequences (Gu et al.)
  c.train.checkpoint_every = 100  # 0: only at the end
  c.train.keep_checkpoints = 2
  c.train.stop_after = 0  # > 0: stop (as if killed) after this many steps; for resume tests
  c.train.divergence_factor = 1.5  # diverged if loss > factor * initial loss ...
  c.train.divergence_patience = 10  # ... for this many steps in a row (NaN/Inf: at once)
  c.train.num_devices = 0  # devices of the mesh: 0 = all of jax.devices()
  c.train.microbatches = 1  # gradient accumulation over this many microbatches per step
  c.train.step_stats = True  # per-layer attention stats in every training step
  c.train.progress = True
  c.train.plots = True

  # The device mesh (attnjax.train.mesh): sizes of its data, FSDP, tensor and context axes;
  # one of them may be -1 (the devices left). The default is data parallel over every device.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.mesh.context = 1
  return c


def apply_preset(c: ml_collections.ConfigDict, preset: str) -> ml_collections.ConfigDict:
  """Sizes the model and the run for a preset.

  ``cpu`` runs in about a minute per arm on 2 cores; ``gpu`` and ``tpu`` are the real
  size (bf16, 10000 steps).

  Args:
    c: the config, changed in place.
    preset: ``"cpu"``, ``"gpu"`` or ``"tpu"``.

  Returns:
    ``c``.

  Raises:
    ValueError: an unknown preset.
  """
  if preset not in PRESETS:
    raise ValueError(f"preset={preset!r} is not one of: {', '.join(PRESETS)}")
  c.preset = preset
  if preset == "cpu":
    c.model.update(d_model=64, num_layers=2, num_heads=4, mlp_ratio=4)
    c.data.update(seq_len=64, batch_size=32)
    c.train.update(
      steps=240, log_every=10, eval_every=80, probe_every=80, checkpoint_every=80, microbatches=4
    )  # 4 x 8 sequences: the working set stays in a CPU's cache
  else:
    c.model.update(d_model=512, num_layers=8, num_heads=8, mlp_ratio=4)
    c.data.update(seq_len=512, batch_size=64 if preset == "gpu" else 256)
    c.model.dtype = "bfloat16"
    c.train.update(
      steps=10000,
      log_every=50,
      eval_every=1000,
      eval_batches=16,
      probe_every=1000,
      probe_batch=64,
      checkpoint_every=1000,
      progress=True,
    )
    if preset == "tpu":
      # TPU's fused softmax kernel (splash) returns no attention statistics: with them in every
      # step, dense layers would train on the block-wise XLA loop. The probe (every
      # probe_every steps) still measures them; --config.train.step_stats=true restores them.
      c.train.step_stats = False
  return c


# ---------------------------------------------------------------------------
# The ``:arg`` string and ``--config.x=y`` overrides.


def _parse_value(key: str, text: str, current: Any) -> Any:
  """``text`` parsed to the type of ``current`` (bool, int, float, str; literal otherwise)."""
  if isinstance(current, bool):
    low = text.strip().lower()
    if low in ("true", "1", "yes"):
      return True
    if low in ("false", "0", "no"):
      return False
    raise ValueError(f"{key}={text!r}: expected a bool (true/false)")
  if isinstance(current, int):
    try:
      value = float(text)
    except ValueError:
      raise ValueError(f"{key}={text!r}: expected an int") from None
    if value != int(value):
      raise ValueError(f"{key}={text!r}: expected an int")
    return int(value)
  if isinstance(current, float):
    try:
      return float(text)
    except ValueError:
      raise ValueError(f"{key}={text!r}: expected a float") from None
  if isinstance(current, str):
    return text
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def parse_arg(arg: Optional[str], **defaults: Any) -> ml_collections.ConfigDict:
  """The ``k=v,k2=v2`` string of ``--config file.py:ARG`` as a ConfigDict of ``defaults``' keys.

  A bare word ``k`` means ``k=True``. Each value is parsed to its default's type.

  Args:
    arg: the string after ``:``, or None (all defaults).
    **defaults: every accepted key with its default.

  Returns:
    A ``ConfigDict`` with every key of ``defaults``.

  Raises:
    ValueError: an unknown key (named) or a value that does not parse.
  """
  out = ml_collections.ConfigDict(defaults)
  for item in (arg or "").split(","):
    item = item.strip()
    if not item:
      continue
    key, sep, text = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ValueError(f"config argument {key!r} is unknown; known: {', '.join(sorted(defaults))}")
    out[key] = _parse_value(key, text if sep else "true", defaults[key])
  return out


def _lookup(cfg: ml_collections.ConfigDict, dotted: str) -> tuple[ml_collections.ConfigDict, str]:
  parts = dotted.split(".")
  node = cfg
  for i, part in enumerate(parts):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      close = difflib.get_close_matches(part, known, n=1)
      hint = f" (did you mean {'.'.join(parts[:i] + close)!r}?)" if close else ""
      where = ".".join(parts[:i]) or "config"
      raise KeyError(f"config key {dotted!r} is unknown: {where} has no {part!r}{hint}")
    if i < len(parts) - 1:
      node = node[part]
  return node, parts[-1]


def apply_overrides(
  cfg: ml_collections.ConfigDict, overrides: Iterable[str]
) -> ml_collections.ConfigDict:
  """Applies ``key=value`` overrides (``["opt.lr=3e-3", "train.steps=100"]``) in order.

  Values are parsed to the type of the key's current value (bool, int, float, str).

  Args:
    cfg: the config, changed in place.
    overrides: ``"dotted.key=value"`` strings.

  Returns:
    ``cfg``.

  Raises:
    ValueError: an item without ``=``, an unknown key or a group (both named), or a
      value that does not parse as the key's type.
  """
  for item in overrides:
    key, sep, text = item.partition("=")
    if not sep:
      raise ValueError(f"override {item!r} must look like key=value")
    node, leaf = _lookup(cfg, key.strip())
    if isinstance(node[leaf], ml_collections.ConfigDict):
      raise ValueError(f"config key {key!r} is a group; set one of its keys: {sorted(node[leaf])}")
    node[leaf] = _parse_value(key, text, node[leaf])
  return cfg


def load_config(
  spec: str, overrides: Sequence[str] = (), *, check: bool = True
) -> ml_collections.ConfigDict:
  """Loads ``path.py[:arg]``, calls its ``get_config(arg)``, applies ``overrides``, validates.

  Args:
    spec: ``"path/to/config.py"`` or ``"path/to/config.py:arg"`` (big_vision style;
      ``arg`` is the config's own ``k=v,...`` string).
    overrides: ``"dotted.key=value"`` strings (:func:`.apply_overrides`).
    check: run :func:`~attnjax.train.validate`; False for configs that do not train,
      such as ``favor_approx``'s (they check their own keys).

  Returns:
    The ``ml_collections.ConfigDict``.

  Raises:
    FileNotFoundError: no such config file.
    ValueError: a file without ``get_config``, a bad override, or a config that does not
      validate (the message names the key).
  """
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"--config {path!r} does not exist")
  module_spec = importlib.util.spec_from_file_location(
    "attnjax_config_" + os.path.splitext(os.path.basename(path))[0], path
  )
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ValueError(f"--config {path!r} defines no get_config(arg)")
  cfg = module.get_config(arg or None)
  apply_overrides(cfg, overrides)
  if check:
    validate(cfg)
  return cfg


def split_argv(argv: Sequence[str]) -> tuple[Optional[str], list[str], list[str]]:
  """Separates ``--config SPEC``, ``--config.k=v`` (also ``--config.k v``) and the other args.

  Args:
    argv: command-line arguments (without the program name).

  Returns:
    ``(spec or None, ["k=v", ...] overrides, other arguments)``.

  Raises:
    ValueError: ``--config`` or ``--config.k`` without a value.
  """
  spec, overrides, rest = None, [], []
  i = 0
  argv = list(argv)
  while i < len(argv):
    a = argv[i]
    if a == "--config":
      if i + 1 >= len(argv):
        raise ValueError("--config needs a value: path/to/config.py[:arg]")
      spec = argv[i + 1]
      i += 2
      continue
    if a.startswith("--config="):
      spec = a[len("--config=") :]
    elif a.startswith("--config."):
      body = a[len("--config.") :]
      if "=" not in body:
        if i + 1 >= len(argv):
          raise ValueError(f"{a} needs a value")
        body = f"{body}={argv[i + 1]}"
        i += 1
      overrides.append(body)
    else:
      rest.append(a)
    i += 1
  return spec, overrides, rest


# ---------------------------------------------------------------------------
# Validation before training.


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise ValueError(message)


def import_modules(cfg: ml_collections.ConfigDict) -> list[str]:
  """Imports the modules of ``cfg.imports`` (comma-separated dotted names, or ``.py`` paths
  from the working directory), e.g. one that registers a normaliser; returns their names.

  Importing twice is a no-op (``sys.modules``), so a run in a subprocess, which reads the
  resolved config, imports them again before building its model.

  Raises:
    ValueError: a module that does not import (named, with the error).
  """
  import importlib
  import sys

  names = []
  for entry in (s.strip() for s in str(cfg.get("imports", "") or "").split(",")):
    if not entry:
      continue
    try:
      if entry.endswith(".py"):
        path = os.path.abspath(entry)
        name = "attnjax_import_" + os.path.splitext(os.path.basename(path))[0]
        if name not in sys.modules:
          spec = importlib.util.spec_from_file_location(name, path)
          if spec is None or not os.path.isfile(path):
            raise FileNotFoundError(f"not found: {path}")
          module = importlib.util.module_from_spec(spec)
          sys.modules[name] = module
          try:
            spec.loader.exec_module(module)
          except BaseException:
            del sys.modules[name]
            raise
      else:
        name = importlib.import_module(entry).__name__
    except Exception as e:
      raise ValueError(f"imports={cfg.imports!r}: {entry!r} does not import: {e}") from e
    names.append(name)
  return names


def validate(cfg: ml_collections.ConfigDict, *, num_devices: Optional[int] = None) -> None:
  """Checks a run's config before anything is built: choices, sizes and shapes.

  The modules of ``cfg.imports`` are imported first, so a variant may name a normaliser one
  of them registers.

  Args:
    cfg: a config with the keys of :func:`.base_config`.
    num_devices: the devices the run will use; also checks that the batch splits over
      them (and the mesh fills them).

  Raises:
    ValueError: the first key whose value cannot run, named with its value.
  """
  from attnjax._src.data import SOURCES
  from attnjax._src.train import variants

  import_modules(cfg)
  _lookup(cfg, "variant")
  _require(
    cfg.variant in variants.names(),
    f"variant={cfg.variant!r} is not one of: {', '.join(sorted(variants.names()))} (a "
    f"normaliser of your own is a variant once registered by a module of imports=)",
  )
  _require(cfg.preset in PRESETS, f"preset={cfg.preset!r} is not one of: {', '.join(PRESETS)}")
  d, m, o, t = cfg.data, cfg.model, cfg.opt, cfg.train
  _require(d.name in SOURCES, f"data.name={d.name!r} is not one of: {', '.join(SOURCES)}")
  _require(
    d.tokenizer in ("char", "byte"), f"data.tokenizer={d.tokenizer!r} is not one of: char, byte"
  )
  if d.name in ("text", "bin"):
    _require(bool(d.path), f"data.path must be set when data.name={d.name!r}")
    _require(os.path.exists(d.path), f"data.path={d.path!r} does not exist")
  if d.name == "bin":
    _require(d.vocab_size > 0, "data.vocab_size must be > 0 for data.name='bin'")
  _require(
    d.get("objective", "causal") in ("causal", "mlm"),
    f"data.objective={d.get('objective')!r} is not one of: causal, mlm",
  )
  if d.get("objective", "causal") == "mlm":
    rate = d.get("mask_rate", 0.15)
    _require(
      not isinstance(rate, bool) and isinstance(rate, (int, float)) and 0 < rate < 1,
      f"data.mask_rate must be in (0, 1), got {rate!r}",
    )
    _require(
      not d.get("pack", False), "data.pack=True: data.objective='mlm' reads unpacked windows"
    )
    _require(
      d.name != "bigram_backcopy", "data.objective='mlm' needs a corpus, not bigram_backcopy"
    )
  _require(
    m.get("norm_placement", "") in ("", "pre", "post_residual"),
    f"model.norm_placement={m.get('norm_placement')!r} is not one of: '', pre, post_residual",
  )
  _require(d.seq_len >= 2, f"data.seq_len must be >= 2 (BOS + one token), got {d.seq_len}")
  _require(d.batch_size >= 1, f"data.batch_size must be >= 1, got {d.batch_size}")
  if d.get("pack", False):
    _require(
      d.name != "bigram_backcopy",
      "data.pack=True needs a corpus of documents; data.name='bigram_backcopy' has none",
    )
    from attnjax._src.nn import specs as nn_specs  # flax: imported only to check packing

    family = variants.attention_kwargs(cfg.variant).get("family", "dense")
    _require(
      nn_specs.FAMILY_SPECS[family].takes_segment_ids,
      f"data.pack=True needs attention that takes segment_ids; variant={cfg.variant!r} "
      f"(family={family!r}) cannot",
    )
  _require(
    m.d_model >= 1 and m.num_layers >= 1 and m.num_heads >= 1,
    "model.d_model, model.num_layers and model.num_heads must be >= 1",
  )
  _require(
    m.d_model % m.num_heads == 0,
    f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}",
  )
  kv = m.num_kv_heads or m.num_heads
  _require(
    m.num_heads % kv == 0,
    f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads={kv}",
  )
  head_dim = m.d_model // m.num_heads
  _require(
    not m.rope or head_dim % 2 == 0,
    f"model.rope needs an even head dim, got model.d_model/model.num_heads={head_dim}",
  )
  _require(
    m.mlp in ("gelu", "swiglu", "none"), f"model.mlp={m.mlp!r} is not one of: gelu, swiglu, none"
  )
  _require(m.norm in ("rms", "layer"), f"model.norm={m.norm!r} is not one of: rms, layer")
  _require(m.dtype in DTYPES, f"model.dtype={m.dtype!r} is not one of: {', '.join(DTYPES)}")
  _require(m.window >= 0, f"model.window must be >= 0, got {m.window}")
  _require(o.lr > 0, f"opt.lr must be > 0, got {o.lr}")
  _require(0 <= o.warmup_frac < 1, f"opt.warmup_frac must be in [0, 1), got {o.warmup_frac}")
  _require(0 <= o.min_lr_frac <= 1, f"opt.min_lr_frac must be in [0, 1], got {o.min_lr_frac}")
  _require(0 <= o.b1 < 1 and 0 <= o.b2 < 1, f"opt.b1={o.b1}, opt.b2={o.b2} must be in [0, 1)")
  _require(
    o.weight_decay >= 0 and o.clip >= 0 and o.z_loss >= 0,
    "opt.weight_decay, opt.clip and opt.z_loss must be >= 0",
  )
  _require(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
  for key in ("log_every", "eval_every", "probe_every"):
    _require(t[key] >= 1, f"train.{key} must be >= 1, got {t[key]}")
  _require(
    t.checkpoint_every >= 0, f"train.checkpoint_every must be >= 0, got {t.checkpoint_every}"
  )
  _require(t.probe_len >= 2, f"train.probe_len must be >= 2, got {t.probe_len}")
  _require(
    t.divergence_factor > 1, f"train.divergence_factor must be > 1, got {t.divergence_factor}"
  )
  _require(
    t.divergence_patience >= 1,
    f"train.divergence_patience must be >= 1, got {t.divergence_patience}",
  )
  _require(t.num_devices >= 0, f"train.num_devices must be >= 0, got {t.num_devices}")
  _require(
    t.microbatches >= 1 and d.batch_size % t.microbatches == 0,
    f"data.batch_size={d.batch_size} is not divisible by train.microbatches={t.microbatches}",
  )
  if num_devices is not None and t.num_devices:
    _require(
      t.num_devices <= num_devices,
      f"train.num_devices={t.num_devices} but only {num_devices} devices exist",
    )
    num_devices = t.num_devices
  if num_devices is not None:  # the mesh fills the devices; the shapes split over it
    from attnjax._src.train import mesh as mesh_lib

    mesh_lib.check_shapes(cfg, mesh_lib.mesh_sizes(cfg.get("mesh", {}), num_devices))
