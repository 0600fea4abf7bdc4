"""The docs cannot drift: every shell command in README.md and docs/*.md runs in a test.

The convention (docs/architecture.md, "Commands in the docs"): commands go in a fenced block
marked ``sh`` (one command per line, ``\\`` continues a line, ``#`` starts a comment) or
``console`` (a transcript: ``$ `` lines are commands, the lines under them their output).
Each block is checked one of three ways, chosen by an HTML comment on the line above it:

- nothing: **the help check**. Each command's program answers ``--help`` and lists every
  option the command uses (``torchrun`` and the script after it each against their own
  help), and a script it names exists (for a script given no options, that is all). Cheap enough for the long commands (a training run,
  a benchmark), and it fails when a flag or a file is renamed.
- ``<!-- docs-check: run -->``: the command runs as printed (in a scratch directory) and must
  succeed; in a ``console`` block its output must be the output shown.
- ``<!-- docs-check: not run (why) -->``: not run here, with the reason (an install, a GPU).

A command written anywhere else (an indented block) fails the check, which says how to fence it.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import checkout_environment, help_text

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ENVIRONMENT = checkout_environment()
SHELL_FENCES = {"sh", "bash", "shell", "console"}
#: Words that start a command line; an indented block starting with one is a command left unchecked.
COMMAND_WORDS = ("torchrun", "python", "ddp-ring-hooks", "tensorboard", "pip", "$ ")
MARK = re.compile(r"<!--\s*docs-check:\s*(run|not run)\s*(?:\((.+)\))?\s*-->")


@dataclass(frozen=True)
class Command:
    """One command line of a docs page, and how its block asks for it to be checked."""

    path: Path
    line: int
    text: str
    check: str  # "help", "run" or "not run"
    output: str | None = None  # a console block's output under the command

    @property
    def where(self) -> str:
        return f"{shown(self.path)}:{self.line}"


def shown(path: Path) -> str:
    """A path as a failure names it: relative to the repository where it is in it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def commands_in(path: Path) -> list[Command]:
    """Every command in ``path``'s shell blocks (see the module docstring)."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.fullmatch(r"```\s*(\w*).*", lines[i].strip())
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        if fence.group(1) in SHELL_FENCES:
            mark = MARK.search(lines[i - 1]) if i > 0 else None
            if mark and mark.group(1) == "not run" and not mark.group(2):
                raise ValueError(f"{shown(path)}:{i}: say why it is not run: <!-- docs-check: not run (why) -->")
            check = mark.group(1) if mark else "help"
            found += _block_commands(path, i + 2, lines[i + 1:end], check=check, console=fence.group(1) == "console")
        i = end + 1
    return found


def _block_commands(path: Path, first_line: int, body: list[str], *, check: str, console: bool) -> list[Command]:
    commands: list[Command] = []
    pending, start, output = "", 0, []
    for number, line in enumerate(body, first_line):
        if console and not line.startswith("$ ") and not pending:
            output.append(line)
            continue
        if console and commands and output:
            commands[-1] = Command(commands[-1].path, commands[-1].line, commands[-1].text, check, "\n".join(output))
        output = []
        text = (line[2:] if console and line.startswith("$ ") else line).strip()
        if not pending:
            start = number
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            continue
        whole = (pending + text).strip()
        pending = ""
        if whole and not whole.startswith("#"):
            commands.append(Command(path, start, whole, check))
    if console and commands and output:
        commands[-1] = Command(commands[-1].path, commands[-1].line, commands[-1].text, check, "\n".join(output))
    return commands


def unfenced_commands(path: Path) -> list[str]:
    """``file:line: text`` of every command in an indented block (outside any fence)."""
    found, inside = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            inside = not inside
        elif not inside and line.startswith("    ") and line.strip().startswith(COMMAND_WORDS):
            found.append(f"{shown(path)}:{number}: {line.strip()}")
    return found


# -- the help check ---------------------------------------------------------------------------


def programs(command: str) -> list[tuple[tuple[str, ...], list[str]]]:
    """``(program, options)`` pairs of a command: the argv that prints its help, and the options
    the command gives it. ``torchrun ... script.py --x`` is two programs (the launcher and the
    script); ``a && b`` two commands; ``VAR=1 cmd`` is ``cmd``. Unknown programs raise ``ValueError``."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)  # "a && b" -> a, &&, b; "# ..." dropped
    lexer.whitespace_split = True
    found, words = [], []
    for token in [*lexer, ";"]:
        if token not in ("&&", "||", ";", "|"):
            words.append(token)
            continue
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words = words[1:]
        if words:
            found += _programs_of(words)
        words = []
    return found


def _programs_of(words: list[str]) -> list[tuple[tuple[str, ...], list[str]]]:
    head, rest = words[0], words[1:]
    if head == "torchrun":
        script = next(i for i, w in enumerate(rest) if w.endswith(".py"))
        return [((sys.executable, "-m", "torch.distributed.run"), rest[:script]), *_programs_of(["python", *rest[script:]])]
    if head in ("python", "python3"):
        if rest[:1] == ["-m"]:
            module, args = rest[1], rest[2:]
            if module == "ddp_ring_hooks":
                return _programs_of(["ddp-ring-hooks", *args])
            return [((sys.executable, "-m", module), args)]
        script = ROOT / rest[0]
        if not script.is_file():
            raise ValueError(f"no script {rest[0]} in the repository")
        return [((sys.executable, str(script)), rest[1:])]
    if head == "ddp-ring-hooks" and rest[:2] == ["lab", "torchrun"]:
        # The lab's own options, then torchrun's, then the script or -m module with its own.
        lab = (sys.executable, "-m", "ddp_ring_hooks", "lab", "torchrun")
        script = next(i for i, w in enumerate(rest) if w.endswith(".py") or w == "-m")
        return [(lab, rest[2:script]), *_programs_of(["python", *rest[script:]])]
    if head == "ddp-ring-hooks" and rest[:2] == ["lab", "run"] and "--" in rest:
        # After "--" comes any command at all (sh -c ...): only the lab's options are checked.
        return [((sys.executable, "-m", "ddp_ring_hooks", "lab", "run"), rest[2:rest.index("--")])]
    if head == "ddp-ring-hooks" and rest[:1] == ["lab"] and rest[1:2] and rest[1] not in ("run", "torchrun"):
        # The lab's other actions (up, down, status, table) each answer --help of their own.
        return [((sys.executable, "-m", "ddp_ring_hooks", "lab", rest[1]), rest[2:])]
    if head == "ddp-ring-hooks":
        return [((sys.executable, "-m", "ddp_ring_hooks", rest[0]), rest[1:])]
    if head == "tensorboard":
        return [((sys.executable, "-m", "tensorboard.main"), rest)]
    raise ValueError(f"the help check does not know the program {head!r}: mark the block "
                     "<!-- docs-check: run --> or <!-- docs-check: not run (why) -->")


def unknown_options(options: list[str], help_output: str) -> list[str]:
    """The options (``--steps 3``, ``--nproc_per_node=2``, ``-b 4K``) not in ``help_output``."""
    named = [word.split("=")[0] for word in options if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", word)]
    return [name for name in named if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", help_output)]


# -- the docs, checked ------------------------------------------------------------------------

COMMANDS = [command for path in DOCS for command in commands_in(path)]


@pytest.mark.fast
def test_the_docs_have_commands_in_every_way():
    assert {c.check for c in COMMANDS} == {"help", "run", "not run"}
    assert any(c.path.name == "README.md" for c in COMMANDS)


@pytest.mark.fast
@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_is_in_a_shell_block(path):
    assert not unfenced_commands(path), (
        "commands outside a fenced shell block are not checked; fence them as ```sh (a transcript: ```console, "
        "with '$ ' before each command), see docs/architecture.md:\n" + "\n".join(unfenced_commands(path)))


HELPED = [c for c in COMMANDS if c.check == "help"]


@pytest.mark.parametrize("command", HELPED, ids=lambda c: c.where)
def test_each_command_uses_options_its_program_has(command):
    try:
        pairs = programs(command.text)
    except ValueError as error:
        pytest.fail(f"{command.where}: {command.text}\n{error}")
    for program, options in pairs:
        if not options and program[-1].endswith(".py"):
            continue  # a script given no options: that it exists is all there is to check (minimal.py has no --help)
        missing = unknown_options(options, help_text(program))
        assert not missing, f"{command.where}: {command.text}\n{' '.join(program[1:])} --help has no {', '.join(missing)}"


RUN = [c for c in COMMANDS if c.check == "run"]


@pytest.mark.parametrize("command", RUN, ids=lambda c: c.where)
def test_each_runnable_command_runs_as_printed(command, tmp_path):
    words = shlex.split(command.text, comments=True)
    if words[0] == "ddp-ring-hooks":  # this checkout's, installed or not
        words = [sys.executable, "-m", "ddp_ring_hooks", *words[1:]]
    done = subprocess.run(words, cwd=tmp_path, env=ENVIRONMENT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{command.where}: {command.text}\n{done.stderr[-2000:]}"
    if command.output is not None:
        assert done.stdout.rstrip().splitlines() == command.output.rstrip().splitlines(), (
            f"{command.where}: the output shown is not what `{command.text}` prints now")


# -- the README's script ----------------------------------------------------------------------

MINIMAL = ROOT / "train_examples" / "minimal.py"


@pytest.mark.fast
def test_the_readme_shows_minimal_py_verbatim():
    assert f"```python\n{MINIMAL.read_text()}```" in (ROOT / "README.md").read_text(), (
        "README.md's 'Use it in your DDP script' must show train_examples/minimal.py exactly as it is")


def test_minimal_py_trains_under_torchrun_and_advise_reads_what_it_wrote(tmp_path):
    """As printed in the README, from a directory of the user's own: torchrun, 2 gloo ranks."""
    launched = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 str(MINIMAL)], cwd=tmp_path, env=ENVIRONMENT, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = launched.communicate(timeout=240)
    finally:  # a hung rank must not outlive the test
        if launched.poll() is None:
            os.killpg(launched.pid, signal.SIGKILL)
            launched.wait()
    assert launched.returncode == 0, out[-2000:] + err[-3000:]
    assert out.count("communication per bucket, rank 0: ring over 2 ranks, 30 steps logged") == 1  # rank 0 only
    log_dir = tmp_path / "runs" / "ring"
    assert list(log_dir.glob("events.out.tfevents.*")) and (log_dir / "timeline.jsonl").is_file()
    advice = subprocess.run([sys.executable, "-m", "ddp_ring_hooks", "advise", "runs/ring"], cwd=tmp_path,
                            env=ENVIRONMENT, capture_output=True, text=True, timeout=120)
    assert advice.returncode == 0, advice.stderr
    assert "run: 2 ranks, ring, accumulate 1, bucket cap 1 MB" in advice.stdout and "(this run)" in advice.stdout


# -- the checker catches drift ----------------------------------------------------------------


@pytest.mark.fast
def test_the_checker_reads_blocks_marks_and_transcripts(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```sh\ntorchrun --standalone --nproc_per_node=2 train_examples/accumulation_sweep.py \\\n"
        "    --rounds 1   # one round\n# a comment\n```\n"
        "<!-- docs-check: not run (an install) -->\n```sh\npip install -e .\n```\n"
        "<!-- docs-check: run -->\n```console\n$ ddp-ring-hooks explain\nline 1\nline 2\n```\n"
        "    python hidden.py\n"
    )
    commands = [(c.line, c.text, c.check, c.output) for c in commands_in(page)]
    assert commands == [
        (2, "torchrun --standalone --nproc_per_node=2 train_examples/accumulation_sweep.py --rounds 1   # one round",
         "help", None),
        (8, "pip install -e .", "not run", None),
        (12, "ddp-ring-hooks explain", "run", "line 1\nline 2"),
    ]
    assert unfenced_commands(page) == [f"{page}:16: python hidden.py"]
    page.write_text("<!-- docs-check: not run -->\n```sh\npip install -e .\n```\n")
    with pytest.raises(ValueError, match="say why it is not run"):
        commands_in(page)


def test_a_renamed_flag_or_script_or_unknown_program_fails():
    (launcher, launcher_options), (script, script_options) = programs(
        "torchrun --standalone --nproc_per_node=2 train_examples/accumulation_sweep.py --rounds 1 --micro-batches 32")
    assert launcher_options == ["--standalone", "--nproc_per_node=2"]
    assert unknown_options(launcher_options, help_text(launcher)) == []
    assert unknown_options(script_options, help_text(script)) == ["--micro-batches"]  # it is --min-micro-batches
    with pytest.raises(ValueError, match="no script train_examples/gone.py"):
        programs("python train_examples/gone.py")
    with pytest.raises(ValueError, match="does not know the program 'nvidia-smi'"):
        programs("nvidia-smi -L")
    assert [p for p, _ in programs("OMP_NUM_THREADS=1 python -m ddp_ring_hooks advise runs/ring && tensorboard --logdir x")] == [
        (sys.executable, "-m", "ddp_ring_hooks", "advise"), (sys.executable, "-m", "tensorboard.main")]


def test_no_file_holds_a_merge_conflict_marker():
    """A merge left unresolved in a tracked file (it happened once, in the README)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    marker = re.compile(r"^(<<<<<<< |>>>>>>> |=======$)", re.MULTILINE)
    conflicted = [
        name for name in tracked
        if name.endswith((".md", ".py", ".toml", ".txt", ".cfg", ".yml", ".yaml")) or "/" not in name
        if (ROOT / name).is_file() and marker.search((ROOT / name).read_text(errors="replace"))
    ]
    assert conflicted == [], f"merge conflict markers in {conflicted}: resolve them"
