"""See the algorithm: explain and animate a schedule (or a recorded run) step by step.

Reads :mod:`~ddp_ring_hooks.schedules` (and :mod:`~ddp_ring_hooks.cost_model` for the cost
summary), never ``hooks``, ``runtime`` or ``torch.distributed``, so it works on any laptop;
matplotlib is imported only when an animation is rendered.
"""

from .animate import render_animation
from .layout import Layout, choose_layout
from .simulate import ChunkState, Frame, Simulation, simulate, split_sizes
from .text import explain, format_frame, format_ring_order

__all__ = [
    "ChunkState", "Frame", "Layout", "Simulation", "choose_layout", "explain", "format_frame",
    "format_ring_order", "render_animation", "simulate", "split_sizes",
]
