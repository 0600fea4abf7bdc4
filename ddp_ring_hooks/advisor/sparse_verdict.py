"""Gather or densify: which way a run's sparse buckets travel faster (``register(sparse=...)``).

A sparse gradient bucket (``nn.Embedding(sparse=True)``) is gathered by default (gloo's sparse
all-reduce: every rank's indices and values to every rank, ``O(p·nnz)``) or, with
``sparse="dense"``, reduced by the algorithm as the dense table (``2(p-1)/p·n`` for the ring,
whatever the rows touched). For each sparse bucket of the run:

1. Take its size both ways from the timeline (version 3): ``s``, one rank's indices and values
   (the median over steps, coalesced), and ``D``, the table as a dense tensor.
2. Price both ways (:func:`~.network.bucket_cost`) at the run's world size, with the run's
   algorithm for the densified way, on one network (:func:`verdict_network`): the probe's
   fastest blocks when the run recorded a probe; the one given (``--network``: another
   cluster); else the run's own buckets' fit.
3. The cheaper way is the verdict; the run's own way is shown with what it measured.

Why the probe, and its fastest blocks. The two ways are priced by different terms: the gather
mostly by its messages (three all-gathers, ``3(p-1)·α``) and gloo's local sums (``γ``), the
densified table by its bytes (``β``) and the two passes that make and unmake it (``γ``). A fit
to the run's own buckets sees one of the two: a run with only the sparse bucket fits it with
one size, all in ``β`` (bandwidth only), which priced the other way 10 times off (2 ranks,
loopback: the gathered run predicted densify at 354-1024 ms against 24-44 measured, the
densified run the gather at 0.12-0.23 ms against 2.3-5.9). The probe times the network at a
small and a large size when the hook is registered, so it prices ``α``, ``β`` and ``γ`` apart.
Its blocks are single calls, and on a loaded machine one disturbed block (the first probe of a
process, a busy core) bends the median fit (once ``β = 0``, which priced 25.6 MB as free); a
disturbance only ever slows a block, so the fastest block of each size is the network with the
least load on it, and a slowdown common to both ways cancels in their ratio. Measured
(``benchmarks/sparse_bucket.py``, 2 ranks, three runs each, ``docs/hook.md``): predicted
densify/gather 12-45 against 13-21 measured on a 100000 x 64 table, 0.67-0.71 against 0.53-0.62
on a 1000 x 64 one; on the lab (400 Mbit/s) 165-188 against 184-203, 0.94-0.98 against 0.68-0.85.
When even the fastest blocks leave ``α`` or ``β`` at 0 (all three small blocks disturbed: 2 of
12 verdicts on loopback, when a size had three), the probe's own fit (each size's lower
quartile block) prices both ways if it gives both, else the
run's own fit (the other way extrapolated from one size: 1 of 4 verdicts of a fresh-clone CI run
read a table densifying wins by 1.3-4x as a close call the other way); the line says which.

Only the bucket's own all-reduce is compared (both ways reduce it on the hook's lanes, the rest
of the step is the same); the densified way includes making the dense table and the sparse
result, as the run times it.
"""

from __future__ import annotations

from .network import DENSIFY, GATHER, Network, SparseBucket, unpriced_costs
from .step_model import StepModel, priced, run_setting, setting_options

#: A predicted ratio this close to 1 is a close call: the α-β-γ prices leave out what the
#: gather's coalescing costs beyond a pass over its bytes (a sort of its rows), so the line says
#: to measure both.
CLOSE = 0.10

#: How the line names the network it prefers.
FASTEST = "the probe's fastest blocks"

#: What each way is called in the advice.
WAYS = {GATHER: "gather", DENSIFY: "densify"}
DONE = {GATHER: "gathered", DENSIFY: "densified"}


def verdict_network(model: StepModel) -> tuple[Network, str]:
    """The network both ways are priced on, and how the line names it (the module docstring):
    the probe's fastest blocks unless they leave the per-message or the per-byte cost at zero
    (a probe whose small blocks were all disturbed: ``β = 0`` prices any table as free), then
    its own fit (each size's lower quartile block), then this run's own buckets."""
    network = model.network
    if not network.here:
        return network, "the network given"
    if network.bounds is not None:
        candidates = ((network.bounds[0], FASTEST),
                      (network, "the probe's lower quartile blocks (its fastest left a cost at 0: a disturbed probe)"))
        for candidate, name in candidates:
            links = candidate.calibration(model.profile.algorithm)
            if not unpriced_costs(links):
                return candidate, name
        reason = "the probe's blocks left its per-message or per-byte cost at 0 (a disturbed probe)"
    else:
        reason = "no network probe (log_dir= or network_probe=True records one)"
    return model.run_network, (f"this run's buckets ({reason}: the other way is extrapolated from them, "
                               "trust the direction, not the ratio)")


def sparse_verdicts(model: StepModel) -> list[dict]:
    """One entry per sparse bucket of the run (the ``--json`` shape's ``sparse`` list, empty for a
    run without one)::

        {"bucket", "nnz", "sparse_bytes", "dense_bytes", "this_run" ("gather" or "densify"),
         "measured_ms" (its own way, as the run timed it), "gather_ms", "densify_ms" (predicted),
         "verdict" ("gather" or "densify": the faster), "densify_over_gather",
         "close" (within CLOSE of 1: measure both), "priced_on" (the network), "line"}
    """
    p = model.profile
    options = setting_options(p, run_setting(p))
    network, priced_on = verdict_network(model)
    verdicts = []
    for index, bucket in enumerate(p.buckets):
        size = priced(bucket)
        if not isinstance(size, SparseBucket):
            continue
        gather, densify = (network.cost_ms(p.algorithm, size.going(way), p.world_size, **options)
                           for way in (GATHER, DENSIFY))
        faster = GATHER if gather <= densify else DENSIFY
        ratio = densify / gather if gather > 0 else float("inf")
        own = WAYS[size.way]
        close = abs(ratio - 1) < CLOSE
        measured = bucket.service_ms or bucket.comm_ms
        line = (f"sparse bucket {index} ({bucket.nnz} rows of a {bucket.dense_bytes / 2**20:.1f} MiB table, "
                f"{bucket.sparse_bytes / 2**10:.0f} KiB per rank): gather {gather:.2f} ms vs densify {densify:.2f} ms "
                f"predicted at {p.world_size} ranks on {priced_on}: {WAYS[faster]} wins ({ratio:.2f}x"
                f"{f', within {CLOSE:.0%}: a close call, measure both ways' if close else ''}); this run {DONE[size.way]} it "
                f"in {measured:.2f} ms" + ("" if faster == size.way else
                                           f"; register(sparse={faster!r}) is predicted faster"))
        verdicts.append({
            "bucket": index, "nnz": bucket.nnz, "sparse_bytes": bucket.sparse_bytes, "dense_bytes": bucket.dense_bytes,
            "this_run": own, "measured_ms": measured, "gather_ms": gather, "densify_ms": densify,
            "verdict": WAYS[faster], "densify_over_gather": ratio, "close": close, "priced_on": priced_on,
            "line": line,
        })
    return verdicts
