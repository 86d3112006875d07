"""A task with samples of different lengths: texts of random tokens, each labelled by whether it
holds token 1 more often than token 2. No two texts need be as long, so the task batches them
itself: collate() pads each batch to its longest text and hands the model a dict of the tokens and a
mask of the real ones, as Hugging Face's tokenizers do. The data is made in memory from --seed, the
same on every rank; stage 01 learns it in an epoch or two on a CPU. Copy this file for your own text
(README, "Your own model and data"):

    python 01_single_gpu/train.py --task common/tasks/text.py --epochs 2
    torchrun --standalone --nproc_per_node=2 05_fsdp/train.py --task common/tasks/text.py --epochs 2
"""

import torch
from torch import nn
from torch.utils.data import Dataset

# the token that fills a batch's shorter texts; the mask tells it apart, and no text holds it
PAD = 0


def add_arguments(group):
    group.add_argument(
        "--max-len",
        type=int,
        default=32,
        help="the longest text, in tokens; the shortest is 2 (default: 32)",
    )
    group.add_argument(
        "--vocab",
        type=int,
        default=16,
        help="distinct tokens, the padding and tokens 1 and 2 among them (default: 16)",
    )
    group.add_argument(
        "--dim", type=int, default=32, help="the width of the embeddings (default: 32)"
    )
    group.add_argument(
        "--layers",
        type=int,
        default=2,
        help="hidden layers: stage 05's blocks (default: 2)",
    )
    group.add_argument(
        "--samples",
        type=int,
        default=4000,
        help="training texts; the test set has a fifth as many (default: 4000)",
    )


def check(args):
    if args.vocab < 4:
        return (
            "--vocab must hold the padding, tokens 1 and 2 and one more: "
            f"at least 4, got {args.vocab}"
        )
    if args.max_len < 2:
        return f"--max-len must be at least 2, got {args.max_len}"
    return None


class Texts(Dataset):
    """Texts (1-D token tensors of their own lengths) and their labels: a map-style Dataset, so that
    each rank reads its own samples by index and a run resumes at the very sample where it
    stopped."""

    def __init__(self, texts, labels):
        self.texts, self.labels = texts, labels

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, index):
        return self.texts[index], self.labels[index]


def texts(count, max_len, vocab, seed):
    """`count` texts of 2 to max_len tokens drawn from `seed` (not the global RNG: the same on every
    rank), and their labels: 1 where token 1 occurs more often than token 2, else 0."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, max_len + 1, (count,), generator=g).tolist()
    tokens = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    labels = torch.tensor([int((t == 1).sum() > (t == 2).sum()) for t in tokens])
    return tokens, labels


def datasets(args):
    """(training set, test set): --samples texts, then a fifth as many for the test; --limit keeps
    the first N."""
    tokens, labels = texts(
        args.samples + max(args.samples // 5, 1), args.max_len, args.vocab, args.seed
    )
    n = args.samples
    return Texts(tokens[:n][: args.limit], labels[:n][: args.limit]), Texts(
        tokens[n:][: args.limit], labels[n:][: args.limit]
    )


def collate(samples):
    """A batch of (text, label) samples as ({"tokens": B x L, "mask": B x L}, labels): every text
    padded with PAD to the batch's longest L, the mask True on its real tokens. The stages move,
    count and split such a batch as they do a tensor (common/data.py to_device(), count(),
    chunk())."""
    tokens = nn.utils.rnn.pad_sequence(
        [text for text, _ in samples], batch_first=True, padding_value=PAD
    )
    labels = torch.stack([torch.as_tensor(label) for _, label in samples])
    return {"tokens": tokens, "mask": tokens != PAD}, labels


class Bag(nn.Module):
    """The mean of a text's token embeddings, the padding left out, through a few layers: counts of
    tokens are what the label depends on, so an average of them is enough."""

    def __init__(self, vocab, dim, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        # a list of layers: stage 05 shards each one as a block (common/models.py blocks())
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers)
        )
        self.head = nn.Linear(dim, 2)

    def forward(self, batch):
        mask = batch["mask"].unsqueeze(-1).float()
        # the mean over the real tokens alone
        x = (self.embed(batch["tokens"]) * mask).sum(1) / mask.sum(1)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # logits: the stages' default loss is cross-entropy


def model(args):
    return Bag(args.vocab, args.dim, args.layers)
