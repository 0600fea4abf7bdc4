"""A measured bandwidth matrix: every timed transfer, where the ranks are, and its file.

``ddp-ring-hooks links --json PATH`` writes it; :func:`load_link_matrix` reads it back for
whoever plans by the network (a ring order, the advisor)::

    matrix = load_link_matrix("links.json")
    matrix.rows()        # bytes/s, row = source, column = destination, None on the diagonal
    matrix.nodes         # the node of each rank, or None when the probe could not tell
    matrix.judge()       # the naming rule's verdict (ddp_ring_hooks.links.rule)
    matrix.best_ring()   # the ring order whose slowest link is fastest (links.ring_order)

The file (format ``ddp-ring-hooks links``, version 1) is one JSON object:

========================  =================================================================
``format``, ``version``   ``"ddp-ring-hooks links"``, ``1``; a reader refuses other values
``world_size``            ranks measured
``backend``               the process group's backend (``gloo``: TCP)
``message_bytes``         bytes per transfer
``repeats``               timed transfers per link (the bandwidth is their median)
``nodes``                 the node of each rank (list), or ``null``
``nodes_from``            where ``nodes`` came from: ``GROUP_RANK``, ``LOCAL_WORLD_SIZE`` or ``null``
``hosts``                 each rank's host name
``seconds``               ``seconds[src][dst]``: the list of timed transfers src→dst (``null`` on the diagonal)
``bandwidth_Bps``         ``bandwidth_Bps[src][dst]``: the median, bytes per second (``null`` on the diagonal)
``verdict``               the naming rule's findings when written (``summary``: its line)
========================  =================================================================

``seconds`` is what is read back; ``bandwidth_Bps`` and ``verdict`` are there for readers that
want the numbers without the rule (``jq``, a spreadsheet).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from .ring_order import best_ring
from .rule import ALL, THRESHOLD, Link, LinkSample, LinkVerdict, judge_samples, recent_bandwidths

FORMAT = "ddp-ring-hooks links"
VERSION = 1


@dataclass(frozen=True)
class LinkMatrix:
    """Every timed transfer of one probe (``samples``) and where its ranks are."""

    world_size: int
    samples: tuple[LinkSample, ...]
    message_bytes: int
    repeats: int
    nodes: tuple[int, ...] | None = None
    nodes_from: str | None = None
    hosts: tuple[str, ...] = ()
    backend: str = "gloo"

    @property
    def bandwidths(self) -> dict[Link, float]:
        """Each measured link's median bandwidth, bytes per second."""
        return {link: statistics.median(values) for link, values in recent_bandwidths(self.samples, window=None).items()}

    def rows(self) -> list[list[float | None]]:
        """The matrix, bytes per second: ``rows()[src][dst]``, ``None`` where nothing was measured."""
        bandwidths = self.bandwidths
        return [[bandwidths.get((src, dst)) for dst in range(self.world_size)] for src in range(self.world_size)]

    def missing(self) -> list[Link]:
        """Directed links without a sample (none after a complete probe)."""
        bandwidths = self.bandwidths
        every = ((s, d) for s in range(self.world_size) for d in range(self.world_size) if s != d)
        return [link for link in every if link not in bandwidths]

    def best_ring(self) -> tuple[int, ...]:
        """The ring order whose slowest link is fastest (:func:`~.ring_order.best_ring`): what
        ``ring_order=`` takes, e.g. ``ring_order=load_link_matrix("links.json").best_ring()``."""
        return best_ring(self.rows())

    def judge(self, *, threshold: float = THRESHOLD) -> LinkVerdict:
        """The naming rule on this matrix (medians over all repeats)."""
        return judge_samples(self.samples, world_size=self.world_size, nodes=self.nodes, threshold=threshold, window=None)

    def as_dict(self, *, threshold: float = THRESHOLD) -> dict:
        seconds = [[None if s == d else [] for d in range(self.world_size)] for s in range(self.world_size)]
        for sample in self.samples:
            seconds[sample.src][sample.dst].append(sample.seconds)
        return {
            "format": FORMAT, "version": VERSION, "world_size": self.world_size, "backend": self.backend,
            "message_bytes": self.message_bytes, "repeats": self.repeats,
            "nodes": list(self.nodes) if self.nodes is not None else None, "nodes_from": self.nodes_from,
            "hosts": list(self.hosts), "seconds": seconds, "bandwidth_Bps": self.rows(),
            "verdict": self.judge(threshold=threshold).as_dict(per="repeats"),
        }


def write_link_matrix(matrix: LinkMatrix, path: str | Path, *, threshold: float = THRESHOLD) -> None:
    """Write ``matrix`` as the versioned JSON of the module docstring."""
    Path(path).write_text(json.dumps(matrix.as_dict(threshold=threshold), indent=1) + "\n", encoding="utf-8")


def load_link_matrix(path: str | Path) -> LinkMatrix:
    """Read a file written by ``ddp-ring-hooks links --json``: the matrix and the ranks' nodes."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read link matrix {str(path)!r}: {error}") from error
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a link matrix (no \"format\": {FORMAT!r}); "
                         "write one with `ddp-ring-hooks links --json PATH`")
    if data.get("version") != VERSION:
        raise ValueError(f"{str(path)!r} is a link matrix of version {data.get('version')!r}; this version reads "
                         f"version {VERSION}: measure it again with `ddp-ring-hooks links --json PATH`")
    world_size = data["world_size"]
    samples = tuple(
        LinkSample(src, dst, data["message_bytes"], seconds)
        for src, row in enumerate(data["seconds"]) for dst, times in enumerate(row) for seconds in times or ()
    )
    nodes = data.get("nodes")
    return LinkMatrix(
        world_size=world_size, samples=samples, message_bytes=data["message_bytes"], repeats=data["repeats"],
        nodes=tuple(nodes) if nodes is not None else None, nodes_from=data.get("nodes_from"),
        hosts=tuple(data.get("hosts", ())), backend=data.get("backend", "gloo"),
    )


def format_table(matrix: LinkMatrix, verdict: LinkVerdict) -> str:
    """The matrix in MB/s, one row per source; ``*`` marks a link the verdict names (a slow
    link, or one of a named rank or node); with two tiers each rank shows its node."""
    named = verdict.named_links()
    two_tiers = verdict.nodes is not None and ALL not in verdict.tier_medians
    labels = [f"{rank} [n{verdict.nodes[rank]}]" if two_tiers else str(rank) for rank in range(matrix.world_size)]
    width = max(9, *(len(label) + 1 for label in labels))
    cells = [[("." if s == d else "-" if b is None else f"{b / 1e6:.1f}" + ("*" if (s, d) in named else ""))
              for d, b in enumerate(row)] for s, row in enumerate(matrix.rows())]
    lines = ["from\\to".rjust(width) + "".join(label.rjust(width) for label in labels)]
    lines += [label.rjust(width) + "".join(cell.rjust(width) for cell in row) for label, row in zip(labels, cells)]
    return "\n".join(lines) + "\n"
