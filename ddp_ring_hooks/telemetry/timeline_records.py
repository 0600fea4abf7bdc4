"""The timeline's records, typed: what :class:`~.timeline.Timeline` writes and the advisor reads.

A ``timeline.jsonl`` is one :class:`TimelineRun` line (what does not change from step to step)
followed by one :class:`TimelineStep` line per optimizer step, each step with its
:class:`TimelineBucket` s. Times are milliseconds; a bucket's times count from the start of
backward::

    {"type": "run", "version": 1, "world_size": 2, "algorithm": "ring", ...}
    {"type": "step", "step": 1, "micro_batches": 1, "step_ms": 41.2, ..., "buckets": [{...}, ...]}
    {"type": "arrivals", "step": 3, "last_ms": [0.0, 12.5]}   (the steps that gathered them)

Pure Python (no torch), so the advisor reads a run offline on any machine. ``to_json`` and
``from_json`` round-trip exactly (``from_json(r.to_json()) == r``). Files written before the
``version`` field existed have the same fields and read as version 1; a file from a newer
version, or a line that lacks a field, is refused with an error that says so.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

from ..cost_model import ProbeSample

#: The format written now; a run line without ``version`` is version 1. Version 2 added the
#: run's algorithm options and the network probe (both optional: a version-1 file reads as one
#: without them). Version 3 added each bucket's ``kind``, ``nnz``, ``sparse_bytes`` and
#: ``dense_bytes`` (a sparse bucket's, for the advisor's gather-or-densify verdict; an older
#: file's buckets read as dense). Version 4 added the run's ``param_sparse``: which parameters
#: DDP gives a sparse bucket of their own (an older file's are found by their dense size).
#: Version 5 added a probe sample's ``algorithm`` and ``options`` (its second message count;
#: an older file's probe reads as the run's algorithm only, and no per-call cost is fitted).
#: Version 6 added each bucket's ``call_ms``: the hook's own time on DDP's thread (an older
#: file's read 0, and the advisor then counts no hook time per bucket).
#: Version 7 added :class:`TimelineArrivals` lines: when every rank handed its last bucket over,
#: on the steps that gathered it (``spread_every``, ``diagnose=True``; an older file has none,
#: and the advisor then prices no wait for a later rank in a larger world).
TIMELINE_VERSION = 7


@dataclass(frozen=True)
class TimelineRun:
    """The run: who wrote the timeline and the settings a prediction starts from.

    ``rank`` is the writer's rank in the hook's group (its rank 0 writes); ``concurrent_buckets``
    the communication lanes; ``bucket_cap_bytes`` and ``first_bucket_bytes`` DDP's bucket caps;
    ``param_bytes`` / ``param_dtypes`` every parameter's gradient, in registration order, and
    ``param_sparse`` whether DDP expects it sparse (``nn.Embedding(sparse=True)``: a bucket of
    its own, which another bucket cap does not repack; ``None``: not recorded, before version 4);
    ``cpu_count``, ``torch_threads`` and ``local_world_size`` how crowded the host was;
    ``nodes`` the node of each rank of the group (as its ranks said: ``GROUP_RANK``; ``None``
    when unknown) and ``ring`` the order the run's ring visited the ranks (``None``: not a ring),
    for the advisor's note on what the rank order costs. ``options`` are the algorithm's
    resolved options (its wire dtype among them) as ``(name, value)`` pairs, ``probe`` the network
    probe's timings when the hook was registered (:mod:`~ddp_ring_hooks.runtime.network_probe`)
    and ``probe_algorithm`` what it ran (``None``: no probe).
    """

    world_size: int
    rank: int
    algorithm: str
    concurrent_buckets: int
    bucket_cap_bytes: int
    first_bucket_bytes: int
    param_bytes: tuple[int, ...]
    param_dtypes: tuple[str, ...]
    device: str
    cpu_count: int
    torch_threads: int
    local_world_size: int
    version: int = TIMELINE_VERSION
    nodes: tuple[int, ...] | None = None
    ring: tuple[int, ...] | None = None
    options: tuple[tuple[str, object], ...] | None = None
    probe: tuple[ProbeSample, ...] | None = None
    probe_algorithm: str | None = None
    param_sparse: tuple[bool, ...] | None = None

    def to_json(self) -> str:
        return _dumps("run", dataclasses.asdict(self))

    @classmethod
    def from_json(cls, line: str | Mapping) -> TimelineRun:
        data = _loads(line, "run")
        version = data.setdefault("version", 1)
        if not isinstance(version, int) or version > TIMELINE_VERSION:
            raise ValueError(
                f"this timeline was written in format version {version!r}; this ddp_ring_hooks reads up to "
                f"version {TIMELINE_VERSION}: upgrade ddp_ring_hooks to read it"
            )
        data["param_bytes"], data["param_dtypes"] = tuple(data["param_bytes"]), tuple(data["param_dtypes"])
        for name in ("nodes", "ring", "param_sparse"):
            if data.get(name) is not None:
                data[name] = tuple(data[name])
        if data.get("options") is not None:
            data["options"] = tuple((name, tuple(value) if isinstance(value, list) else value)
                                    for name, value in data["options"])
        if data.get("probe") is not None:
            data["probe"] = tuple(
                _build(ProbeSample, {**sample, "seconds": tuple(sample["seconds"]),
                                     "options": tuple(tuple(pair) for pair in sample.get("options", ()))})
                for sample in data["probe"]
            )
        return _build(cls, data)


@dataclass(frozen=True)
class TimelineBucket:
    """One bucket of a step: its bytes, when it was handed over (``ready_ms``), when its
    communication started and ended, and the CPU time its worker thread spent on it.

    ``kind`` is how it was reduced (``runtime/wire.py``'s table: ``dense``, ``sparse``
    gathered, ``densified``, ``foreign``), and ``nbytes`` counts its bytes as that kind does. A
    sparse bucket (gathered or densified) also carries ``nnz`` (its stored rows, coalesced),
    ``sparse_bytes`` (their indices and values: what this rank puts in the gather) and
    ``dense_bytes`` (the table as a dense tensor: what densifying reduces), so the advisor
    prices it both ways; ``None`` for any other bucket.
    """

    index: int
    nbytes: int
    ready_ms: float
    start_ms: float
    end_ms: float
    cpu_ms: float
    kind: str = "dense"
    #: the hook's own time on DDP's thread, from its call to its return (the autograd thread:
    #: backward waits for it, once per bucket); 0 in a file from before version 6
    call_ms: float = 0.0
    nnz: int | None = None
    sparse_bytes: int | None = None
    dense_bytes: int | None = None

    @property
    def comm_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(frozen=True)
class TimelineStep:
    """One optimizer step (``step`` is the hook's step number: ``HookState.iteration`` after it).

    ``micro_batches`` forward passes, the last one synchronizing; ``nosync_micro_ms`` the
    ``no_sync`` ones and ``nosync_other_cpu_ms`` the other threads' CPU time during each;
    ``forward_ms`` / ``backward_ms`` of the synchronizing micro-batch (backward until the last
    bucket was handed over); ``exposed_ms`` after it until the last bucket was reduced;
    ``optimizer_ms`` in ``optimizer.step()`` after that; ``tail_ms`` from the last bucket's end
    to the next step; ``sync_other_cpu_ms`` the other threads' CPU time during the
    synchronizing micro-batch.
    """

    step: int
    micro_batches: int
    step_ms: float
    nosync_micro_ms: tuple[float, ...]
    nosync_other_cpu_ms: tuple[float, ...]
    forward_ms: float
    backward_ms: float
    exposed_ms: float
    optimizer_ms: float
    tail_ms: float
    sync_other_cpu_ms: float
    buckets: tuple[TimelineBucket, ...]

    def to_json(self) -> str:
        return _dumps("step", dataclasses.asdict(self))

    @classmethod
    def from_json(cls, line: str | Mapping) -> TimelineStep:
        data = _loads(line, "step")
        data["nosync_micro_ms"] = tuple(data["nosync_micro_ms"])
        data["nosync_other_cpu_ms"] = tuple(data["nosync_other_cpu_ms"])
        data["buckets"] = tuple(_build(TimelineBucket, dict(bucket)) for bucket in data["buckets"])
        return _build(cls, data)


@dataclass(frozen=True)
class TimelineArrivals:
    """When every rank of the group handed its last bucket over in one step (its *arrival*,
    :class:`~.records.RankArrivals`): ``last_ms[r]`` is rank ``r``'s, in milliseconds after rank
    0's, on rank 0's clock. Written on the steps that gather them (``spread_every``,
    ``diagnose=True``). No all-reduce ends before its last contributor, so how far the ranks'
    arrivals scatter is what a larger world waits for: the latest of more ranks
    (:func:`~ddp_ring_hooks.advisor.profile.arrival_lateness`)."""

    step: int
    last_ms: tuple[float, ...]

    def to_json(self) -> str:
        return _dumps("arrivals", dataclasses.asdict(self))

    @classmethod
    def from_json(cls, line: str | Mapping) -> TimelineArrivals:
        data = _loads(line, "arrivals")
        data["last_ms"] = tuple(data["last_ms"])
        return _build(cls, data)


TimelineRecord = TimelineRun | TimelineStep | TimelineArrivals
_RECORD_TYPES = {"run": TimelineRun, "step": TimelineStep, "arrivals": TimelineArrivals}


def record_from_json(line: str | Mapping) -> TimelineRecord:
    """A run, step or arrivals record from one line of ``timeline.jsonl`` (by its ``type``)."""
    data = json.loads(line) if isinstance(line, str) else line
    kind = data.get("type") if isinstance(data, Mapping) else None
    if kind not in _RECORD_TYPES:
        raise ValueError(f"not a timeline record (its type is {kind!r}, not one of {', '.join(map(repr, _RECORD_TYPES))})")
    return _RECORD_TYPES[kind].from_json(data)


def _dumps(kind: str, fields: dict) -> str:
    return json.dumps({"type": kind, **fields}, separators=(",", ":"))


def _loads(line: str | Mapping, kind: str) -> dict:
    data = dict(json.loads(line) if isinstance(line, str) else line)
    if data.pop("type", kind) != kind:
        raise ValueError(f"not a timeline {kind} record: {str(line)[:80]}")
    return data


def _build(cls, data: dict):
    fields = dataclasses.fields(cls)
    missing = [f.name for f in fields if f.name not in data and f.default is dataclasses.MISSING]
    unknown = sorted(set(data) - {f.name for f in fields})
    if missing or unknown:
        problem = "; ".join(filter(None, [missing and f"lacks {', '.join(missing)}",
                                          unknown and f"has unknown {', '.join(unknown)}"]))
        raise ValueError(
            f"a timeline {cls.__name__} record {problem}: the file was written by a ddp_ring_hooks "
            "this version cannot read; record the run again with this version"
        )
    return cls(**data)
