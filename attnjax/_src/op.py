"""Ops: an attention family as data, its engines, and the one dispatch every family shares.

An :class:`Op` is a family as dispatch sees it: its :class:`Engine` records (one per
``implementation=`` name, ``"reference"`` among them), its auto-dispatch order per
platform, its answer to an empty call, its context-parallel strategy and its sample calls
(:class:`Sample`, read by the test suites that cover every family). A family validates a
call into its canonical tuple and hands it to :func:`run`; every engine takes it
(``compute(*call)``, ``unsupported(*call)``) and runs through :func:`run_engine`. Every
op registers in :data:`OPS`; :func:`table` renders them for the architecture guide.
Guide: docs/guides/architecture.md, section "Ops and engines".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional, Sequence

import jax

from attnjax._src import validators, deprecation, lowering, sharding, trust

# Who vouches for an engine on hardware (:attr:`Engine.vouched_by`).
VOUCHED_BY = ("jax", "attnjax", "device-check")


@dataclasses.dataclass(frozen=True)
class Engine:
  """One implementation of an op, as dispatch sees it: adding an engine is one of these in
  the op's engines and, for auto-dispatch, its name in a list of the op's preferences.

  Attributes:
    name: the ``implementation=`` that names it.
    compute: ``(*call) -> out`` on a call ``unsupported`` accepts, without a wrong-platform
      guard (a ``platform_dependent`` branch is its own guard); a ``per_shard`` engine's
      also takes ``shard_offsets=``.
    unsupported: ``(*call) -> reasons`` it cannot honour the call ([] = it can); checked
      once per call.
    platform: the platform it lowers for (``"cuda"``, ``"tpu"``), or None: any.
    where: where it runs, for the error of a named call lowered for another platform.
    per_shard: a custom call XLA cannot partition: under a multi-device mesh it runs inside
      :func:`attnjax._src.sharding.per_shard` (on the call's first element, its inputs).
    vouched_by: who checks it on hardware: ``"jax"`` (jax's own kernels), ``"attnjax"``
      (plain JAX, held equal to the reference by this project's tests) or
      ``"device-check"`` (attnjax's Pallas kernels: auto-dispatch takes them only where
      :mod:`attnjax._src.trust` allows).
    min_length: auto-dispatch takes it from this sequence length on (the op's ``length``).
    max_length: auto-dispatch takes it up to this sequence length (None: any).
    trust_name: the kernel whose verdicts vouch for it (:func:`attnjax._src.trust.allows`), where
      that is not ``name``: NSA's ``pallas_tpu`` engine runs the selected-block kernel
      ``"selected_pallas_tpu"``, not the dense ``"pallas_tpu"``. Empty: ``name``.
  """

  name: str
  compute: Callable[..., Any]
  unsupported: Callable[..., list[str]]
  platform: Optional[str] = None
  where: str = ""
  per_shard: bool = False
  vouched_by: str = "attnjax"
  min_length: int = 0
  max_length: Optional[int] = None
  trust_name: str = ""

  def __post_init__(self):
    if self.vouched_by not in VOUCHED_BY:
      raise ValueError(
        f"Engine {self.name!r}: vouched_by={self.vouched_by!r} is not one of {VOUCHED_BY}"
      )

  @property
  def verdict_name(self) -> str:
    """The kernel name its verdicts are recorded under (``trust_name``, else ``name``)."""
    return self.trust_name or self.name

  def takes_length(self, length: int) -> bool:
    """Whether auto-dispatch may take it for a call of this sequence length."""
    return self.min_length <= length and (self.max_length is None or length <= self.max_length)


def platform_kernel(
  name: str,
  compute: Callable[..., Any],
  unsupported: Callable[..., list[str]],
  *,
  platform: str,
  where: str,
  vouched_by: str = "device-check",
  trust_name: str = "",
) -> Engine:
  """The record of a platform kernel (a custom call XLA cannot partition): it lowers for
  ``platform`` only and runs per shard of a multi-device mesh; ``trust_name``: the kernel
  whose verdicts vouch for it, where that is not ``name``."""
  return Engine(
    name,
    compute,
    unsupported,
    platform=platform,
    where=where,
    per_shard=True,
    vouched_by=vouched_by,
    trust_name=trust_name,
  )


def supports_everything(*call) -> list[str]:
  """The ``unsupported`` of an engine that honours every call its family validates."""
  del call
  return []


def _no_context(*call) -> Optional[str]:
  del call
  return None


@dataclasses.dataclass(frozen=True)
class Sample:
  """One way to call an op's public function, for the test suites that cover every family.

  An op supplies its samples (:attr:`Op.samples`); the suites over every family (engines
  against the reference, edge inputs, the option walk, forward mode, forwarded keywords,
  context parallelism) call them, so adding a family edits none of those suites. Every
  field but ``function`` has a default: a plain ``q, k, v`` function needs no more.

  Attributes:
    function: the public function, called ``function(q, k, v, **arrays, **options,
      implementation=...)``.
    label: the sample's name in test ids (default: ``function.__name__``).
    options: the keywords of a plain call besides q, k, v and the arrays.
    arrays: ``(q, k, v) -> (q, k, v, {keyword: array})``: a call's inputs from drawn
      ``q [B, T, N, H]``, ``k, v [B, S, K, H]``: the further arrays it takes (gates, gains,
      temperatures: differentiable, drawn from the shapes) and any change its maths wants
      of q, k, v (the delta rule's unit keys). None: q, k, v as drawn, nothing more.
    self_only: keys are the queries' tokens (``S == T``).
    stats: it takes ``return_stats`` (the result becomes ``(result, AttentionStats)``).
    state: it takes ``return_state`` (the result becomes ``(out, final state)``).
    flags: its bool options.
    static: ``((name, value), ...)``: a valid value of each static numeric option.
    choices: ``((name, values), ...)``: valid values of its own options, for the option walk.
    defects: ``((name, values), ...)``: invalid values of its own options, each refused with
      an error that names the option.
    dense_keywords: the dense keywords it forwards (of :data:`attnjax._src.options.KEYWORDS`).
    own_keywords: dense keyword names it takes with a meaning of its own.
    own_defaults: its defaults of dense keywords that differ from dense attention's.
    context: it takes ``context_axis`` (inside ``jax.shard_map`` it returns its shard of
      the unsharded call's result).
    extreme_values: its engines agree with its reference on huge values and NaNs (the
      option walk draws them).
  """

  function: Callable[..., Any]
  label: str = ""
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  arrays: Optional[Callable[..., Any]] = None
  self_only: bool = False
  stats: bool = False
  state: bool = False
  flags: tuple[str, ...] = ()
  static: tuple[tuple[str, Any], ...] = ()
  choices: tuple[tuple[str, tuple[Any, ...]], ...] = ()
  defects: tuple[tuple[str, tuple[Any, ...]], ...] = ()
  dense_keywords: tuple[str, ...] = ()
  own_keywords: tuple[str, ...] = ()
  own_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  context: bool = False
  extreme_values: bool = False

  @property
  def name(self) -> str:
    """The label, or the function's name."""
    return self.label or getattr(self.function, "__name__", "sample").lstrip("_")

  def inputs(self, q, k, v) -> tuple[Any, Any, Any, dict[str, Any]]:
    """``(q, k, v, {keyword: array})`` of a call on drawn ``q, k, v``."""
    return (q, k, v, {}) if self.arrays is None else self.arrays(q, k, v)

  def call(self, q, k, v, *, implementation=None, **options):
    """``function`` on ``q, k, v`` with its arrays, ``options`` over its own."""
    q, k, v, arrays = self.inputs(q, k, v)
    return self.function(
      q, k, v, **arrays, **{**self.options, **options}, implementation=implementation
    )


@dataclasses.dataclass(frozen=True)
class Op:
  """An attention family as dispatch sees it.

  ``engines`` and ``preferences`` are the family's own (mutable) tables, read on every call,
  so a record added to them is dispatched at once.

  Attributes:
    name: the family's name (``"dense"``, ``"sparse"``, ...), as messages and :data:`OPS`
      name it.
    engines: ``{name: Engine}``; its keys are the valid ``implementation=`` values.
    preferences: auto-dispatch's order per ``platform_dependent`` key (``"cuda"``,
      ``"tpu"``, ``"cpu"``): the first engine that supports the call, then ``fallback``.
      A platform without a list takes ``fallback`` alone.
    fallback: the engines every platform ends its list with; the last must support every
      call.
    empty: ``(*call) -> answer`` for a call with no queries or no keys (asked only where
      ``is_empty(*call)``), or None: the family answers such calls itself.
    is_empty: ``(*call) -> bool``.
    context: the context-parallel strategy, ``(call, implementation, local) -> out`` for a
      call whose sequence is sharded over the axis ``context_axis(*call)`` names, or None.
      ``local(call, implementation)`` is the op's per-device computation
      (:func:`run_on_this_platform` of this op), handed down by :func:`run`: the strategy
      calls it on the calls it makes of its shards (without the context axis), so no family
      module is entered again.
    context_axis: ``(*call) -> axis name or None``.
    length: ``(*call) -> int``, the sequence length engines' ``min_length`` and
      ``max_length`` compare with.
    trust_class: ``(*call) -> case class`` the kernels' verdicts name
      (:func:`attnjax._src.trust.call_class`), for engines vouched by ``"device-check"``.
    renamed: old engine names still accepted (``{old: new}``), each warning once.
    samples: ``() -> (Sample, ...)``: how the test suites over every family call the op's
      public functions (read when the tests are collected, so a lambda may name functions
      defined after the op).
  """

  name: str
  engines: dict[str, Engine]
  preferences: Mapping[str, tuple[str, ...]]
  fallback: tuple[str, ...]
  empty: Optional[Callable[..., Any]] = None
  is_empty: Callable[..., bool] = lambda *call: False
  context: Optional[Callable[..., Any]] = None
  context_axis: Callable[..., Optional[str]] = _no_context
  length: Callable[..., int] = lambda *call: 0
  trust_class: Optional[Callable[..., Any]] = None
  renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)
  samples: Callable[[], Sequence[Sample]] = lambda: ()

  @property
  def implementations(self) -> tuple[str, ...]:
    """The valid ``implementation=`` names (the engines'), in the order of ``engines``."""
    return tuple(self.engines)


# The platform_dependent keys of the ops table's columns; "cpu" stands for every other platform.
PLATFORMS = ("cuda", "tpu", "cpu")

# Every op, by name; each family module registers its own when imported.
OPS: dict[str, Op] = {}


def register(op: Op) -> Op:
  """Adds ``op`` to :data:`OPS` (one op per name) and returns it."""
  if op.name in OPS and OPS[op.name] is not op:
    raise ValueError(f"an op named {op.name!r} is already registered")
  OPS[op.name] = op
  return op


def table(ops: Optional[Mapping[str, Op]] = None) -> str:
  """The ops as a markdown table (docs/guides/architecture.md holds it): each op's engines, the
  valid ``implementation=`` values, and auto-dispatch's order of them per platform (the
  first that supports a call runs; a platform without a column takes the op's fallback). ``ops``: :data:`OPS` by default; rows in name order."""
  ops = OPS if ops is None else ops
  names = lambda seq: ", ".join(f"`{n}`" for n in seq)
  rows = [
    "| Op | Engines (`implementation=`) | Auto-dispatch on `cuda` | on `tpu` | on `cpu` |",
    "|---|---|---|---|---|",
  ]
  for name in sorted(ops):
    op = ops[name]
    cuda, tpu, cpu = (names(tuple(op.preferences.get(p, ())) + op.fallback) for p in PLATFORMS)
    rows.append(f"| `{name}` | {names(op.implementations)} | {cuda} | {tpu} | {cpu} |")
  return "\n".join(rows) + "\n"


def check_implementation(
  op: Op, implementation: Optional[str], *, where: Optional[str] = None
) -> Optional[str]:
  """``implementation`` as the name of one of ``op``'s engines (None: auto).

  An old name of :attr:`Op.renamed` still works and warns once. ``where`` names the public
  function in that warning (``op.name`` by default).

  Raises:
    TypeError: not a str or None.
    ValueError: not an engine of the op (the message lists them).
  """
  if implementation is None:
    return None
  if implementation in op.renamed:
    new = op.renamed[implementation]
    where = where or op.name
    deprecation.warn_renamed(
      f"{where}(implementation={implementation!r})",
      f"{where}(implementation={new!r})",
      stacklevel=3,
    )
    implementation = new
  validators.check_implementation("implementation", implementation, op.implementations)
  return implementation


def choose(op: Op, call: Sequence[Any], platforms: Sequence[str]) -> dict[str, str]:
  """``{platform: engine name}``: each platform's first engine of its list that covers the
  call; each engine's ``unsupported`` runs once however many lists name it.

  Engines vouched by ``"device-check"`` are taken only where :func:`attnjax._src.trust.allows`
  says so for the call's class (asked first: an engine it refuses with nothing to tell, e.g.
  for a platform with no device known, is not asked its ``unsupported``); the notes of those
  skipped that cover the call are logged once.
  """
  reasons: dict[str, list[str]] = {}
  length = None
  # The case class the kernels' verdicts name, computed only where a verdict is read.
  klass = functools.partial(op.trust_class, *call) if op.trust_class else None
  table = {}
  for platform in platforms:
    notes = []
    for name in tuple(op.preferences.get(platform, ())) + op.fallback:
      engine = op.engines[name]
      if engine.min_length or engine.max_length is not None:
        length = op.length(*call) if length is None else length
        if not engine.takes_length(length):
          continue
      decision = None
      if engine.vouched_by == "device-check":
        decision = trust.allows(engine.verdict_name, platform, klass)
        if not decision.allowed and decision.note is None:
          continue
      if name not in reasons:
        reasons[name] = engine.unsupported(*call)
      if reasons[name]:
        continue
      if decision is not None and not decision.allowed:
        notes.append(decision.note)
        continue
      table[platform] = name
      break
    if platform not in table:  # the op's fallback ends on an engine that refused the call
      refused = "; ".join(f"{n}: {', '.join(r)}" for n, r in reasons.items() if r)
      raise ValueError(f"{op.name}: no engine covers this call on {platform!r} ({refused})")
    if notes:
      trust.note_skipped(notes, table[platform])
  return table


def select(op: Op, call: Sequence[Any], platform: Optional[str] = None) -> str:
  """The engine auto-dispatch takes on ``platform`` (None: the default backend's)."""
  platform = lowering.current_platform() if platform is None else platform
  return choose(op, call, (platform,))[platform]


def compute(engine: Engine, call: Sequence[Any], **options):
  """``engine.compute`` of a call it supports, per shard where it must be (``options``: the
  engine's own keywords, e.g. a kernel's ``block_sizes``)."""
  if not engine.per_shard:
    return engine.compute(*call, **options)
  rest = tuple(call[1:])
  return sharding.per_shard(
    lambda shard, offsets: engine.compute(shard, *rest, shard_offsets=offsets, **options), call[0]
  )


def run_engine(engine: Engine, call: Sequence[Any], *, interpret: bool = False, **options):
  """The one runner of a named engine: its one check of the call, then its computation,
  lowering for its own platform only (another platform raises ``ValueError`` naming its
  ``where`` when the program is lowered).

  Args:
    engine: the engine (an op's, or a kernel module's ``ENGINE``).
    call: the call it takes (``compute(*call)``).
    interpret: run a Pallas kernel in interpret mode, on any platform (its ``unsupported``
      and ``compute`` take ``interpret=True``).
    **options: the engine's own keywords (``block_sizes``), passed to its ``compute``.

  Raises:
    ValueError: the engine does not support the call (the message names its reasons).
  """
  mode = {"interpret": True} if interpret else {}
  reasons = engine.unsupported(*call, **mode)
  if reasons:
    raise ValueError(
      f"implementation={engine.name!r} does not support "
      + "; ".join(reasons)
      + ". Use implementation='reference' or None (auto)."
    )
  if interpret or engine.platform is None:
    return compute(engine, call, **mode, **options)
  return lowering.on_platform(
    engine.platform,
    lambda: compute(engine, call, **options),
    lowering.wrong_platform(engine.name, engine.where),
  )


def dense_runner(engine: Engine) -> Callable[..., Any]:
  """``(inputs, opts, **options) -> out``: :func:`run_engine` of a dense engine (a kernel's
  ``attention()`` entry runs through it)."""
  return lambda inputs, opts, **options: run_engine(engine, (inputs, opts), **options)


def deprecated_run(engine: Engine, module: str) -> Callable[..., Any]:
  """A kernel module's old ``run(inputs, opts, **options)``: :func:`run_engine` of its engine,
  warning once that ``module.attention`` (or the ``implementation=`` name) replaces it."""

  def run(inputs, opts, **options):
    deprecation.warn_once(
      f"{module}.run", f"{module}.attention(q, k, v, ...) or implementation={engine.name!r}"
    )
    return run_engine(engine, (inputs, opts), **options)

  run.__doc__ = (
    f"Deprecated (warns once): the ``{engine.name}`` engine on a validated dense call; call "
    f"``{module}.attention`` or ``attnjax.dot_product_attention(..., "
    f"implementation={engine.name!r})``."
  )
  return run


def run(op: Op, call: Sequence[Any], implementation: Optional[str]):
  """Runs a validated call on the named engine, or on each platform's choice.

  In order: a call with no queries or no keys gets ``op.empty``'s answer before any engine
  is chosen; a call with a context axis goes to ``op.context``, with this op's
  :func:`run_on_this_platform` as the per-device computation; a named engine runs through
  :func:`run_engine`; ``implementation=None`` is decided when the program is lowered: the
  choices of :func:`choose` for every platform become the branches of one
  ``jax.lax.platform_dependent`` (a single branch when they agree), so a function exported
  for ``cuda`` or ``tpu`` from a CPU host carries the GPU or TPU engine.
  """
  call = tuple(call)
  if op.empty is not None and op.is_empty(*call):
    return op.empty(*call)
  if op.context is not None and op.context_axis(*call) is not None:
    return op.context(call, implementation, functools.partial(run_on_this_platform, op))
  if implementation is not None:
    return run_engine(op.engines[implementation], call)
  current = lowering.current_platform()
  table = choose(op, call, tuple(dict.fromkeys(lowering.PLATFORMS + (current,))))
  if len(set(table.values())) == 1:
    return compute(op.engines[table["cpu"]], call)
  branches = {p: functools.partial(compute, op.engines[name], call) for p, name in table.items()}
  return jax.lax.platform_dependent(**branches, default=branches["cpu"])


def run_on_this_platform(op: Op, call: Sequence[Any], implementation: Optional[str]):
  """:func:`run`, with ``implementation=None`` chosen for the platform lowering now: inside a
  context-parallel ``shard_map`` only that platform's engine is traced (another platform's
  ``pallas_call`` would have no manual-axis types there)."""
  call = tuple(call)
  if implementation is None:
    return compute(op.engines[select(op, call)], call)
  return run(op, call, implementation)
