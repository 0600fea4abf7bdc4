"""Gather or densify: which way a run's sparse buckets travel faster (``register(sparse=...)``).

A sparse gradient bucket (``nn.Embedding(sparse=True)``) is gathered by default (gloo's sparse
all-reduce: every rank's indices and values to every rank, ``O(p·nnz)``) or, with
``sparse="dense"``, reduced by the algorithm as the dense table (``2(p-1)/p·n`` for the ring,
whatever the rows touched). For each sparse bucket of the run:

1. Take its size both ways from the timeline (version 3): ``s``, one rank's indices and values
   (the median over steps, coalesced), and ``D``, the table as a dense tensor.
2. Price it both ways (:func:`~.network.bucket_cost`) at the run's world size, with the run's
   algorithm for the densified way, on the network fitted to the run's own buckets as they ran
   (its sparse bucket among them), or on the one given (``--network``: another cluster). Not on
   the probe: its α-β split, fitted to two sizes, is fragile on a loaded machine (at load 7 on
   2 cores it gave α = 2.5 ms, which priced a 24 MiB ring below a 34 KiB gather), while the
   run's own bucket prices the bytes of the way it travelled directly.
3. The cheaper way is the verdict; the run's own way is shown with what it measured.

Only the bucket's own all-reduce is compared (both ways reduce it on the hook's lanes, the rest
of the step is the same); the densified way includes making the dense table and the sparse
result (a pass over ``D`` each, at the probe's γ: free when the network knows no γ).
"""

from __future__ import annotations

from .network import DENSIFY, GATHER, SparseBucket
from .step_model import StepModel, priced, run_setting, setting_options

#: A predicted ratio this close to 1 is a close call: the α-β-γ prices leave out gloo's sparse
#: work beyond its bytes (2 ranks, a 1000 x 64 table all of whose rows are touched: predicted
#: 0.99, measured 0.40-0.88), so the line says to measure both.
CLOSE = 0.10

#: What each way is called in the advice.
WAYS = {GATHER: "gather", DENSIFY: "densify"}
DONE = {GATHER: "gathered", DENSIFY: "densified"}


def sparse_verdicts(model: StepModel) -> list[dict]:
    """One entry per sparse bucket of the run (the ``--json`` shape's ``sparse`` list, empty for a
    run without one)::

        {"bucket", "nnz", "sparse_bytes", "dense_bytes", "this_run" ("gather" or "densify"),
         "measured_ms" (its own way, as the run timed it), "gather_ms", "densify_ms" (predicted),
         "verdict" ("gather" or "densify": the faster), "densify_over_gather",
         "close" (within CLOSE of 1: measure both), "line"}
    """
    p = model.profile
    options = setting_options(p, run_setting(p))
    network = model.run_network if model.network.here else model.network
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
                f"predicted at {p.world_size} ranks: {WAYS[faster]} wins ({ratio:.2f}x"
                f"{f', within {CLOSE:.0%}: a close call, measure both ways' if close else ''}); this run {DONE[size.way]} it "
                f"in {measured:.2f} ms" + ("" if faster == size.way else
                                           f"; register(sparse={faster!r}) is predicted faster"))
        verdicts.append({
            "bucket": index, "nnz": bucket.nnz, "sparse_bytes": bucket.sparse_bytes, "dense_bytes": bucket.dense_bytes,
            "this_run": own, "measured_ms": measured, "gather_ms": gather, "densify_ms": densify,
            "verdict": WAYS[faster], "densify_over_gather": ratio, "close": close, "line": line,
        })
    return verdicts
