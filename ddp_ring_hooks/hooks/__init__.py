"""The DDP adapter: hook function, its state, and one-call registration."""

from .register import register
from .ring_hook import ring_hook
from .state import HookState

__all__ = ["HookState", "register", "ring_hook"]
