"""The advice: the run, what-if tables for each knob, and the one change to make.

:func:`advise` returns plain data (the ``--json`` shape, stable)::

    {"run": {"world_size", "algorithm", "accumulate", "bucket_cap_mb", "steps", "step_ms",
             "compute_ms", "comm_ms", "exposed_ms"},
     "rank_order": {"crossings", "fewest", "busiest", "speedup", "calibrated", "line"} or None,   # what the order costs
     "what_if": [{"knob", "value", "step_ms", "comm_ms", "exposed_ms", "speedup", "this_run",
                  "speedup_range", "uncertain", ("verdict": wire_dtype rows)}, ...],
     "recommendation": {"knob", "value", "speedup", "why"},
     "sparse": [{"bucket", "nnz", "sparse_bytes", "dense_bytes", "this_run", "measured_ms",
                 "gather_ms", "densify_ms", "verdict", "densify_over_gather", "close", "priced_on", "line"}, ...],
     "model": {...}}       # how the numbers were made: network, contention, notes

Fields added since the shape was first published (issue 31): ``speedup_range``, the row's
speedup on the fastest and slowest network its source allows (``None`` when the source gives
no error bar); ``uncertain``, the error bar is wider than the gain or reaches past no change (or
a narrower wire's casts were never measured), so the row is no advice; on the ``wire_dtype`` rows ``verdict``, "pays"
or "does not pay" (``None`` for the run's own wire). Issue 33: ``sparse``, for each sparse
gradient bucket the predicted gather and densify times and which wins (:mod:`.sparse_verdict`;
empty without one). ``model.own_link``: how a network measured here was fitted to the run
(``scale``, ``shared_ways``, ``pickup_ms``, ``backward_rate``: :class:`~.step_model.OwnLink`;
``None`` for another cluster's network).

``step_ms`` is one optimizer step (all its micro-batches); ``comm_ms`` communication from each
bucket's hand-over (queue included) and ``exposed_ms`` its part after backward, so never more
(the words of the summary and ``comm/step/comm_ms``); ``speedup`` is samples per second
relative to the run; knobs change one at a time from the run's setting; ``this_run`` marks
the row of each knob that is the run's own setting (none for ``bucket_cap_mb`` when the run
used DDP's default cap: an explicit cap of the same size also caps the first bucket). ``run`` holds what
was measured; ``compute_ms`` is the step minus exposed communication (so it includes the
optimizer, the training loop and the contention of hidden communication).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import replace

from ..schedules import WIRE_BYTES, WIRE_DTYPE, algorithm_names, formula_for, get_algorithm, is_narrow
from ..schedules.wire import AS_IS
from .network import Network, from_probe, from_run, gather_equivalent_bytes
from .profile import TimelineRecord, profile_run
from .ring_order import RingOrderNote, ring_order_note
from .sparse_verdict import sparse_verdicts
from .latest_rank import lateness_scale_ms, latest_rank_wait_ms
from .step_model import Setting, StepModel, run_setting, setting_options, slowed_probe_scale
from .step_model import priced as priced_as

BUCKET_CAPS_MB = (1, 5, 10, 25, 50, 100)
ACCUMULATE = (1, 2, 4, 8, 16)
#: The wire dtype's knob in the tables: the registry's option name.
WIRE = WIRE_DTYPE.name
#: The run's own step must be reproduced within this share, or the advice withholds its recommendation.
REPRODUCED = 0.02
#: Predicted gains below this are within the model's error: no recommendation.
MIN_GAIN = 1.03


def step_model(records: Sequence[TimelineRecord], *, network: Network | None = None) -> StepModel:
    """The calibrated step model of the run in timeline ``records``: priced with ``network``
    when given, else with the probe the run recorded when its hook was registered, else with
    its own buckets' fit."""
    profile = profile_run(records)
    options = setting_options(profile, run_setting(profile))
    run_network = from_run(
        algorithm=profile.algorithm, world_size=profile.world_size, samples=fit_samples(profile, options), options=options,
    )
    if network is None and profile.probe:
        network = from_probe(profile.probe, algorithm=profile.probe_algorithm, world_size=profile.world_size,
                             options=setting_options(profile, run_setting(profile)) if profile.probe_algorithm == profile.algorithm else {})
        scale = slowed_probe_scale(profile, network)
        if scale < 1:
            network = network.scaled(scale, (
                f"every cost scaled by {scale:.2f}: it priced the run's largest bucket slower than training ran "
                f"it beside backward, so the probe itself was slowed (step_model.slowed_probe_scale)"))
    return StepModel(profile, run_network, network or run_network)


def fit_samples(profile, options: dict) -> list[tuple[float, float]]:
    """``(bytes, ms)`` of the run's buckets for its network fit: a gathered sparse bucket as the
    dense bucket that puts as many bytes on the links (:func:`~.network.gather_equivalent_bytes`),
    a densified one by its dense table (its ``nbytes``)."""
    return [(gather_equivalent_bytes(b.sparse_bytes, profile.world_size, profile.algorithm, **options)
             if b.sparse and b.kind == "sparse" else b.nbytes, b.service_ms or b.comm_ms) for b in profile.buckets]


def ring_order_of_run(model: StepModel) -> RingOrderNote | None:
    """What the run's rank order cost (a ring run whose ranks' nodes are known), priced with the
    run's own fit at its largest bucket (:mod:`.ring_order`)."""
    p = model.profile
    if p.ring is None or not p.buckets:  # the run's algorithm has no ring order (its record declares none)
        return None
    return ring_order_note(order=p.ring, nodes=p.nodes, calibration=model.run_network.calibration(p.algorithm),
                           nbytes=max(b.nbytes for b in p.buckets))


def own_link_note(model: StepModel) -> list[str]:
    """How the network measured here was fitted to the run (:attr:`~.step_model.StepModel.own_link`),
    when it was (not for another cluster's network, taken as given)."""
    own = model.own_link
    if own is None:
        return []
    slowed = (f"; its exchanges beside backward at {own.backward_rate:.0%} of the link's rate (what this run's "
              "exposed time held beyond the link's price)" if own.backward_rate < 1 else "")
    return [f"this run's link: bytes priced {own.scale:.2f}x the network's fit, each bucket started "
            f"{own.pickup_ms:.1f} ms after its hand-over{slowed}"]


def priced_as_note(algorithm: str, network: Network) -> str:
    """What the advice says of an algorithm without a formula of its own (``native``: the
    group's own all_reduce): costed with the one it is priced as, unless bench records fitted it."""
    if algorithm in network.calibrations:
        return f"{algorithm}: fitted to its bench records"
    record = get_algorithm(algorithm)
    return f"{algorithm}: {record.summary}, costed with the {formula_for(algorithm)} formula on this network (not measured)"


#: A given network that prices the run's own buckets this many times faster or slower than
#: they ran describes another network: the advice says so.
FOREIGN = 2.0


def foreign_network_note(model: StepModel) -> list[str]:
    """A note when the network given prices this run's own buckets far from what they took:
    then the rows predict that network, not this one (the run's own row is still what it measured)."""
    if model.network.here:
        return []
    p, setting = model.profile, run_setting(model.profile)
    options = setting_options(p, setting)
    measured = sum(b.service_ms or b.comm_ms for b in p.buckets)
    priced = sum(model.network.cost_ms(p.algorithm, priced_as(b), p.world_size, **options) for b in p.buckets)
    if measured <= 0 or priced <= 0 or 1 / FOREIGN <= priced / measured <= FOREIGN:
        return []
    return [f"the network given ({model.network.source}) prices this run's buckets at {priced:.1f} ms where they "
            f"took {measured:.1f} ms: it describes another network, and every row predicts that network, not this one"]


#: World sizes every table shows (where a user's next machine count usually is), beside the run's own.
WORLD_SIZES = (3, 4, 6, 8, 64, 512)


def world_sizes(p: int) -> list[int]:
    """The world sizes the table shows: the run's, twice it, 3, 4, 6, 8, 64 and 512."""
    return sorted({p, 2 * p, *WORLD_SIZES})


def other_world_size_note(model: StepModel) -> list[str]:
    """A note when the network given was measured at another world size than the run's: its α
    and β are carried over per link, and the rows at the run's own size are priced from them."""
    measured_at, p = model.network.measured_at, model.profile.world_size
    if measured_at is None or measured_at == p:
        return []
    return [f"the network given was measured at {measured_at} ranks and this run at {p}: its per-link α and β "
            f"are carried over to {p} ranks (a bench at {measured_at} ranks times its own algorithms' steps there); "
            f"for prices at {p} ranks, bench on {p} ranks (`torchrun --nproc_per_node={p} -m ddp_ring_hooks bench "
            f"--json FILE`)"]


def latest_rank(model: StepModel) -> dict | None:
    """What waiting for the latest rank adds at each world size the table shows, over the run's
    own (:mod:`.latest_rank`), from the run's arrivals; ``None`` when it gathered too few."""
    lateness, p = model.profile.arrival_lateness, model.profile.world_size
    if lateness is None:
        return None
    return {"samples": len(lateness), "latest_seen_ms": max(lateness), "scale_ms": lateness_scale_ms(lateness),
            "waits": [{"world_size": size, "wait_ms": latest_rank_wait_ms(lateness, size, p)} for size in world_sizes(p)]}


def latest_rank_note(model: StepModel) -> str:
    """The world-size rows' wait for the latest rank: what it adds, or that it is not priced."""
    found = latest_rank(model)
    if found is None:
        return ("world_size: the wait for the latest of more ranks is not priced (this run gathered no arrivals: "
                "register with diagnose=True or spread_every to price it)")
    p = model.profile.world_size
    adds = ", ".join(f"{w['wait_ms']:+.1f} ms at {w['world_size']}" for w in found["waits"] if w["world_size"] != p)
    return (f"world_size: the wait for the latest rank, from {found['samples'] // p} steps' arrivals of this run's {p} ranks "
            f"(up to {found['latest_seen_ms']:.1f} ms late; read as normal lateness of sigma {found['scale_ms']:.1f} ms, "
            f"from their median): {adds}")


def what_if(model: StepModel) -> list[dict]:
    """One row per (knob, value), changing one knob from the run's setting; the run's own
    bucket cap and k are among the values."""
    here = run_setting(model.profile)
    caps = sorted({*BUCKET_CAPS_MB, *([_plain_number(here.bucket_cap_mb)] if here.bucket_cap_mb is not None else [])})
    variants: list[tuple[str, object, Setting]] = []
    variants += [("bucket_cap_mb", v, replace(here, bucket_cap_mb=float(v))) for v in caps]
    variants += [("accumulate", v, replace(here, accumulate=v)) for v in sorted({*ACCUMULATE, here.accumulate})]
    # Another algorithm takes its own options' defaults (and the run's LOCAL_WORLD_SIZE), not the run's.
    variants += [("algorithm", a, replace(here, algorithm=a, algorithm_options=())) for a in algorithm_names()]
    variants += [("world_size", p, replace(here, world_size=p)) for p in world_sizes(here.world_size)]
    variants += [(WIRE, w, replace(here, wire=w)) for w in WIRE_BYTES]
    # The same row on the fastest and the slowest network the probe allows, each scaled to the
    # run's fastest and slowest step on its link.
    bounds = ([replace(model.with_network(n), link_busy=busy) for n, busy in zip(model.network.bounds, ("fastest", "slowest"))]
              if model.network.bounds else [])
    rows = []
    for knob, value, setting in variants:
        try:
            prediction = model.predict(setting)
        except ValueError:  # options that do not fit, e.g. a node size that does not divide p
            continue
        speedup = model.speedup(setting)
        row = {
            "knob": knob, "value": value, "step_ms": prediction.step_ms, "comm_ms": prediction.comm_ms,
            "exposed_ms": prediction.exposed_ms, "speedup": speedup,
            "this_run": _is_run(model, knob, value),
            "speedup_range": None, "uncertain": False,
        }
        if bounds:  # the same row on the fastest and the slowest network the probe allows
            ends = sorted(b.speedup(setting) for b in bounds)
            row["speedup_range"] = [min(ends[0], speedup), max(ends[-1], speedup)]
            row["uncertain"] = not row["this_run"] and could_go_either_way(row["speedup_range"], speedup)
        if knob == WIRE:
            if not row["this_run"] and _casts_unmeasured(model, setting):
                row["uncertain"] = True  # a narrower wire's casts are priced free without a probe of them
            row["verdict"] = None if row["this_run"] else ("pays" if speedup >= MIN_GAIN else "does not pay")
        rows.append(row)
    return rows


def could_go_either_way(speedup_range: Sequence[float], speedup: float) -> bool:
    """Whether the row could go either way: its error bar (half the range the measurements
    allow) is wider than the gain (or loss) itself, or the range reaches past no change (a
    gain that the slowest network allows turns into a loss, or a loss into a gain). A lopsided
    range needs the second test: bf16 on loopback read 1.07x on a range of 0.98-1.07x, a
    half-width of 0.05 under its gain, and measured no gain (``docs/advisor.md``, the ninth series)."""
    low, high = speedup_range
    return (high - low) / 2 > abs(speedup - 1) or (low < 1 < high and speedup != 1)


def _casts_unmeasured(model: StepModel, setting: Setting) -> bool:
    """Whether ``setting`` narrows the wire but the network knows no cast cost: γ = 0 and no probe
    timed a second wire (a probe that did may find γ = 0: casts hidden in the transfers)."""
    network = model.network
    return (is_narrow(setting_options(model.profile, setting)) and network.bounds is None
            and network.calibration(setting.algorithm).gamma == 0)


def _plain_number(value: float) -> int | float:
    """2.0 -> 2 (as the table's other caps read); 0.5 stays 0.5."""
    return int(value) if float(value).is_integer() else value


#: Accumulation is recommended at its knee: the smallest k with this share of the largest gain.
KNEE = 0.8


def recommend(model: StepModel, rows: Sequence[dict]) -> dict:
    """The best single change among bucket size, accumulation and algorithm, with why.

    - Accumulation's gain grows with k and flattens; the advice names the knee, the smallest
      k that gets :data:`KNEE` of the largest gain in the table, since every k grows the
      effective batch (which changes the optimization).
    - A change that leaves the optimization alone (bucket size, algorithm) is preferred when it
      gets at least half of the accumulation's gain.
    - World size is not a recommendation (it buys hardware, not efficiency); its rows are there
      to read. Gains under :data:`MIN_GAIN` are within the model's error: then say so.
    """
    p = model.profile
    exposed_share = p.exposed_ms / p.step_ms
    contention_share = p.contention_ms / p.step_ms
    # A row whose error bar is wider than its gain is no advice (it says so in the table).
    candidates = [r for r in rows if r["knob"] != "world_size" and not r["this_run"] and not r.get("uncertain")]
    free = max((r for r in candidates if r["knob"] != "accumulate"), key=lambda r: r["speedup"], default=None)
    more = [r for r in candidates if r["knob"] == "accumulate" and r["value"] > p.accumulate]
    top = max(more, key=lambda r: r["speedup"], default=None)
    knee = None
    if top is not None and top["speedup"] > 1:
        knee = min((r for r in more if r["speedup"] - 1 >= KNEE * (top["speedup"] - 1)), key=lambda r: r["value"])
    if free is not None and (knee is None or free["speedup"] - 1 >= 0.5 * (knee["speedup"] - 1)):
        best = free
    else:
        best = knee
    if best is None or best["speedup"] < MIN_GAIN:
        return {"knob": None, "value": None, "speedup": 1.0, "why": (
            f"nothing is predicted to gain {MIN_GAIN - 1:.0%} or more: exposed communication is "
            f"{exposed_share:.0%} of the step and contention from hidden communication {contention_share:.0%}")}
    knob, value = best["knob"], best["value"]
    if knob == "accumulate":
        k = value / p.accumulate
        why = (f"exposed communication is {exposed_share:.0%} of the step and hidden communication costs "
               f"another {contention_share:.0%} in CPU contention; {value} accumulation steps pay both once per "
               f"{value} micro-batches, {1 - 1 / k:.0%} less per sample (k={top['value']} would give "
               f"{top['speedup']:.2f}x; the effective batch grows {k:g}x)")
    elif knob == "bucket_cap_mb":
        why = (f"exposed communication is {exposed_share:.0%} of the step ({p.exposed_ms:.1f} ms); "
               f"{value} MB buckets are predicted to leave {best['exposed_ms']:.1f} ms exposed "
               f"({len(p.buckets)} buckets now)")
    elif knob == WIRE:
        why = (f"exposed communication is {exposed_share:.0%} of the step; {value} on the wire halves the bytes for "
               f"two casts per byte, predicted to leave {best['exposed_ms']:.1f} ms exposed (the gradients are "
               f"rounded to {value} on the way: error_feedback=True puts what rounding lost back)")
    else:
        here = next((r for r in rows if r["knob"] == "algorithm" and r["value"] == p.algorithm), None)
        now = f"{here['comm_ms']:.1f} ms with {p.algorithm}" if here else f"{p.comm_ms:.1f} ms now"
        why = f"{value} is predicted to reduce this run's buckets in {best['comm_ms']:.1f} ms instead of {now}"
    return {"knob": knob, "value": value, "speedup": best["speedup"], "why": why}


def _is_run(model: StepModel, knob: str, value) -> bool:
    """Whether ``knob=value`` is the run's own setting (an explicit bucket cap never is the
    default one: it also caps the first bucket)."""
    p = model.profile
    own = {"accumulate": p.accumulate, "algorithm": p.algorithm, "world_size": p.world_size,
           "bucket_cap_mb": None if p.default_bucket_cap else _plain_number(p.bucket_cap_mb),
           WIRE: p.wire or AS_IS}
    return own[knob] == value


def advise(records: Sequence[TimelineRecord], *, network: Network | None = None) -> dict:
    """The advice (the ``--json`` shape) for timeline ``records``; ``network`` costs the
    predictions on another cluster (default: this run's own buckets)."""
    model = step_model(records, network=network)
    p = model.profile
    rows = what_if(model)
    # The run's own setting, predicted: exact when the calibration holds (it can fail where the
    # model clamps, e.g. an exposed time it cannot make negative). Off by more than 2%, no advice.
    reproduced = model.predict(run_setting(p)).step_ms / p.step_ms - 1
    recommendation = recommend(model, rows)
    if abs(reproduced) > REPRODUCED:
        recommendation = {"knob": None, "value": None, "speedup": 1.0, "why": (
            f"the model reproduces this run's own step only within {reproduced:+.1%} (more than "
            f"{REPRODUCED:.0%}): every row carries that error, so no change is recommended")}
    notes = [
        f"step = k x clean micro-batch ({p.clean_micro_ms:.1f} ms) + rest of the step ({p.step_rest_ms:.1f} ms) "
        f"+ contention + exposed + optimizer ({p.optimizer_ms:.1f} ms), calibrated to reproduce this run's step",
        f"contention of hidden communication: {p.contention_ms:.1f} ms per step, {p.contention_source}",
        "accumulate k: the effective batch grows k-fold (k x micro-batch x world size samples per step)",
        "world_size: the same micro-batch per rank on more ranks (weak scaling); speedup counts all ranks' samples",
        latest_rank_note(model),
        *own_link_note(model),
        *(priced_as_note(a, model.network) for a in algorithm_names() if get_algorithm(a).cost is None),
        *foreign_network_note(model),
        *other_world_size_note(model),
    ]
    ring = ring_order_of_run(model)
    return {
        "rank_order": None if ring is None else ring.as_dict(),
        "run": {
            "world_size": p.world_size, "algorithm": p.algorithm, "accumulate": p.accumulate,
            "bucket_cap_mb": p.bucket_cap_mb, "steps": p.steps, "step_ms": p.step_ms,
            "compute_ms": p.step_ms - p.exposed_ms, "comm_ms": p.comm_ms, "exposed_ms": p.exposed_ms,
        },
        "what_if": rows,
        "recommendation": recommendation,
        "sparse": sparse_verdicts(model),
        "model": {
            "network": model.network.as_dict(),
            "run_network": model.run_network.as_dict(),
            "reproduced_error": reproduced,
            "own_link": None if model.own_link is None else dataclasses.asdict(model.own_link),
            "contention_ms": p.contention_ms,
            "contention_source": p.contention_source,
            "latest_rank": latest_rank(model),
            "clean_micro_ms": p.clean_micro_ms,
            "buckets": [b.nbytes for b in p.buckets],
            "default_bucket_cap": p.default_bucket_cap,
            "notes": notes,
        },
    }


def format_advice(advice: dict) -> str:
    """The advice as a readable table (what ``ddp-ring-hooks advise`` prints)."""
    run, model = advice["run"], advice["model"]
    cap = f"{run['bucket_cap_mb']:g} MB" + (" (DDP's default, 1 MiB first bucket)" if model["default_bucket_cap"] else "")
    lines = [
        f"run: {run['world_size']} ranks, {run['algorithm']}, accumulate {run['accumulate']}, bucket cap {cap}, "
        f"{len(model['buckets'])} buckets, {run['steps']} steps measured",
        f"  step {run['step_ms']:.1f} ms = compute {run['compute_ms']:.1f} ms + exposed communication "
        f"{run['exposed_ms']:.1f} ms; communication {run['comm_ms']:.1f} ms (from the hand-overs, queue included: "
        f"exposed is its part after backward); contention of hidden communication ~{model['contention_ms']:.1f} ms",
        f"  network: {model['network']['source']}",
        "",
    ]
    titles = {"bucket_cap_mb": "bucket_cap_mb", "accumulate": "accumulate (effective batch grows with k)",
              "algorithm": "algorithm", "world_size": "world size (same micro-batch per rank)",
              WIRE: f"{WIRE} (what the buckets travel in)"}
    for knob, title in titles.items():
        rows = [r for r in advice["what_if"] if r["knob"] == knob]
        if not rows:
            continue
        lines.append(f"{title:<44} {'step ms':>9} {'comm ms':>9} {'exposed':>9} {'speedup':>8}")
        for r in rows:
            value = f"{r['value']:g}" if isinstance(r["value"], float) else str(r["value"])
            label = f"{value} (this run)" if r.get("this_run") else value
            spread = r.get("speedup_range")
            extra = f"  {spread[0]:.2f}-{spread[1]:.2f}x" if spread else ""
            if r.get("verdict"):
                extra += f"  {r['verdict']}"
            if r.get("uncertain"):
                extra += "  (uncertain: " + ("its error bar is wider than its gain or reaches past no change)" if spread else
                                             "the casts were not measured: no probe of a second wire)")
            lines.append(f"  {label:<42} {r['step_ms']:>9.1f} {r['comm_ms']:>9.1f} "
                         f"{r['exposed_ms']:>9.1f} {r['speedup']:>7.2f}x{extra}")
        same_size = [r for r in rows if knob == "bucket_cap_mb" and model["default_bucket_cap"]
                     and r["value"] == run["bucket_cap_mb"]]
        if same_size:
            size = f"{run['bucket_cap_mb']:g}"
            lines.append(f"  ({size} is bucket_cap_mb={size} given explicitly, not this run: an explicit cap also "
                         f"makes the first bucket {size} MB, where DDP's default starts with a 1 MiB one)")
        lines.append("")
    if advice.get("rank_order"):
        lines.append(f"ring order: {advice['rank_order']['line']}")
    lines += [f"sparse: gather vs densify: {entry['line']}" for entry in advice.get("sparse", ())]
    rec = advice["recommendation"]
    if rec["knob"] is None:
        lines.append(f"recommendation: keep the setting; {rec['why']}")
    else:
        lines.append(f"recommendation: {rec['knob']}={rec['value']} ({rec['speedup']:.2f}x samples/s): {rec['why']}")
    lines += [f"  note: {note}" for note in model["notes"]]
    return "\n".join(lines)
