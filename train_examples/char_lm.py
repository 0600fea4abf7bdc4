"""The workload of the training examples: a small character-level transformer language model.

Data. The text ships with Python itself: the source files of a few standard-library modules
(``argparse``, ``dataclasses``, ``typing``, ...; about 440 KB), read from the running
interpreter. Nothing is downloaded, and every rank reads the same bytes. Like char-rnn on the
Linux sources, the model learns to write Python. Tokens are the bytes of the UTF-8 text (a
vocabulary of 256; the sources are nearly all ASCII, so a byte is a character).

::

    corpus  b"def parse_args(self, args=None, namespace=None): ..."
              |<------ window 0 ------>|<------ window 1 ------>| ...   (seq_len + 1 bytes)
    sample    x = window[:-1]   y = window[1:]      (predict the next byte)

Model. A GPT-style decoder: byte and position embeddings, ``num_layers`` pre-norm blocks
(causal self-attention, then an MLP), a final norm and an untied output head. The defaults
(width 256, 4 layers) give about 3.3 M parameters, 13 MB of fp32 gradients: with
``bucket_cap_mb=2`` DDP splits them into about 7 buckets, so the hook sees several buckets
per step, as in real training.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddp_ring_hooks.interrupts import wait_for_forwarded_ctrl_c
from ddp_ring_hooks.machine import oversubscription_warning
from ddp_ring_hooks.telemetry.timeline import TIMELINE_FILE

# Standard-library modules whose source is the training text, in this order.
CORPUS_MODULES = (
    "argparse",
    "dataclasses",
    "typing",
    "functools",
    "collections",
    "textwrap",
    "heapq",
    "contextlib",
)
VOCAB_SIZE = 256


def read_corpus(modules: tuple[str, ...] = CORPUS_MODULES) -> bytes:
    """The concatenated source files of ``modules``, as bytes (one token per byte)."""
    texts = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise ValueError(
                f"cannot read the source of module {name!r}; pick standard-library modules "
                "that are plain .py files (e.g. argparse, typing)"
            )
        texts.append(Path(spec.origin).read_bytes())
    return b"\n\n".join(texts)


class ByteWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: inputs and next-byte targets."""

    def __init__(self, corpus: bytes, seq_len: int) -> None:
        if len(corpus) < seq_len + 1:
            raise ValueError(f"the corpus ({len(corpus)} bytes) is shorter than one window ({seq_len + 1})")
        self.tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the language model."""

    seq_len: int = 128
    width: int = 256
    num_layers: int = 4
    num_heads: int = 4


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.attention_norm = nn.LayerNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.attention_out = nn.Linear(config.width, config.width)
        self.mlp_norm = nn.LayerNorm(config.width)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, 4 * config.width),
            nn.GELU(),
            nn.Linear(4 * config.width, config.width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention_out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


class CharLanguageModel(pl.LightningModule):
    """A byte-level GPT trained with AdamW; ``training_step`` returns the next-byte loss."""

    def __init__(
        self,
        *,
        seq_len: int = 128,
        width: int = 256,
        num_layers: int = 4,
        num_heads: int = 4,
        learning_rate: float = 3e-4,
    ) -> None:
        super().__init__()
        if width % num_heads:
            raise ValueError(f"width ({width}) must be a multiple of num_heads ({num_heads})")
        self.save_hyperparameters()
        config = ModelConfig(seq_len=seq_len, width=width, num_layers=num_layers, num_heads=num_heads)
        self.token_embedding = nn.Embedding(VOCAB_SIZE, width)
        self.position_embedding = nn.Embedding(seq_len, width)
        self.blocks = nn.Sequential(*(Block(config) for _ in range(num_layers)))
        self.final_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB_SIZE)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        return self.head(self.final_norm(self.blocks(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self(inputs)
        loss = F.cross_entropy(logits.view(-1, VOCAB_SIZE), targets.reshape(-1))
        # Bits per byte is the loss in base 2: 8 means random bytes, ~2 is readable Python.
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/bits_per_byte", loss / math.log(2))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)


def add_model_arguments(parser, *, seq_len: int = 64) -> None:
    """The flags that shape the model and its bucketing, shared by every script that trains it."""
    parser.add_argument("--seq-len", type=int, default=seq_len, help="bytes per training sequence (default: %(default)s)")
    parser.add_argument("--width", type=int, default=256, help="model width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    parser.add_argument("--bucket-cap-mb", type=float, default=2.0,
                        help="DDP bucket size in MiB; small enough for several buckets (default: %(default)s)")
    parser.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto",
                        help="auto: one GPU per process (NCCL) when the node has enough, else CPU (gloo) "
                             "(default: %(default)s)")


def model_from_args(args, **overrides) -> CharLanguageModel:
    """The model the flags of :func:`add_model_arguments` describe."""
    return CharLanguageModel(
        seq_len=args.seq_len, width=args.width, num_layers=args.layers, num_heads=args.heads, **overrides
    )


def make_dataloader(*, seq_len: int, micro_batch: int, seed: int = 0) -> DataLoader:
    """Shuffled micro-batches of byte windows (Lightning adds the DistributedSampler)."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        ByteWindows(read_corpus(), seq_len),
        batch_size=micro_batch,
        shuffle=True,
        drop_last=True,
        generator=generator,
    )


def torchrun_placement(accelerator: str = "auto") -> dict[str, object]:
    """``Trainer`` arguments for the processes torchrun started: one GPU per process (NCCL) when
    this node has enough of them, else CPU (gloo).

    torchrun sets ``LOCAL_WORLD_SIZE`` (processes on this node) and ``WORLD_SIZE`` (all of
    them); Lightning wants the same numbers as ``devices`` and ``num_nodes``. Without
    torchrun this is one process on one device. ``accelerator="auto"`` takes the GPUs only
    when every process on the node gets its own (NCCL refuses two ranks on one GPU), and says
    so on rank 0 when it falls back to the CPU; ``"cpu"`` and ``"gpu"`` force the choice.
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ.get("WORLD_SIZE", str(local)))
    if world % local:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}; launch with torchrun")
    gpus = torch.cuda.device_count()
    if accelerator == "gpu" and gpus < local:
        raise SystemExit(f"--accelerator gpu: {local} processes on this node but {gpus} GPU(s); "
                         f"launch with --nproc_per_node={gpus} or use --accelerator cpu")
    if accelerator == "auto":
        accelerator = "gpu" if gpus >= local else "cpu"
        if 0 < gpus < local and os.environ.get("RANK", "0") == "0":
            print(f"note: {local} processes on this node but {gpus} GPU(s), and NCCL needs one GPU per "
                  f"process: training on CPU (gloo). Launch with --nproc_per_node={gpus} for the GPUs.",
                  flush=True)
    return {"accelerator": accelerator, "devices": local, "num_nodes": world // local}


def warn_if_oversubscribed(accelerator: str = "auto") -> None:
    """On rank 0, say what more CPU processes than cores do to the numbers (nothing on GPUs)."""
    crowded = oversubscription_warning(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if crowded and os.environ.get("RANK", "0") == "0" and torchrun_placement(accelerator)["accelerator"] == "cpu":
        print(crowded, flush=True)


def fit_or_interrupt(trainer: pl.Trainer, *args, **kwargs) -> None:
    """``trainer.fit``, where Ctrl-C comes out as ``KeyboardInterrupt``: Lightning catches it,
    shuts the fit down and raises ``SystemExit(1)``, which a caller cannot tell from a failure.

    Also when a peer took Ctrl-C first: torchrun forwards the signal to one rank after another,
    and a peer that has left fails this rank's next collective ("Connection closed by peer")
    before this rank's own signal arrives (``ddp_ring_hooks/interrupts.py``)."""
    try:
        trainer.fit(*args, **kwargs)
    except SystemExit:
        if trainer.interrupted:
            raise KeyboardInterrupt from None
        raise
    except Exception as error:
        wait_for_forwarded_ctrl_c(error)  # KeyboardInterrupt if this rank's Ctrl-C comes
        raise


def save_timeline(state, directory: str | os.PathLike) -> Path:
    """Write the hook state's timeline (its last ``keep`` steps) as ``directory/timeline.jsonl``,
    the file ``ddp-ring-hooks advise DIRECTORY`` reads.

    The strategy takes no ``log_dir`` here: with one, the hook would write its own ``comm/*``
    events beside the ones ``CommTimingLogger`` puts into the Trainer's run."""
    path = Path(directory) / TIMELINE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(record.to_json() + "\n" for record in state.timeline.records()))
    return path


def quiet_lightning() -> None:
    """Keep the examples' output to what they print: no banner lines, no known harmless warnings."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    # num_workers=0 is the right choice on a few CPU cores; the data is in memory already.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*Your model can run with static graph.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")  # lightning 2.6 calls a torch API deprecated in 2.13
