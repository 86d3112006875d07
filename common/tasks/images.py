"""The built-in task: classifying images. A task is what is learned; a stage is how it scales. Every
stage takes one with --task FILE (this file by default), a Python file that defines:

  model(args)           the nn.Module to train
  datasets(args)        (training set, test set) of (input, label) pairs, the label a class number
  loss(output, target)  optional: the loss to train with (default: cross-entropy, on logits or
                        log-probabilities)
  blocks(model)         optional: what stage 05 shards one at a time and recomputes (default:
                        common/models.py)
  init_weights(layer)   optional: stage 05 initialises the model layer by layer (common/models.py
                        materialise())
  weights(args)         optional: a file of whole weights every stage starts from (README: more)
  META = False          optional: stage 05 builds the model whole on the CPU, not on the meta device
  add_arguments(group)  optional: the task's own options
  check(args)           optional: what is wrong with them, in a few words, or None

This one trains pytorch/examples' MNIST CNN by default; its options choose another data set of
common/data.py and another model of common/models.py.
"""

DATASETS = ["mnist", "fashion-mnist", "cifar10", "cifar100", "synthetic"]  # common/data.py's SETS
# net fits 28x28 images, wideresnet 32x32
TESTED = {"net": DATASETS[:2], "cnn": DATASETS, "wideresnet": DATASETS[2:]}


def add_arguments(group):
    add = group.add_argument
    add("--dataset", choices=DATASETS, default="mnist", help="in --data-dir (`make data DATASET=`)")
    add("--model", choices=list(TESTED), default="net", help="common/models.py's (default: net)")
    add("--depth", type=int, default=16, help="WideResNet depth, 6n+4 (default: 16)")
    add("--width", type=int, default=4, help="WideResNet width factor (default: 4)")


def check(args):
    if args.dataset not in TESTED[args.model]:
        tested = ", ".join(TESTED[args.model])
        return f"--model {args.model} is tested with --dataset {tested}, not {args.dataset}"
    return None


def model(args):
    # imported here: the options are read without torch (a job script's check)
    from common import data, models

    spec = data.SETS[args.dataset]
    return models.build(args.model, len(spec.mean), spec.classes, spec.size, args.depth, args.width)


def datasets(args):
    from common import data

    return tuple(data.dataset(args.data_dir, args.dataset, t, args.limit) for t in (True, False))
