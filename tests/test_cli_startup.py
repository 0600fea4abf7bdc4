"""The command line's first second: a command that runs no rank answers without importing torch.

``import torch`` costs about 2.4 s of CPU (12-15 s on a loaded machine), which every
``ddp-ring-hooks --help`` and ``lab status`` once paid. The package imports its public names
on first use (``ddp_ring_hooks/__init__.py``) and each command module imports torch only in
the code that runs ranks, so these commands answer in a fraction of a second. One fresh
interpreter runs them all in turn, noting after each whether torch is loaded yet.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
import textwrap

from ddp_ring_hooks import cli
from tests.conftest import checkout_environment

#: Commands that run no rank, as a new user types them in the first hour.
TORCH_FREE = [
    ["--help"],
    ["lab", "status"],
    ["lab", "up", "--help"],
    ["explain", "--algorithm", "ring", "--world-size", "4"],
    ["model", "--world-size", "8", "--size", "64M"],
    *[[name, "--help"] for name in sorted(m.name for m in pkgutil.iter_modules(cli.__path__)) if not name.startswith("_")],
]

_RUN_EACH = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from ddp_ring_hooks.cli.__main__ import main

    seen = {"import ddp_ring_hooks": "torch" in sys.modules}
    for argv in json.loads(sys.argv[1]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(argv)
            except SystemExit as exit:  # --help exits 0
                code = exit.code
        assert code in (0, None), (argv, code, out.getvalue()[-2000:])
        seen[" ".join(argv)] = "torch" in sys.modules
    print(json.dumps(seen))
    """
)


def test_commands_that_run_no_rank_never_import_torch():
    done = subprocess.run([sys.executable, "-c", _RUN_EACH, json.dumps(TORCH_FREE)], capture_output=True, text=True,
                          timeout=120, env=checkout_environment())
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert len(seen) == 1 + len(TORCH_FREE)
    # The first command that loaded torch is the one to fix (every later one reads True too).
    assert not any(seen.values()), f"torch was imported by: {next(c for c, loaded in seen.items() if loaded)}"
