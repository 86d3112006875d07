"""A byte-level causal language model: a small transformer reads --seq-len bytes of a text and
predicts each next byte. Labels are (B, T), the input shifted by one; loss() flattens the tokens
(the default cross-entropy takes (B, C, ...) outputs); the metric is the perplexity, exp of the
loss per token over the whole test set: totals() sums a batch's token losses and counts its
tokens, figure() divides the epoch's sums (a mean of each batch's perplexity would be another
figure); throughput() makes the epoch line's speed tokens/s, --seq-len to a sample. The text is
made from --seed: words drawn from a small vocabulary, so that a byte after the first of a word
is mostly predictable.

    python 01_single_gpu/train.py --task common/tasks/examples/bytes.py --epochs 2
    torchrun --standalone --nproc_per_node=2 05_fsdp/train.py \
        --task common/tasks/examples/bytes.py --epochs 2
"""

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

metric = ("perplexity", "lower")
WORDS = (
    "the of and to in is was that for on with as by at from it his an were are which this".split()
)


def add_arguments(group):
    group.add_argument("--seq-len", type=int, default=32, help="bytes per sample (default: 32)")
    group.add_argument("--samples", type=int, default=2000, help="training samples (default: 2000)")
    group.add_argument("--dim", type=int, default=64, help="the transformer's width (default: 64)")


def text(n, length, seed):
    """n windows of length + 1 bytes of words drawn at random."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(WORDS), (n * length,), generator=g).tolist()
    raw = " ".join(WORDS[i] for i in picks).encode()
    return torch.tensor(list(raw[: n * (length + 1)]), dtype=torch.long).view(n, length + 1)


def datasets(args):
    train, test = (
        text(args.samples, args.seq_len, args.seed),
        text(args.samples // 5, args.seq_len, 7),
    )
    train, test = train[: args.limit], test[: args.limit]
    return TensorDataset(train[:, :-1], train[:, 1:]), TensorDataset(test[:, :-1], test[:, 1:])


class Causal(nn.Module):
    def __init__(self, seq_len, dim, layers=2):
        super().__init__()
        self.embed, self.position = nn.Embedding(256, dim), nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleList(  # stage 05's blocks
            nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, 256)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(t, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x)  # (B, T, 256): a next byte per position


def model(args):
    return Causal(args.seq_len, args.dim)


def throughput(args):
    return "tokens", args.seq_len  # each sample's labels: --seq-len next bytes


def loss(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def totals(output, target):
    summed = F.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="sum")
    return torch.stack([summed, torch.tensor(float(target.numel()), device=summed.device)])


def figure(totals):
    loss, tokens = totals  # the epoch's, all ranks'
    return torch.exp(loss / tokens)
