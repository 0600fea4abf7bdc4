"""One optimizer step of DDP, predicted for another setting (pure arithmetic on a RunProfile).

::

    step = k · clean micro-batch  +  the step's rest  +  the hook's calls  +  contention  +  exposed  +  optimizer

1. **Buckets.** The run's own buckets when the setting keeps its bucket limits; otherwise
   DDP's rules (:mod:`.bucketing`) repack the parameters, and each new bucket is ready when
   the gradient-ready curve (:mod:`.ready_curve`) reaches its last byte.
2. **Costs.** Each bucket's all-reduce from the :class:`~.network.Network`
   (:func:`~.network.bucket_cost`: α on its lane, bytes on the link; per algorithm, world size
   and wire dtype). A sparse bucket is priced as it travelled (:class:`~.network.SparseBucket`):
   gathered, whatever the algorithm, with a wire that grows with the world size; or densified
   through the setting's algorithm. DDP gives it a bucket of its own, so another bucket cap
   repacks only the dense parameters around it.
3. **Replay.** The buckets queue through the lanes and the link, each of its two ways (out,
   in) its own resource (:mod:`.replay`): communication from each hand-over, the part hidden
   behind backward, and the exposed part after it.
4. **The hook's calls.** DDP calls the hook on backward's own thread: each bucket handed over
   before the last holds backward for the hook's time (the run's median per bucket,
   ``RunProfile.call_ms``), so a setting of ``N`` buckets pays ``N - 1`` calls, once per step.
5. **Contention.** On CPU, hidden communication still costs backward time: the communication
   threads run on the same cores. The run measured it (:mod:`.profile`); it is taken to grow
   with the communication thread's CPU time while backward runs (:class:`CommCpu`, fitted to
   the run's buckets: a part per bucket and a part per byte, the bytes ``bytes_factor`` times
   the run's; for each bucket the share of its transfer that overlaps backward). Backward
   stretches by it, which moves the hand-over times: a few rounds of lanes settle it.
6. **Calibrated on the run.** The model of the run's own setting is compared with what the
   run measured; the differences (the exposed time the α-β queue does not explain: hook
   start-up, waiting for the slower rank; the communication time likewise; the contention
   the bytes behind backward do not explain) are added to every prediction, so the run's own
   setting is predicted exactly and the others move by what the model says changes. Before
   that, a network measured here is fitted to the run's own link (:class:`OwnLink`): on
   several hosts its β scaled to the link time the run measured, on one host the link's two
   ways one resource.
7. **The latest rank.** Every step waits for the latest of its ranks to hand its last bucket
   over; a larger world's latest is later. From the run's arrivals (the steps that gathered
   them), a row of another world size waits the difference (:mod:`.latest_rank`), in its
   exposed time.

Samples per step grow as ``k · p``: the effective batch grows with accumulation ``k``
(that changes the optimization) and with the world size ``p``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from ..schedules import algorithm_names, resolve_options, with_wire
from .bucketing import bucket_limits, rebuilt_bucket_bytes
from .network import DENSIFY, GATHER, Network, SparseBucket, bucket_cost, bytes_factor
from .profile import BucketProfile, RunProfile, calls_ms
from .latest_rank import latest_rank_wait_ms
from .ready_curve import ReadyCurve
from .link_directions import link_directions, ways_held
from .replay import BucketCost, replay


@dataclass(frozen=True)
class Setting:
    """What the user can change. ``bucket_cap_mb=None``: DDP's default (25 MiB, small first bucket);
    ``algorithm_options``: the algorithm's own, as ``(name, value)`` pairs; the others take the
    run's environment (``LOCAL_WORLD_SIZE``) or their defaults (see :func:`setting_options`)."""

    bucket_cap_mb: float | None
    accumulate: int
    algorithm: str
    world_size: int
    algorithm_options: tuple[tuple[str, object], ...] = ()
    #: the wire dtype its buckets travel in (``None``: as the algorithm's options say, fp32 by default)
    wire: str | None = None


@dataclass(frozen=True)
class Prediction:
    """One optimizer step in a setting (ms) and its samples relative to the run's."""

    step_ms: float
    comm_ms: float
    exposed_ms: float
    contention_ms: float
    buckets: int
    samples_per_step: int  # accumulate · world size (micro-batches of all ranks)


def run_setting(profile: RunProfile) -> Setting:
    """The setting the run itself used."""
    return Setting(
        bucket_cap_mb=None if profile.default_bucket_cap else profile.bucket_cap_mb,
        accumulate=profile.accumulate, algorithm=profile.algorithm, world_size=profile.world_size,
        wire=profile.wire,
    )


@dataclass(frozen=True)
class _Raw:
    step_ms: float
    comm_ms: float
    exposed_ms: float
    contention_ms: float
    buckets: int


def priced(bucket: BucketProfile) -> float | SparseBucket:
    """What :func:`~.network.bucket_cost` prices a run's bucket as: its bytes, or a sparse one
    as it travelled (gathered, or densified)."""
    if not bucket.sparse:
        return float(bucket.nbytes)
    return SparseBucket(bucket.sparse_bytes, bucket.dense_bytes, DENSIFY if bucket.kind == "densified" else GATHER)


def _nbytes(size: float | SparseBucket) -> float:
    return size.nbytes if isinstance(size, SparseBucket) else size


def _layout(profile: RunProfile, setting: Setting) -> tuple[list[float | SparseBucket], list[float]]:
    """Buckets (their bytes, a sparse one as a :class:`~.network.SparseBucket`) and clean ready
    times (ms into a backward without contention and without the hook's calls: bucket ``i`` was
    handed over after ``i`` of them)."""
    computing = profile.backward_ms - profile.calls_ms  # backward's own gradients, contention included
    stretch = 1.0 - profile.contention_ms / computing if computing > 0 else 1.0
    ready, latest = [], 0.0
    for i, b in enumerate(profile.buckets):  # never earlier than the one before (medians may say so)
        latest = max(latest, (b.ready_ms - i * profile.call_ms) * stretch)
        ready.append(latest)
    sizes = [priced(b) for b in profile.buckets]
    run_limits = (profile.first_bucket_bytes, profile.bucket_cap_bytes) if profile.default_bucket_cap else (profile.bucket_cap_bytes,)
    limits = bucket_limits(bucket_cap_mb=setting.bucket_cap_mb)
    if limits == run_limits:
        return sizes, ready
    # A sparse parameter keeps its own bucket whatever the cap: only the dense ones are repacked.
    params, dtypes = dense_parameters(profile, [s for s in sizes if isinstance(s, SparseBucket)])
    dense = [(r, n) for r, n in zip(ready, sizes) if not isinstance(n, SparseBucket)]
    kept = [(r, n) for r, n in zip(ready, sizes) if isinstance(n, SparseBucket)]
    new_sizes = rebuilt_bucket_bytes(params, limits, dtypes=tuple(dtypes)) if params else []
    curve = ReadyCurve.from_buckets([r for r, _ in dense], [n for _, n in dense]) if dense else None
    new_ready = curve.ready_times(new_sizes) if curve is not None else [0.0] * len(new_sizes)
    merged = sorted([*zip(new_ready, (float(n) for n in new_sizes)), *kept], key=lambda pair: pair[0])
    return [n for _, n in merged], [r for r, _ in merged]


def dense_parameters(profile: RunProfile, sparse: list[SparseBucket]) -> tuple[list[int], list[str]]:
    """The bytes and dtypes of the parameters DDP packs into buckets by the cap (registration
    order): every parameter the run recorded as dense (``param_sparse``, timeline version 4). An
    older timeline did not record it: each ``sparse`` bucket's parameter is then taken to be the
    latest whose size is its dense size (two parameters of that size can be confused)."""
    params, dtypes = list(profile.param_bytes), list(profile.param_dtypes)
    if profile.param_sparse is not None:
        kept = [i for i, is_sparse in enumerate(profile.param_sparse) if not is_sparse]
        return [params[i] for i in kept], [dtypes[i] for i in kept]
    for size in sparse:
        if size.dense_bytes in params:
            where = len(params) - 1 - params[::-1].index(size.dense_bytes)  # the latest: ready first
            del params[where], dtypes[where]
    return params, dtypes


@dataclass(frozen=True)
class CommCpu:
    """The communication thread's CPU time for one bucket (ms), fitted to the run's buckets
    (:attr:`~.profile.BucketProfile.cpu_ms`): a part per bucket (the job's own work: its
    schedule, its Futures, the interpreter lock) and a part per byte moved (copies, sums)."""

    per_bucket_ms: float
    per_byte_ms: float

    def of(self, nbytes: float) -> float:
        return self.per_bucket_ms + self.per_byte_ms * nbytes


def comm_cpu(profile: RunProfile) -> CommCpu:
    """:class:`CommCpu` by least squares over the run's buckets, both parts at least 0; with
    one bucket size, all of it per byte; where the run timed no CPU (every bucket's 0), the
    bytes alone (1 ms a byte: only the shape matters, the run calibrates the size)."""
    points = [(float(_nbytes(priced(b))), b.cpu_ms) for b in profile.buckets]
    if not any(cpu > 0 for _, cpu in points):
        return CommCpu(0.0, 1.0)
    n = len(points)
    mean_x = sum(x for x, _ in points) / n if n else 0.0
    mean_y = sum(y for _, y in points) / n if n else 0.0
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread > 0:
        slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread)
        intercept = mean_y - slope * mean_x
        if intercept >= 0:
            return CommCpu(intercept, slope)
    return CommCpu(0.0, mean_y / mean_x if mean_x > 0 else 0.0)


def _hidden_cpu(sizes, starts, ends, backward_ms: float, cpu: CommCpu, scale: float) -> float:
    """The communication thread's CPU behind backward: each bucket's (its bytes ``scale`` times:
    the setting's bytes moved over the run's), weighted by the share of its transfer that
    overlaps backward."""
    total = 0.0
    for n, start, end in zip(sizes, starts, ends):
        if end <= start:
            continue
        total += cpu.of(_nbytes(n) * scale) * min(1.0, max(0.0, (min(end, backward_ms) - start) / (end - start)))
    return total


def setting_options(profile: RunProfile, setting: Setting) -> dict:
    """The options ``setting``'s algorithm runs with: its own, the rest resolved by the registry
    as they were in the run (its ``LOCAL_WORLD_SIZE``), else their defaults."""
    if setting.algorithm not in algorithm_names():  # "auto": priced as the ring, no options but its wire
        options = {}
    else:
        options = resolve_options(setting.algorithm, dict(setting.algorithm_options), environment=profile.environment)
    return options if setting.wire is None else with_wire(options, setting.wire)


@dataclass(frozen=True)
class OwnLink:
    """What the run measured of its own link, beyond the α-β network that prices it (used only
    where that network was measured here: its probe, its buckets).

    ``scale``: every bucket's link time is priced ``scale`` times (:func:`link_scale`: the
    difference of the probe's two large blocks over its price, else the run's link time over
    the network's price of it), so an error of the network's β (the probe's small sizes on slow or throttled cores)
    moves each row with its bytes, where the calibration's offset would add the same
    milliseconds to a row of half the bytes.
    ``shared_ways``: ranks on one host (loopback) send and receive through the same cores, so
    the link's two ways are one resource (:func:`~.replay.replay`); ``None``: full duplex.
    ``pickup_ms``: each bucket starts that long after its hand-over (the run's
    :attr:`~.profile.RunProfile.pickup_ms`). ``backward_rate``: the share of its price at which
    an exchange (a both-ways part) progresses while backward runs (:func:`backward_rate`)."""

    scale: float = 1.0
    shared_ways: float | None = None
    pickup_ms: float = 0.0
    backward_rate: float = 1.0


FULL_DUPLEX = OwnLink()


def _model(profile: RunProfile, network: Network, setting: Setting, contention_per_cpu_ms: float,
           own: OwnLink = FULL_DUPLEX) -> _Raw:
    sizes, ready = _layout(profile, setting)
    options = setting_options(profile, setting)
    costs = [_scaled(bucket_cost(network, setting.algorithm, n, setting.world_size, **options), own.scale) for n in sizes]
    run = run_setting(profile)
    run_factor = bytes_factor(run.algorithm, run.world_size, **setting_options(profile, run))
    scale = bytes_factor(setting.algorithm, setting.world_size, **options) / run_factor if run_factor > 0 else 1.0
    cpu = comm_cpu(profile)
    clean_backward = profile.backward_ms - profile.contention_ms - profile.calls_ms
    calls = calls_ms(profile.call_ms, len(sizes))  # the setting's hook calls, on backward's thread

    def replayed(contention: float):
        """The queue once contention stretches backward's gradients (which moves the
        hand-overs), each bucket handed over after the hook's calls for the ones before it."""
        scale = (clean_backward + contention) / clean_backward if clean_backward > 0 else 1.0
        handed = [r * scale + i * profile.call_ms for i, r in enumerate(ready)]
        backward = clean_backward + contention + calls
        return replay(handed, costs, lanes=profile.lanes, backward_ms=backward, shared_ways=own.shared_ways,
                      pickup_ms=own.pickup_ms, backward_rate=own.backward_rate), backward

    contention = profile.contention_ms
    for _ in range(3):  # a few rounds settle it
        lanes, backward = replayed(contention)
        contention = contention_per_cpu_ms * _hidden_cpu(sizes, lanes.starts, lanes.ends, backward, cpu, scale)
    lanes, _ = replayed(contention)
    step = (setting.accumulate * profile.clean_micro_ms + profile.step_rest_ms + contention + lanes.exposed_ms
            + profile.optimizer_ms + calls - profile.calls_ms)
    return _Raw(step, lanes.comm_ms, lanes.exposed_ms, contention, len(sizes))


def _scaled(cost: BucketCost, link_scale: float) -> BucketCost:
    return cost if link_scale == 1.0 else replace(cost, link_ms=cost.link_ms * link_scale)


#: Which of the run's measured link times (:attr:`~.profile.RunProfile.link_busy_ms`) a model
#: scales its network to: its median step's, or, for the error bar, its fastest or slowest step's.
LINK_BUSY = ("fastest", "median", "slowest")


def link_scale(profile: RunProfile, network: Network, busy: str = "median") -> float:
    """What the link's price is scaled by on several hosts: the link's own rate for a bucket alone.

    With a probe (``network.large_blocks``): the difference of its two largest blocks over the
    difference of their priced link parts: the bytes alone. The fit's β leans on the small
    blocks' α, which on the lab's hosts of a fifth of a core holds a waiting core's milliseconds
    (a 16 KiB block took 10-30 ms beside a 2 MiB block of 43 ms) that a long transfer hides: α
    and β fitted to those read the 50 MB/s links at 67 MB/s, and bf16 then saved too little
    (+18% in a lab run). Two large blocks carry the same hidden waits and the same shaper's
    burst, so their difference holds neither (``docs/advisor.md``, the tenth series). Without
    them: the run's own link time over ``network``'s price of it, the link's busy time in the
    run (the sum of the buckets' own times on it, :attr:`~.profile.BucketProfile.service_ms`:
    the same whatever share of it each bucket got) less the buckets' priced fixed parts, over
    their priced link parts; that time also holds the exchanges slowed beside backward, which
    the probe's blocks do not (the replay prices that apart: :func:`backward_rate`).

    1 where nothing is priced on the link or the fixed parts take it all, and on one host: there
    is no wire to measure, the buckets' times in training are the cores' (shared with backward,
    which the contention term prices). Scaled there, the loopback rows moved the wrong way: cap
    1 from -4.0% and -6.6% to -21.3% and -25.7%, bf16 from +1.7% and -3.6% to -10.7% and -17.0%
    (``advisor_accuracy.py``, 2026-12-02, MLP runs 2 and 3)."""
    if profile.one_host:
        return 1.0
    setting = run_setting(profile)
    options = setting_options(profile, setting)
    if network.large_blocks is not None:
        (small, small_ms), (large, large_ms) = network.large_blocks
        priced_ms = [bucket_cost(network, setting.algorithm, float(n), setting.world_size, **options).link_ms
                     for n in (small, large)]
        measured, priced_link = large_ms - small_ms, priced_ms[1] - priced_ms[0]
        return measured / priced_link if priced_link > 0 and measured > 0 else 1.0
    costs = [bucket_cost(network, setting.algorithm, priced(b), setting.world_size, **options) for b in profile.buckets]
    link = sum(c.link_ms for c in costs)
    busy_ms = (profile.link_busy_ms[LINK_BUSY.index(busy)] if profile.link_busy_ms is not None
               else sum(b.service_ms for b in profile.buckets))
    measured = busy_ms - sum(c.fixed_ms for c in costs)
    return measured / link if link > 0 and measured > 0 else 1.0


#: A probe that prices the run's largest bucket this much of its time or more is taken as it
#: read (rounding, a block's scatter); under it, as slowed (:func:`slowed_probe_scale`).
SLOWED_PROBE = 0.95


def slowed_probe_scale(profile: RunProfile, network: Network) -> float:
    """On one host, what a probe slowed as a whole is scaled by: the run's largest bucket's own
    time over the probe's price of it, when that is under :data:`SLOWED_PROBE` (else 1).

    In training a bucket shares the cores with backward and the other rank's work, so on one
    host it takes longer than the probe's all-reduce of as many bytes alone: its largest
    bucket (the most bandwidth-bound) took 1.3x its price in five of six loopback runs
    (``advisor_accuracy.py``, the tenth series). A probe that prices it slower than it ran was
    slowed itself, every block and every size (a busy moment when the hook was registered: in
    the sixth run the 5 MiB bucket that took 3.2 ms in all six was priced 5.2 ms, 2.3-2.5 ms in
    the others), and every row it prices, α, β and the casts alike, is as slow: the advice
    scales them all until that bucket costs what it took (the least correction the run
    proves). On several hosts the link's own rate comes from the probe's large blocks
    (:func:`link_scale`) and a bucket's time holds waits the probe does not; 1 there."""
    if not profile.one_host or not profile.buckets:
        return 1.0
    setting = run_setting(profile)
    largest = max(profile.buckets, key=lambda b: b.nbytes)
    price = network.cost_ms(setting.algorithm, priced(largest), setting.world_size,
                            **setting_options(profile, setting))
    took = largest.service_ms or largest.comm_ms
    return took / price if price > 0 and 0 < took < SLOWED_PROBE * price else 1.0


def shared_ways(profile: RunProfile) -> float | None:
    """On one host, the ways the run's own algorithm held on average (2 for the ring: both at
    once; 1 for a tree: one at a time): what the network fitted to it priced a byte at
    (:func:`~.replay.replay`'s ``shared_ways``). ``None`` for ranks on several hosts: full duplex."""
    if not profile.one_host:
        return None
    setting = run_setting(profile)
    largest = max((b.nbytes for b in profile.buckets), default=0)
    return ways_held(link_directions(setting.algorithm, setting.world_size, nbytes=largest,
                                     **setting_options(profile, setting)))


def contention_per_cpu_ms(profile: RunProfile, network: Network) -> float:
    """The run's contention per millisecond of communication CPU behind backward, in the run's
    own lanes (:class:`CommCpu`)."""
    setting = run_setting(profile)
    sizes = [priced(b) for b in profile.buckets]
    options = setting_options(profile, setting)
    costs = [bucket_cost(network, setting.algorithm, n, setting.world_size, **options) for n in sizes]
    lanes = replay([b.ready_ms for b in profile.buckets], costs, lanes=profile.lanes, backward_ms=profile.backward_ms,
                   shared_ways=shared_ways(profile))
    moved = _hidden_cpu(sizes, lanes.starts, lanes.ends, profile.backward_ms, comm_cpu(profile), 1.0)
    return profile.contention_ms / moved if moved > 0 else 0.0


#: The slowest exchange beside backward the calibration may find (a share of the link's price):
#: slower, and the run's exposed time is what the replay cannot explain (the offset takes it).
SLOWEST_BACKWARD_RATE = 0.05


def backward_rate(profile: RunProfile, network: Network, own: OwnLink, contention_per_cpu: float) -> float:
    """The rate at which the run's exchanges (both-ways parts) progressed while backward ran:
    the one at which the replay of the run's own setting ends as late as the run measured (its
    exposed time), found by bisection (a slower rate only ever ends later). 1 when the replay at
    full rate already ends that late; :data:`SLOWEST_BACKWARD_RATE` at the least.

    Priced apart because it does not follow the bytes: on the lab's hosts of a fifth of a core a
    ring's two 2 MiB buckets took 83 ms on the link when both ran after backward and 95-171 ms
    when the first ran beside it (a rate of about a third), while a tree's one-way halves and a
    lone bucket after backward ran at the link's rate. Scaling every part by the run's link time
    priced those 10-50% slow (``docs/advisor.md``, the tenth series)."""
    setting = run_setting(profile)

    def exposed(rate: float) -> float:
        return _model(profile, network, setting, contention_per_cpu, replace(own, backward_rate=rate)).exposed_ms

    if exposed(1.0) >= profile.exposed_ms:
        return 1.0
    slow, fast = SLOWEST_BACKWARD_RATE, 1.0
    if exposed(slow) <= profile.exposed_ms:
        return slow
    for _ in range(30):  # 1e-9 of the range: far below what a step's milliseconds can tell
        middle = (slow + fast) / 2
        slow, fast = (middle, fast) if exposed(middle) >= profile.exposed_ms else (slow, middle)
    return (slow + fast) / 2


@dataclass(frozen=True)
class StepModel:
    """The step model of one run, calibrated on it; :meth:`predict` any setting.

    ``run_network`` is fitted to the run's buckets (it calibrates contention and the offset);
    ``network`` costs the predictions (the run's, or a target cluster's).
    """

    profile: RunProfile
    run_network: Network
    network: Network
    #: which of the run's link times a network measured here is scaled to (:data:`LINK_BUSY`)
    link_busy: str = "median"

    @functools.cached_property
    def contention_per_cpu_ms(self) -> float:
        return contention_per_cpu_ms(self.profile, self.run_network)

    @property
    def measured_network(self) -> Network | None:
        """The network measured here that the predictions' network is, or was laid out from
        (two tiers from this run's probe: the same hosts and links, another layout); ``None``
        for another cluster's network."""
        if self.network.here:
            return self.network
        laid_out_from = self.network.laid_out_from
        return laid_out_from if laid_out_from is not None and laid_out_from.here else None

    @functools.cached_property
    def own_link(self) -> OwnLink | None:
        """What the network measured here is fitted to on the run (:class:`OwnLink`): scaled to
        its own link, on one host with its two ways shared, each bucket started after the run's
        pickup, and on several hosts with a probe the exchanges' rate beside backward
        calibrated on the run. A network laid out from it (two tiers) keeps it: its links are
        this run's, placed otherwise. ``None`` for another cluster's network, taken as given."""
        measured = self.measured_network
        if measured is None:
            return None
        own = OwnLink(link_scale(self.profile, measured, self.link_busy), shared_ways(self.profile),
                      pickup_ms=self.profile.pickup_ms)
        if self.profile.one_host or measured.large_blocks is None:
            return own
        return replace(own, backward_rate=backward_rate(self.profile, measured, own, self.contention_per_cpu_ms))

    @functools.cached_property
    def _run_replayed(self) -> _Raw:
        """The run's own setting, modelled: what every prediction is calibrated against.
        Calibrated on the run with the network measured here (:attr:`measured_network`: the
        run's buckets, its probe) on this run's link (:attr:`own_link`): the run's own setting
        then comes out exactly, and a network laid out from it (two tiers from its probe)
        differs from it by the layout alone. Another cluster's network is calibrated on the
        run's bucket fit, full duplex, as given."""
        calibrated_with = self.measured_network or self.run_network
        return _model(self.profile, calibrated_with, run_setting(self.profile), self.contention_per_cpu_ms,
                      self.own_link or OwnLink(1.0, shared_ways(self.profile)))

    def predict(self, setting: Setting) -> Prediction:
        """The predicted step of ``setting`` (see the module docstring)."""
        here = self._run_replayed
        raw = _model(self.profile, self.network, setting, self.contention_per_cpu_ms, self.own_link or FULL_DUPLEX)
        # The run's exposed time holds its own world's wait for the latest rank; another world's differs.
        later = latest_rank_wait_ms(self.profile.arrival_lateness, setting.world_size, self.profile.world_size)
        exposed = max(0.0, raw.exposed_ms + (self.profile.exposed_ms - here.exposed_ms) + later)
        # Contention the bytes moved behind backward do not explain (measured with nothing
        # hidden: the synchronizing micro-batch's own overhead) is a constant of the step, too.
        contention = max(0.0, raw.contention_ms + (self.profile.contention_ms - here.contention_ms))
        step = raw.step_ms - raw.exposed_ms + exposed - raw.contention_ms + contention
        # Communication is calibrated like exposed (what the run measured beyond the replay is
        # added): the run's own row reads as measured. It is hidden + exposed, both from the
        # hand-over, so never less than exposed: a measured hidden part smaller than the
        # replay's can only shrink the hidden part to nothing.
        comm = max(exposed, raw.comm_ms + (self.profile.comm_ms - here.comm_ms))
        return Prediction(
            step_ms=step, comm_ms=comm, exposed_ms=exposed, contention_ms=contention,
            buckets=raw.buckets, samples_per_step=setting.accumulate * setting.world_size,
        )

    def speedup(self, setting: Setting) -> float:
        """Samples per second of ``setting`` relative to the run (measured)."""
        prediction = self.predict(setting)
        p = self.profile
        return (prediction.samples_per_step / prediction.step_ms) / (p.accumulate * p.world_size / p.step_ms)

    def with_network(self, network: Network) -> StepModel:
        return replace(self, network=network)
