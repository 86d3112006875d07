"""A task that is not about images: a small transformer tells which of 4 marker tokens occurs most
often in a sequence of random tokens. The data is made in memory from --seed, the same on every
rank; an epoch takes about a second on a CPU, and stage 01 reaches 95 % after one. Copy this file to
start your own (README, "Your own model and data"):

    python 01_single_gpu/train.py --task common/tasks/sequences.py --epochs 2
    torchrun --standalone --nproc_per_node=2 05_fsdp/train.py --task common/tasks/sequences.py \
        --epochs 2 --amp
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

CLASSES = 4  # tokens 0..3 are the markers; a sequence's class is the marker it holds most often
MOST = 3  # its marker occurs 3 times, every other one 0 to 2 times


def add_arguments(group):
    group.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default: 16)")
    group.add_argument(
        "--vocab",
        type=int,
        default=16,
        help=f"distinct tokens, the first {CLASSES} the markers (default: 16)",
    )
    group.add_argument(
        "--dim", type=int, default=32, help="the width of the transformer (default: 32)"
    )
    group.add_argument(
        "--layers",
        type=int,
        default=2,
        help="transformer layers: stage 05's blocks (default: 2)",
    )
    group.add_argument(
        "--heads", type=int, default=2, help="attention heads, dividing --dim (default: 2)"
    )
    group.add_argument(
        "--samples",
        type=int,
        default=4000,
        help="training sequences; the test set has a fifth as many (default: 4000)",
    )


def check(args):
    if args.seq_len < MOST + (CLASSES - 1) * (MOST - 1):
        least = MOST + (CLASSES - 1) * (MOST - 1)
        return f"--seq-len must hold every marker: at least {least}, got {args.seq_len}"
    if args.vocab <= CLASSES:
        return f"--vocab must exceed the {CLASSES} marker tokens, got {args.vocab}"
    if args.dim % args.heads:
        return f"--heads {args.heads} must divide --dim {args.dim}"
    return None


class Transformer(nn.Module):
    def __init__(self, vocab, seq_len, dim, layers, heads):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(seq_len, dim)
        # a list of layers: stage 05 shards each one as a block (common/models.py blocks())
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, CLASSES)  # at the root, after the last block

    def forward(self, tokens):
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))  # logits: the stages' default loss is cross-entropy


def model(args):
    return Transformer(args.vocab, args.seq_len, args.dim, args.layers, args.heads)


def sequences(count, seq_len, vocab, seed):
    """`count` sequences and their classes, drawn from `seed`: the class's marker `MOST` times,
    every other marker fewer, at random places among random non-marker tokens."""
    # not the global RNG: every rank draws the same sequences
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(CLASSES, (count,), generator=g)
    counts = torch.randint(MOST, (count, CLASSES), generator=g)
    counts[torch.arange(count), labels] = MOST
    slot = torch.arange(seq_len).view(1, -1, 1)
    # slot by slot: marker 0 counts[0] times, 1, ...
    marker = (slot >= counts.cumsum(1).unsqueeze(1)).sum(2)
    tokens = torch.where(
        marker < CLASSES, marker, torch.randint(CLASSES, vocab, (count, seq_len), generator=g)
    )
    # the slots shuffled
    return tokens.gather(1, torch.rand(count, seq_len, generator=g).argsort(1)), labels


def datasets(args):
    """(training set, test set) of (tokens, class) pairs: --samples sequences, then a fifth as many
    for the test; --limit keeps the first N of each."""
    tokens, labels = sequences(
        args.samples + max(args.samples // 5, 1), args.seq_len, args.vocab, args.seed
    )
    n = args.samples
    return (
        TensorDataset(tokens[:n][: args.limit], labels[:n][: args.limit]),
        TensorDataset(tokens[n:][: args.limit], labels[n:][: args.limit]),
    )
