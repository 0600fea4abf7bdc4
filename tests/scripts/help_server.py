"""Answer ``PROGRAM --help`` for many programs from one Python process (the docs' and scripts'
checks ask for about forty; each on its own would import torch again, 2-3 s apiece).

Reads one JSON list per line on stdin, a program's argv without ``--help``: ``[python,
script.py, ...]``, ``[python, -m, module, ...]``, ``[ddp-ring-hooks, ...]`` or ``[torchrun,
...]``; runs it in this process with ``--help`` appended, as ``python`` would (``runpy``, the
same ``__main__`` code path), and writes one JSON line ``{"returncode", "stdout", "stderr"}``.
A program of another shape gets ``{"returncode": null}``: the caller runs it itself.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys

CONSOLE_SCRIPTS = {"ddp-ring-hooks": "ddp_ring_hooks", "torchrun": "torch.distributed.run"}


def target(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """``("path" | "module", what, arguments)`` for a program this process can run, else None."""
    head, *rest = argv
    if os.path.basename(head) in CONSOLE_SCRIPTS:
        return "module", CONSOLE_SCRIPTS[os.path.basename(head)], rest
    if os.path.basename(head).startswith("python") and rest:
        if rest[0] == "-m" and len(rest) > 1:
            return "module", rest[1], rest[2:]
        if rest[0].endswith(".py"):
            return "path", rest[0], rest[1:]
    return None


def answer(argv: list[str]) -> dict:
    found = target(argv)
    if found is None:
        return {"returncode": None}
    kind, what, arguments = found
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [what if kind == "path" else argv[0], *arguments, "--help"]
    if kind == "path":  # as `python script.py` does: the script's folder first on the path
        sys.path.insert(0, os.path.dirname(os.path.abspath(what)))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if kind == "path":
                runpy.run_path(what, run_name="__main__")
            else:
                runpy.run_module(what, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException as error:  # noqa: BLE001 - a program's crash is its answer
        err.write(f"{type(error).__name__}: {error}")
        code = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    for line in sys.stdin:
        print(json.dumps(answer(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
