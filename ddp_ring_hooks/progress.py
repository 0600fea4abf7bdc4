"""Progress bars for long work (the benchmark sweep, drawing animations): tqdm when it is
installed and wanted, else a bar that shows nothing, so callers never check."""

from __future__ import annotations


def progress_bar(total: int, description: str, *, unit: str, enabled: bool = True):
    """A tqdm bar over ``total`` units, or a silent stand-in when ``enabled`` is false or tqdm
    is missing (it comes with the ``[examples]`` extra; the work itself never needs it)."""
    if enabled:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            pass
        else:
            return tqdm(total=total, desc=description, unit=unit, leave=False)
    return _NoProgress()


class _NoProgress:
    """The part of tqdm's interface the callers use, doing nothing."""

    def update(self, count: int = 1) -> None:
        """Nothing to show."""

    def set_postfix_str(self, text: str) -> None:
        """Nothing to show."""

    def close(self) -> None:
        """Nothing to close."""
