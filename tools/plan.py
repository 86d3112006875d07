"""Will it fit, and on how many GPUs? The memory each GPU needs for a model and batch under DDP (stages
03, 04), FSDP and HSDP (stage 05) on every allocation up to --max-gpus (part of one node, or whole nodes),
and the smallest allocation that fits, as #SBATCH lines (stage 05 on several nodes: HSDP, unless its FSDP
row alone fits: then with --full-shard). `make plan ARGS="--model wideresnet --depth 28
--width 10 --dataset cifar100 --batch-size 512 --amp --optimizer sgd --momentum 0.9 --gpu-memory 80
--gpus-per-node 4"`. The model, its blocks and its loss are the task's (--task FILE, as the stages take it);
the batch is shaped as one sample of the task's training set, which is loaded for it. The built-in task's
shapes come from common/data.py's description of its data sets: planning a CIFAR-100 job needs no download.

Per GPU:
  - weights, gradients and optimizer state: exact, from the model and the optimizer the stage trains it with
    (the task's optimizer(), else --optimizer's: the state each of torch's keeps, STATE); FSDP and HSDP keep
    each parameter's first-dimension chunk of this rank (the largest, rank 0's), as fully_shard splits it;
  - FSDP and HSDP gather one block's whole weights at a time, and prefetch the next: the two largest; under
    --grad-accum N > 1 they hold the whole model's fp32 gradients, unsharded, until the last micro-batch reduces
    them (set_requires_gradient_sync(False) on the others);
  - activations saved for backward: counted by saved-tensor hooks in one forward at per-rank batches of 2
    and 3, extrapolated (they grow linearly with the batch), with --amp as the stage applies it; stage 05's
    --checkpoint-activations keeps each block's inputs and runs the largest block again in its backward,
    and its --grad-accum holds one micro-batch at a time (DDP's rows, stages 03 and 04, take neither). On fake
    tensors, which have shapes and dtypes but no memory: a model larger than this machine's memory is counted
    too;
  - the evaluation: the tensors alive at once in a forward without gradients (each layer's input freed as the
    next is made) at the per-rank --test-batch-size, in fp32 (stages 03, 04; stage 05 as --amp casts it),
    counted on fake tensors at that batch; a column of its own, since training's activations are gone by
    then: the total counts the larger;
  - --loader device: every split of the data set, as float32 images and labels (a column of its own);
  - an allowance for the CUDA context and the allocator: ALLOWANCE, and 10 % of the rest.
With --bandwidth GB/s (or the doctor.json of tools/doctor.py), the communication time per step too.
"""

import json
import math
import sys
import weakref
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # common/ sits beside tools/
from common.guards import early  # noqa: E402

if __name__ == "__main__":  # guard: Ctrl-C in torch's import, or an error no check here names, is one line
    early.tool()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed._composable import checkpoint as recompute  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.data import default_collate  # noqa: E402

from common import cli, data, meta, models  # noqa: E402
from common.guards import check, failure, options  # noqa: E402
from common.guards.bounded import Refused, text  # noqa: E402
from common.options import flags, large, recipes  # noqa: E402

MiB = 2**20
ALLOWANCE = 1024 * MiB  # the CUDA context, cuBLAS/cuDNN workspaces and NCCL's buffers, per GPU
# tensors the size of a parameter that each of torch's optimizers keeps for it, by its group's settings
STATE = {
    "Adadelta": lambda group: 2,  # square_avg, acc_delta
    "Adagrad": lambda group: 1,  # sum
    "Adam": lambda group: 2 + bool(group["amsgrad"]),  # exp_avg, exp_avg_sq, max_exp_avg_sq
    "AdamW": lambda group: 2 + bool(group["amsgrad"]),
    "Adamax": lambda group: 2,  # exp_avg, exp_inf
    "ASGD": lambda group: 1,  # ax
    "NAdam": lambda group: 2,
    "RAdam": lambda group: 2,
    "RMSprop": lambda group: 1 + (group["momentum"] > 0) + bool(group["centered"]),
    "Rprop": lambda group: 2,  # prev, step_size
    "SGD": lambda group: int(group["momentum"] != 0),  # momentum_buffer
}


def builtin(args):
    """Whether --task is the built-in one, whose data sets common/data.py describes."""
    return args.task.resolve() == cli.TASK


def build(args):
    """The task's model, on the CPU, in the order fully_shard sees it."""
    torch.manual_seed(0)
    return cli.load_task(args.task).model(args)


SPREAD = 1000  # the samples of a task's training set looked at for the largest


def sample(args, task):
    """((input, label) shaped as the largest of the task's training samples, the test set's size): for the built-in
    task, from the description of its data set (its files need not be here); for another, the one of most elements
    among SPREAD samples spread over its training set: a batch is padded to its longest sample (a text task's
    collate()), and the first one may be short."""
    if builtin(args):
        spec = data.SETS[args.dataset]
        tests = min(SPLITS[args.dataset][1], args.limit or SPLITS[args.dataset][1])
        return (torch.zeros(len(spec.mean), spec.size, spec.size), torch.tensor(0)), tests
    train, test = task.datasets(args)
    spread = sorted({i * len(train) // min(len(train), SPREAD) for i in range(min(len(train), SPREAD))})
    size = lambda s: sum(t.numel() for t in pytree.tree_leaves(s) if torch.is_tensor(t))  # noqa: E731
    return max((train[i] for i in spread), key=size), len(test)  # tensors, or dicts, lists and tuples of them


SPLITS = {"mnist": (60_000, 10_000), "fashion-mnist": (60_000, 10_000), "cifar10": (50_000, 10_000),
          "cifar100": (50_000, 10_000), "synthetic": (50_000, 10_000)}  # images in the training and test sets  # fmt: skip


def on_device(args):
    """--loader device: every split of the built-in data set on each GPU, its images normalized to float32 and
    its labels (common/options/loaders.py OnDevice; a task's own data set it refuses, as the stages do)."""
    if not builtin(args):
        sys.exit(f"error: --loader device holds the built-in data sets (common/data.py), not --task {args.task}'s")
    spec = data.SETS[args.dataset]
    images = sum(min(n, args.limit or n) for n in SPLITS[args.dataset])
    return images * (len(spec.mean) * spec.size**2 * 4 + 8)  # float32 pixels, an int64 label


def trained_with(args, task, model):
    """The optimizer the stages train `model` with, built over its fake weights: the task's optimizer(args,
    model), else --optimizer's (its state: STATE); one line for another kind, whose state it cannot count."""
    own = hasattr(task, "optimizer") and task.optimizer(args, model)
    optimizer = own or recipes.optimizer(args, model.parameters())
    if type(optimizer).__name__ not in STATE or type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
        sys.exit(
            f"error: the task's optimizer() is a {type(optimizer).__module__}.{type(optimizer).__name__}, whose "
            f"state the planner cannot count: it counts torch.optim's {', '.join(STATE)}"
        )
    return optimizer


def shard_bytes(parameters, ranks):
    """Bytes of these weights that rank 0 holds when fully_shard splits every parameter over `ranks`: the
    first chunk of its first dimension (torch.chunk's, as FSDP2 lays it out)."""
    total = 0
    for p in parameters:
        rows = p.shape[0] if p.dim() else 1
        total += min(math.ceil(rows / ranks), rows) * (p.numel() // max(rows, 1)) * p.element_size()
    return total


def activation_bytes(args, model, loss_fn, batch, blocks):
    """(bytes saved for backward by one forward and loss of the (fake) `batch`, the most of them saved inside one
    of `blocks`), as the stages train (dropout, BatchNorm in train mode; --amp in bf16; --checkpoint-activations'
    blocks: their inputs alone): tensors counted once by storage, parameters left out (they are the weights).
    Fake tensors have no addresses: a storage is told by its object."""
    x, y = batch
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    saved, inside, within = {}, [None], {}  # within: block -> its storages

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in weights:
            saved[storage._cdata] = storage.nbytes()
            within.setdefault(inside[0], {})[storage._cdata] = storage.nbytes()
        return tensor

    hooks = [b.register_forward_pre_hook(lambda b, _: inside.__setitem__(0, b)) for b in blocks]
    hooks += [b.register_forward_hook(lambda *_: inside.__setitem__(0, None)) for b in blocks]
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
            loss = loss_fn(model(x), y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    for hook in hooks:
        hook.remove()
    return sum(saved.values()), max((sum(v.values()) for b, v in within.items() if b is not None), default=0)


class Live(TorchDispatchMode):
    """The most bytes of tensors alive at once while it is on, the storages of `kept` aside (the weights, the
    batch): a storage counts from the operation that makes it until the last tensor on it is freed; fake tensors
    too (their storages' Python objects are not kept alive: the tensors are followed)."""

    def __init__(self, kept):
        super().__init__()
        self.live = self.peak = 0
        self.kept, self.tensors = set(kept), {}  # storage -> [its bytes, tensors alive on it]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            key = t.untyped_storage()._cdata if isinstance(t, torch.Tensor) else None
            if key is None or key in self.kept:
                continue
            if key not in self.tensors:
                self.tensors[key] = [t.untyped_storage().nbytes(), 0]
                self.live += self.tensors[key][0]
                self.peak = max(self.peak, self.live)
            self.tensors[key][1] += 1
            weakref.finalize(t, self.freed, key)
        return out

    def freed(self, key):
        self.tensors[key][1] -= 1
        if not self.tensors[key][1]:
            self.live -= self.tensors.pop(key)[0]


def evaluation_bytes(model, loss_fn, batch, amp):
    """Bytes alive at once in an evaluation's forward and loss of the (fake) `batch`, the batch included: no
    gradient, BatchNorm in eval mode, under bf16 autocast where `amp` (stage 05's policy; 01-04 evaluate in fp32)."""
    x, y = batch
    tensors = [t for t in pytree.tree_leaves(batch) if torch.is_tensor(t)]
    kept = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers(), *tensors]}
    model.eval()
    with torch.no_grad(), Live(kept) as live, torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss_fn(model(x), y)
    model.train()
    return live.peak + sum(t.untyped_storage().nbytes() for t in tensors)


class Measured(NamedTuple):
    model: torch.nn.Module
    plain: tuple  # activations saved for backward: (bytes at a per-rank batch of 1, bytes per further sample)
    kept: tuple  # the same, as stage 05 keeps them (--checkpoint-activations)
    unit: int  # parameters of the largest unit FSDP gathers
    next_unit: int  # of the next largest, prefetched while it runs
    evaluated: dict  # {(amp, a rank's test batch): bytes} of an evaluation, at each batch of 1 to --max-gpus
    tests: int  # samples in the test set
    on_meta: bool  # stage 05 builds it on the meta device (else whole on each rank's CPU: the task's META = False)
    optimizer: torch.optim.Optimizer


def measure(args):
    """What does not depend on the number of GPUs: the model, its activations at per-rank batches 1 and 2 (from
    2 and 3: BatchNorm refuses to train on one sample), batched by the task's collate() as the stages do,
    and the largest unit FSDP gathers (a block worth a gather, or the root's: the rest). On fake tensors
    that pass for the CPU's, so that autocast casts them as in the stage (meta tensors it leaves in fp32);
    under --amp they keep BatchNorm's per-channel statistics in bf16 where the CPU keeps fp32: a few bytes.
    The task's parts as the stages take them: its loss, else cross-entropy; its blocks, else models.blocks()."""
    task = cli.load_task(args.task)
    example, tests = sample(args, task)  # real data, read before the fake mode
    loss_fn, blocks = getattr(task, "loss", F.cross_entropy), getattr(task, "blocks", models.blocks)
    collate = getattr(task, "collate", default_collate)
    batches = [collate([example] * size) for size in (2, 3)]
    with FakeTensorMode() as fake:
        model = build(args)
        units = [sum(p.numel() for p in block.parameters()) for block in models.gathered(blocks(model))]
        units.append(sum(p.numel() for p in model.parameters()) - sum(units))
        fakes = [pytree.tree_map(lambda t: fake.from_tensor(t) if torch.is_tensor(t) else t, b) for b in batches]
        plain = [activation_bytes(args, model, loss_fn, batch, blocks(model)) for batch in fakes]
        kept = [total for total, _ in plain]  # DDP's (stages 03, 04 recompute nothing), and stage 05's without
        if args.checkpoint_activations:  # stage 05: each block's inputs, and one block's own again in its backward
            for block in blocks(model):
                recompute(block)
            again = zip(fakes, plain, strict=True)
            kept = [activation_bytes(args, model, loss_fn, batch, [])[0] + largest for batch, (_, largest) in again]
        # an evaluation's peak is the largest of its tensors alive at once: not linear in the batch, so counted at
        # each batch it runs at (fake tensors cost nothing), its samples collated as fakes: no memory either
        fake_example = pytree.tree_map(lambda t: fake.from_tensor(t) if torch.is_tensor(t) else t, example)
        sizes = {tested(args, tests, n) for n in range(1, args.max_gpus + 1)}
        evaluated = {
            (amp, size): evaluation_bytes(model, loss_fn, collate([fake_example] * size), amp)
            for amp in {False, args.amp}
            for size in sizes
        }
        unit, next_unit = sorted(units, reverse=True)[:2] if len(units) > 1 else (units[0], 0)
        plain = line(total for total, _ in plain)
        on_meta = getattr(task, "META", True)
        return Measured(
            model, plain, line(kept), unit, next_unit, evaluated, tests, on_meta, trained_with(args, task, model)
        )


def tested(args, tests, world_size):
    """A rank's evaluation batch: --test-batch-size, or its share of the test set where that is fewer."""
    return min(args.test_batch_size, math.ceil(tests / world_size))


def line(at_2_and_3):
    """(bytes at a per-rank batch of 1, bytes per further sample) of bytes measured at batches 2 and 3 (BatchNorm
    refuses to train on one sample): activations grow linearly with the batch."""
    two, three = at_2_and_3
    return 2 * two - three, three - two


def micro_batches(args, world_size):
    """(how many micro-batches stage 05 runs a rank's share of the batch in, the size of the first): its own chunk(),
    which makes fewer than --grad-accum where the share does not split so (10 samples in 6: five of 2)."""
    slices = large.chunk(torch.empty(max(args.batch_size // world_size, 1)), args.grad_accum)
    return len(slices), len(slices[0])


def per_gpu(args, world_size, measured):
    """{strategy: {component: bytes}} for DDP (stages 03, 04: the whole batch of a rank at once, no block
    recomputed), FSDP and, on several nodes, HSDP (stage 05's there without --full-shard), at `world_size`
    GPUs. Stage 05 holds one micro-batch's activations at a time (--grad-accum: the first, the largest)."""
    model, plain, kept, optimizer = measured.model, measured.plain, measured.kept, measured.optimizer
    per_rank = args.batch_size // world_size
    slices, micro = micro_batches(args, world_size)
    # the block in use and the next, prefetched; bf16 under --amp
    gathered = (measured.unit + measured.next_unit) * (2 if args.amp else 4)
    plans = {"DDP": 1, "FSDP": world_size}
    per_node = min(args.gpus_per_node, world_size)
    if world_size > per_node and not args.full_shard:
        plans["HSDP"] = per_node
    result = {}
    for name, ranks in plans.items():
        weights = shard_bytes(model.parameters(), ranks)
        accumulated = name != "DDP" and slices > 1  # every micro-batch's but the last: unsharded
        state = sum(
            STATE[type(optimizer).__name__](g) * shard_bytes(g["params"], ranks) for g in optimizer.param_groups
        )
        one, more = plain if name == "DDP" else kept
        batch = per_rank if name == "DDP" else micro
        evaluation = measured.evaluated[args.amp and name != "DDP", tested(args, measured.tests, world_size)]
        parts = {"weights": weights, "gradients": shard_bytes(model.parameters(), 1) if accumulated else weights,
                 "optimizer": state, "gathered": gathered if name != "DDP" else 0,
                 "activations": one + (batch - 1) * more, "evaluation": evaluation}  # fmt: skip
        if args.loader == "device":  # the data set, on each GPU
            parts["data"] = on_device(args)
        parts["allowance"] = ALLOWANCE + total(parts) // 10
        result[name] = parts
    return result


def total(parts):
    """The bytes of a row: its parts, but the smaller of training's activations and the evaluation's, which are
    never held at once."""
    return sum(parts.values()) - min(parts["activations"], parts["evaluation"])


def traffic(args, model_bytes, name, world_size):
    """(bytes a GPU sends per step within its node, across nodes), ring collectives as BENCHMARKS.md counts
    them: DDP's all-reduce of the gradients (hierarchical: within the node, then its 1/G across nodes);
    FSDP's two all-gathers of the weights for each micro-batch (--grad-accum; in bf16 under --amp) and one
    reduce-scatter of the fp32 gradients, over every rank; HSDP's the same within the node and an all-reduce of
    its 1/G shard across nodes."""
    per_node = min(args.gpus_per_node, world_size)
    nodes = world_size // per_node
    ring = lambda n: (n - 1) / n  # noqa: E731
    across = 2 * ring(nodes) * model_bytes / per_node
    if name == "DDP":
        return 2 * ring(per_node) * model_bytes, across
    sent = 2 * micro_batches(args, world_size)[0] * model_bytes / (2 if args.amp else 1) + model_bytes
    if name == "FSDP":
        flat = ring(world_size) * sent
        return (flat, 0.0) if nodes == 1 else (0.0, flat)  # on several nodes, every collective crosses them
    return ring(per_node) * sent, across


def bandwidth(args):
    """(GB/s for the communication column: --bandwidth, else what a doctor.json measured, else None; whether the
    figure holds between nodes: a doctor run on one node measured none of their links)."""
    if args.bandwidth or not args.doctor:
        return args.bandwidth, True
    fix = "give the doctor.json that tools/doctor.py wrote (<its --output-dir>/doctor.json), or --bandwidth"
    try:
        ranks = json.loads(text(Path(args.doctor)))["ranks"]  # within a size no doctor writes, before parsing
        # each rank's sweeps, [[bytes, algbw, busbw], ...] "across nodes" and "within nodes", the largest last:
        # busbw, as traffic() counts bytes (2(n-1)/n of the gradients per ring), at the largest size, the one
        # the doctor's lines report; the slowest rank and link, since a collective goes at their pace and this
        # one figure times the traffic within and across nodes alike (an upper bound, as the other columns)
        speed = min((float(sweep[-1][2]) for rank in ranks for sweep in rank["bandwidth"].values()), default=0)
        between = any("across nodes" in rank["bandwidth"] for rank in ranks)
    except OSError as err:  # missing, a folder, unreadable, a FIFO or a device
        sys.exit(f"error: --doctor {args.doctor}: {err.strerror}: {fix}")
    except Refused as err:
        sys.exit(f"error: --doctor {err}: {fix}")
    except RecursionError:  # [[[[... nested deeper than the parser recurses
        sys.exit(f"error: --doctor {args.doctor} nests deeper than any doctor's report: {fix}")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        sys.exit(f"error: --doctor {args.doctor} is not JSON, or is cut short ({err}): {fix}")
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):  # JSON of another shape
        sys.exit(f"error: --doctor {args.doctor} is not a doctor's report (no ranks' bandwidth sweeps): {fix}")
    if not speed > 0:
        sys.exit(f"error: --doctor {args.doctor} measured no bandwidth (one rank has no one to reduce with): run "
                 "the doctor with the nodes and ranks per node you plan for, or give --bandwidth")  # fmt: skip
    return speed, between


def planner(p):
    """The planner's own, beside the stages' flags (--batch-size --amp ...) and its task's (the built-in
    task's --model --depth --width --dataset)."""
    p.description = "will it fit, and on how many GPUs: memory per GPU under DDP, FSDP and HSDP"
    p.add_argument("--gpu-memory", type=options.number(float, "(0, inf)"), default=80.0, metavar="GiB",
                   help="memory of one GPU (default: 80, an H100)")  # fmt: skip
    p.add_argument(
        "--gpus-per-node", type=options.number(int, options.POSITIVE), default=4, help="GPUs in one node (default: 4)"
    )
    p.add_argument("--bandwidth", type=options.number(float, "(0, inf)"), metavar="GBps",
                   help="GB/s between nodes per GPU: adds the communication time per step")  # fmt: skip
    p.add_argument("--doctor", metavar="doctor.json",
                   help="the report of tools/doctor.py: the slowest bandwidth it measured, instead of --bandwidth")  # fmt: skip
    p.add_argument(
        "--max-gpus",
        type=options.number(int, options.POSITIVE),
        default=16,
        help="the largest allocation to show (default: 16)",
    )


def parse(argv=None):
    return check.parse_args(argv, [flags.large, planner])[0]


def main(argv=None):
    args = parse(argv)
    limit, (speed, between) = args.gpu_memory * 2**30, bandwidth(args)
    if args.loader == "device":
        on_device(args)  # a task's own data set: its line before any other
    try:
        measured = measure(args)
    except RuntimeError as err:  # a tensor of more than 2^63 bytes, even fake: --width 1000000000
        fix = "a smaller --width or --depth" if builtin(args) else f"smaller options of {args.task}"
        sys.exit(f"error: this model cannot be counted ({str(err).splitlines()[0]}): {fix}")
    except failure.REFUSALS as err:
        if not failure.refusal(err):  # the task's own error: one line with its place (early.tool())
            raise
        sys.exit(failure.refusal(err))  # the lesson's (--depth 15): a line that names the fix
    model_bytes, optimizer = shard_bytes(measured.model.parameters(), 1), measured.optimizer
    own = type(optimizer) is not recipes.OPTIMIZERS[args.optimizer]
    kind = f"the task's {type(optimizer).__name__}" if own else args.optimizer
    parameters = sum(p.numel() for p in measured.model.parameters())
    count = f"{parameters / 1e6:.1f} M parameters" if parameters >= 1e5 else f"{parameters:,} parameters"
    name = f"{args.model} ({count}) on {args.dataset}" if builtin(args) else f"{args.task} ({count})"
    print(f"{name}, global batch {args.batch_size}"
          f"{', --amp' if args.amp else ''}{', --checkpoint-activations' if args.checkpoint_activations else ''}, "
          f"{kind}; GPUs of {args.gpu_memory:g} GiB, {args.gpus_per_node} per node"
          + (f"; links of {speed:g} GB/s" if speed else ""))  # fmt: skip
    device = ["data"] if args.loader == "device" else []  # a column of its own: the data set on each GPU
    columns = ["weights", "gradients", "optimizer", "gathered", "activations", "evaluation", *device, "allowance"]
    columns += ["total GiB", "fits", *(["comm. ms/step"] if speed else [])]
    print("\n| GPUs | strategy | " + " | ".join(columns) + " |\n|---|---|" + "---|" * len(columns))
    best = None
    for world_size in range(1, args.max_gpus + 1):
        if args.batch_size % world_size or (world_size > args.gpus_per_node and world_size % args.gpus_per_node):
            continue  # the global batch splits evenly; part of one node, or whole nodes
        fitting = []
        for name, parts in per_gpu(args, world_size, measured).items():
            row = total(parts)
            cells = " | ".join(f"{parts[k] / MiB:.0f} MiB" for k in parts)
            comm = ""
            if speed:  # one bandwidth for the traffic within and across nodes: an upper bound
                comm = f" {1e3 * sum(traffic(args, model_bytes, name, world_size)) / (speed * 1e9):.2f} |"
                unknown = not between and world_size > args.gpus_per_node
                comm = " ? |" if unknown else comm  # a link within a node times no link between nodes
            print(f"| {world_size} | {name} | {cells} | {row / 2**30:.2f} | {'yes' if row <= limit else 'no'} |{comm}")
            fitting += [name] if row <= limit else []
        if best is None and fitting:  # DDP, the simplest; else HSDP, stage 05's across nodes; else FSDP
            best = (world_size, min(fitting, key=["DDP", "HSDP", "FSDP"].index))
    if speed and not between and args.max_gpus > args.gpus_per_node:
        print(f"?: {args.doctor} measured no link between nodes (a doctor on one node): run tools/doctor.slurm on "
              "the nodes you plan for, or give --bandwidth")  # fmt: skip
    print(host(measured.model, measured.on_meta))
    recommend(args, best)


def host(model, on_meta=True):
    """The host memory each rank needs for the weights, beside its process and data: stages 03-04 build the
    whole model on the CPU before moving it; stage 05 builds it on the meta device and fills one layer at a
    time on the CPU (meta.materialise), or whole on the CPU for a task's META = False; its --save-model gathers
    the whole weights on rank 0's CPU."""
    layers = [m for m in model.modules() if meta.reset_of(m)] or [model]
    layer = max(sum(t.numel() * t.element_size() for *_, t in meta.held(m, True)) for m in layers)
    whole = sum(t.numel() * t.element_size() for *_, t in meta.held(model, True))
    sharded = (
        f"{layer / MiB:.1f} MiB (its largest layer)" if on_meta else f"{whole / MiB:.1f} MiB (META = False: whole)"
    )
    return (f"\nhost memory per rank for the weights: DDP {whole / MiB:.1f} MiB (the whole model, built on the CPU); "
            f"FSDP and HSDP {sharded}, rank 0 {whole / MiB:.1f} MiB with --save-model")  # fmt: skip


def recommend(args, best):
    if best is None:
        savers = [("--checkpoint-activations", args.checkpoint_activations), ("--amp", args.amp)]
        savers += [("--grad-accum N (the same --batch-size in N micro-batches)", args.grad_accum > 1)]
        untried = [flag for flag, given in savers if not given]
        print(f"\nnothing fits in {args.max_gpus} GPUs of {args.gpu_memory:g} GiB: stage 05 with "
              f"{', '.join(untried + ['a smaller --batch-size'])}, or larger GPUs")  # fmt: skip
        return
    world_size, name = best
    per_node = min(args.gpus_per_node, world_size)
    stage = {"DDP": "03_ddp_single_node" if world_size <= per_node else "04_ddp_multi_node"}.get(name, "05_fsdp")
    how = " with --full-shard" if name == "FSDP" and world_size > per_node else ""  # else HSDP there
    large = [flag for flag, given in (("--grad-accum", args.grad_accum > 1), ("--checkpoint-activations",
             args.checkpoint_activations)) if given]  # fmt: skip
    how = f" without {' and '.join(large)}, stage 05's" if name == "DDP" and large else how  # planned so
    print(
        f"\nthe smallest allocation that fits: {world_size} GPU{'s' * (world_size > 1)}, {name} "
        f"({stage}/job.slurm{how}):\n"
    )
    tasks = 1 if stage == "03_ddp_single_node" else per_node  # 03's one task is torchrun: a rank per GPU
    print(f"#SBATCH --nodes={world_size // per_node}\n#SBATCH --ntasks-per-node={tasks}\n#SBATCH --gres=gpu:{per_node}")


if __name__ == "__main__":
    early.run(main)  # guard: it ends with its status, even where a task left a thread running
