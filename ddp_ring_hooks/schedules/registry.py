"""The algorithm registry: one :class:`Algorithm` record per all-reduce algorithm, registered once.

A record says everything the rest of the package needs to know about an algorithm, so no
consumer keeps a list of names or an ``if algorithm == ...`` chain of its own:

==============  ===================================================================================
``build``       the schedule builder ``(world_size, **options) -> Schedule`` (``None``: the
                algorithm has no schedule, e.g. ``native``, the group's own all-reduce)
``options``     its :class:`Option` s: names, defaults, checks, and where a default comes from
``cost``        its α-β-γ :class:`CostTerms` for ``p`` ranks (the cost model multiplies them out)
``priced_as``   without a ``cost`` of its own: the algorithm whose terms it is fitted with
``uplink_cost`` its closed form when each node's ranks share one uplink, ``(p, placement,
                **options) -> CostTerms`` (``None``, or a ``None`` answer: the cost model
                counts the terms from the schedule, which is slow for large ``p``)
``layout``      how to draw it: ``"ring"``, ``"tree"``, ``"trees"``, ``"star"`` or ``"nodes"``
``applies``     whether it makes sense for ``world_size`` ranks with its resolved options
``examples``    valid option sets for ``p`` ranks (the test grids enumerate them)
==============  ===================================================================================

Adding an algorithm is one schedule file and one :func:`register_algorithm` call, adding an
option one :class:`Option` in its record (see ``docs/architecture.md``). :func:`get_algorithm`
is the one place that refuses an unknown name, and :func:`resolve_options` the one place that
checks options and fills their defaults, reading the environment (``LOCAL_WORLD_SIZE``) there
and nowhere else. The resolved options travel with the schedule (:attr:`Schedule.options`), so
a consumer never re-derives them. Consumers that take options for several algorithms at once
(the command line's flags, ``auto``'s candidates, the advisor's what-ifs) enumerate them with
:func:`options_by_name` and hand each algorithm its share with :func:`options_for`: no
consumer spells an option's name.

Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from .ir import Schedule

#: Option values are plain Python values (ints, None); checks return an error text or ``None``.
Check = Callable[[object], "str | None"]


@dataclass(frozen=True, slots=True)
class Option:
    """One option of an algorithm: everything the package shows and checks about it.

    ``doc`` is its help (the command line's ``--name`` flag shows it, after the algorithms that
    take it); ``check`` returns what is wrong with a value, or ``None``; ``environment`` names a
    variable that supplies the value when the caller gives none (``LOCAL_WORLD_SIZE`` for
    ``hierarchical``'s ``local_size``, as torchrun sets it); ``label`` shows a value in tables
    and titles (``"{} segments"``); ``metavar`` names the value in help and hints (``K``), and
    ``parse`` reads it from a command-line word. ``per_size`` makes the default depend on the
    buffer: when the caller gives no value, ``per_size(nbytes)`` is the value for an ``nbytes``
    buffer (a pipeline that deepens with the buffer, as NCCL's fixed chunk size makes it), chosen
    where the size is known (:func:`resolve_options` with ``nbytes``); without a size the option
    stays ``None``, "by size", and a schedule built without one takes ``per_size(0)``.
    ``transfer=True`` marks a property of the transfers rather than of the schedule's shape
    (the wire dtype, ``schedules/wire.py``): the builder and the closed-form costs do not take
    it (:func:`shape_options` leaves it out for them); it travels in ``Schedule.options`` for
    the executor and the cost model.
    """

    name: str
    default: object
    doc: str
    check: Check = lambda value: None
    environment: str | None = None
    label: str = ""
    metavar: str = "VALUE"
    parse: Callable[[str], object] = int
    per_size: Callable[[int], object] | None = None
    transfer: bool = False

    @property
    def required(self) -> bool:
        """Whether the caller (or the environment) must give it: its default fails its own check
        (``local_size``); an option whose default passes is optional even when it is ``None``."""
        return self.check(self.default) is not None

    def describe(self, value: object) -> str:
        """The value as tables show it: ``"4 segments"``, ``"2/node"``."""
        return self.label.format(value) if self.label else f"{self.name}={value}"


@dataclass(frozen=True, slots=True)
class CostTerms:
    """An algorithm's time in the α-β-γ model, as coefficients of its terms::

        time = messages·α + n·(bytes·β + (reduced + cast)·γ) + local_messages·α_l + n·local_bytes·β_l

    ``messages`` are the message start-ups on the critical path, ``bytes`` and ``reduced`` the
    bytes sent and added there per byte of the ``n``-byte buffer; the ``local_`` terms are the
    same for links inside a node (hierarchical), priced at ``α_l, β_l``. ``cast``: bytes of the
    buffer narrowed to or widened from a narrower wire dtype, a pass over memory like an
    addition, so priced at γ too (0 unless the wire is narrower: ``schedules/wire.py``).
    """

    messages: float = 0.0
    bytes: float = 0.0
    reduced: float = 0.0
    local_messages: float = 0.0
    local_bytes: float = 0.0
    cast: float = 0.0


#: The two directions of a rank's full-duplex link, and both at once: what a part of an
#: all-reduce holds (``Algorithm.link_directions``). A ring sends and receives in every step
#: (:data:`BOTH_WAYS`); a tree's root receives the whole reduce, then sends the whole broadcast.
OUT, IN, BOTH = "out", "in", "both"


def both_ways(world_size: int, **_options) -> tuple[tuple[str, float], ...]:
    """The ``link_directions`` of an algorithm whose busiest rank sends and receives in every
    step (the ring, the hierarchy's rings): its whole link time holds both directions."""
    return ((BOTH, 1.0),)


@dataclass(frozen=True, slots=True)
class Algorithm:
    """Everything the package knows about one all-reduce algorithm (see the module docstring)."""

    name: str
    summary: str
    build: Callable[..., Schedule] | None
    cost: Callable[..., CostTerms] | None = None
    # The busiest rank's bytes sent per byte of buffer, in closed form, for algorithms whose
    # schedules grow too big to count at the advisor's large world sizes (a ring of 512 ranks
    # is half a million transfers); None: counted on the schedule.
    busiest_sends: Callable[..., float] | None = None
    # The busiest rank's link directions in closed form, for the same reason: in order, each
    # part of its link time as (OUT, IN or BOTH, share of it) (see :data:`BOTH_WAYS`); None:
    # counted on the schedule (the advisor's replay, ``advisor/link_directions.py``).
    link_directions: Callable[..., tuple[tuple[str, float], ...]] | None = None
    priced_as: str | None = None
    uplink_cost: Callable[..., CostTerms | None] | None = None
    layout: str = "ring"
    options: tuple[Option, ...] = ()
    applies: Callable[[int, dict], bool] = lambda world_size, options: True
    examples: Callable[[int], tuple[dict, ...]] = lambda world_size: ({},)
    _by_name: dict[str, Option] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name.update((option.name, option) for option in self.options)

    def option(self, name: str) -> Option:
        """Its option called ``name`` (a ``KeyError`` when it has none)."""
        return self._by_name[name]

    @property
    def option_names(self) -> tuple[str, ...]:
        """The names of its options, in declaration order."""
        return tuple(self._by_name)


_REGISTRY: dict[str, Algorithm] = {}


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` to the registry (a name may be registered once)."""
    if algorithm.name in _REGISTRY:
        raise ValueError(f"an algorithm named {algorithm.name!r} is already registered")
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def algorithm_names(*, scheduled_only: bool = False) -> tuple[str, ...]:
    """Every registered name, in registration order; ``scheduled_only``: those with a schedule."""
    return tuple(name for name, algorithm in _REGISTRY.items() if not (scheduled_only and algorithm.build is None))


def get_algorithm(name: str) -> Algorithm:
    """The record of ``name``; the one place an unknown name is refused."""
    algorithm = _REGISTRY.get(name)
    if algorithm is None:
        raise ValueError(
            f"unknown algorithm {name!r}{_did_you_mean(name, _REGISTRY)}; choose one of "
            f"{', '.join(_REGISTRY)} (or 'auto', where an algorithm is chosen per bucket)"
        )
    return algorithm


def formula_for(name: str) -> str:
    """The algorithm whose cost terms price ``name``: itself, or the one it is ``priced_as``
    (``native`` is fitted to its own timings with the ring's shape)."""
    algorithm = get_algorithm(name)
    return name if algorithm.cost is not None else (algorithm.priced_as or name)


def resolve_options(
    name: str,
    options: Mapping[str, object] | None = None,
    *,
    environment: Mapping[str, str] | None = None,
    nbytes: int | None = None,
) -> dict:
    """``options`` checked against ``name``'s declared options, with every default filled in.

    A missing option takes its ``environment`` variable if one is set, else its default;
    ``environment`` is where those variables are read (default ``os.environ``; the advisor
    passes the one its run recorded). An option chosen by size (``Option.per_size``) that is
    not given takes its value for an ``nbytes`` buffer, or stays ``None`` ("by size") when
    ``nbytes`` is ``None``. Raises ``TypeError`` for an unknown option (naming the valid ones)
    and ``ValueError`` for a bad value (with the option's own check message).
    """
    algorithm = get_algorithm(name)
    options = dict(options or {})
    _refuse_unknown(algorithm, options)
    environment = os.environ if environment is None else environment
    resolved = {}
    for option in algorithm.options:
        value = options.get(option.name, None)
        if value is None and option.environment and option.environment in environment:
            value = _from_environment(option, environment[option.environment])
        if value is None:
            value = option.default
        if value is None and option.per_size is not None and nbytes is not None:
            value = option.per_size(nbytes)  # as sized_options does
        if isinstance(value, list):  # a ring order given as a list: kept as the tuple it equals
            value = tuple(value)
        _check_value(algorithm, option, value)
        resolved[option.name] = value
    return resolved


def shape_options(name: str, options: Mapping[str, object]) -> dict:
    """The entries of ``options`` that shape ``name``'s schedule: what its builder, cost and
    closed forms take (every option but the transfer ones, :attr:`Option.transfer`)."""
    transfer = {option.name for option in get_algorithm(name).options if option.transfer}
    return {key: value for key, value in options.items() if key not in transfer}


def sized_options(name: str, options: Mapping[str, object], nbytes: int) -> dict:
    """``options`` with each option chosen by size (``Option.per_size``) that they leave out or
    set to ``None`` given its value for an ``nbytes`` buffer; the rest as they are (a cheap
    step for every bucket: :func:`resolve_options` does the checking)."""
    sized = dict(options)
    for option in get_algorithm(name).options:
        if option.per_size is not None and option.default is None and sized.get(option.name) is None:
            sized[option.name] = option.per_size(nbytes)
    return sized


def options_by_name() -> dict[str, tuple[Option, tuple[str, ...]]]:
    """Every option a registered algorithm declares, by name: its :class:`Option` (the first
    algorithm's: an option several algorithms share is declared alike) and the algorithms that
    take it, in registration order. What the command line, ``auto`` and the advisor enumerate."""
    found: dict[str, tuple[Option, tuple[str, ...]]] = {}
    for algorithm in _REGISTRY.values():
        for option in algorithm.options:
            first, owners = found.get(option.name, (option, ()))
            found[option.name] = (first, (*owners, algorithm.name))
    return found


def options_for(name: str, given: Mapping[str, object]) -> dict:
    """The entries of ``given`` (options given once for several algorithms, e.g. on the command
    line) that ``name`` declares and that are set (not ``None``)."""
    return {option: given[option] for option in get_algorithm(name).option_names if given.get(option) is not None}


def check_given_options(given: Mapping[str, object], algorithms: Iterable[str] | None = None) -> None:
    """Options given once for several ``algorithms`` (default: every registered one), each value
    checked by every one of them that declares it, as :func:`resolve_options` checks it; for
    options given before it is known which algorithm runs (``auto``'s, the command line's).
    Names that none of them declares are left to the caller to refuse."""
    for name in _REGISTRY if algorithms is None else algorithms:
        algorithm = get_algorithm(name)
        for option in algorithm.options:
            if given.get(option.name) is not None:
                _check_value(algorithm, option, given[option.name])


def algorithm_examples(world_size: int, *, scheduled_only: bool = False) -> tuple[tuple[str, dict], ...]:
    """Every ``(name, options)`` pair the registry offers as an example for ``world_size`` ranks:
    one enumeration for the test grids, the benchmarks and the docs."""
    return tuple(
        (name, dict(options))
        for name, algorithm in _REGISTRY.items()
        if not (scheduled_only and algorithm.build is None)
        for options in algorithm.examples(world_size)
    )


def _refuse_unknown(algorithm: Algorithm, options: Mapping[str, object]) -> None:
    unknown = sorted(set(options) - set(algorithm.option_names))
    if unknown:
        valid = ", ".join(algorithm.option_names) or "none"
        raise TypeError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for the "
            f"{algorithm.name} algorithm{_did_you_mean(unknown[0], algorithm.option_names)}; its options: {valid}"
        )


def _check_value(algorithm: Algorithm, option: Option, value: object) -> None:
    problem = option.check(value)
    if problem:
        raise ValueError(f"{algorithm.name}: {option.name}={value!r} {problem}")


def _from_environment(option: Option, text: str) -> object:
    try:
        return option.parse(text)
    except ValueError as error:
        raise ValueError(f"{option.environment}={text!r} cannot supply {option.name}: {error}") from None


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
