"""Prepare a data set in DATA_DIR, once, on a machine with internet access (the login node): `make data
DATASET=NAME`. MNIST comes from the repository's vendored files, checked against their sha256 and unpacked;
the others from torchvision's downloads, which check their own. The training scripts never download:
compute nodes are often offline, and several ranks must not write into one folder at once.

    python tools/prepare_data.py [DATA_DIR] [NAME]
"""

import gzip
import hashlib
import shutil
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # common/ beside tools/, without an install
from common.guards import early  # noqa: E402

if __name__ == "__main__":  # guard: Ctrl-C in torch's import, or an error no check here names, is one line
    early.tool()

from common.checkpoint import atomic  # noqa: E402
from common.data import SETS  # noqa: E402

FILES = {  # MNIST's sha256 of the uncompressed IDX files
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}
from common.guards.check import Parser  # noqa: E402

VENDORED = Path(__file__).resolve().parent.parent / "data"  # the repository's data/: MNIST's .gz files


def download(name, data_dir, train):
    from torchvision import datasets  # here, as in PerSample: only `make data` downloads

    folder = Path(data_dir) / SETS[name].folder
    present = folder.is_dir() and any(folder.iterdir())  # torchvision reads what is there instead of downloading
    try:
        getattr(datasets, SETS[name].download)(data_dir, train=train, download=True)
    except (OSError, RuntimeError, ValueError, AssertionError) as err:  # no network: a URLError, or a mirror's
        why = str(err).splitlines()[0] if str(err).strip() else type(err).__name__  # a mirror's list: its first
        if present and not isinstance(err, OSError) and "download" not in str(err).lower():  # read, not fetched:
            # files of another set, cut short or damaged, which torchvision reads instead of downloading
            raise SystemExit(
                f"error: {folder} holds files torchvision cannot read as {name} ({why}): delete that folder and run "
                f"`python tools/prepare_data.py {data_dir} {name}` on a machine with internet access"
            ) from err
        raise SystemExit(
            f"error: cannot download {name} ({why}): run `python tools/prepare_data.py {data_dir} {name}` on a "
            f"machine with internet access, or copy its {SETS[name].folder}/ into {data_dir}"
        ) from err


def unpacked(src, folder, file):
    """The next MiB of the .gz `src`, or one line: a download cut short, or not gzip at all."""
    try:
        return src.read(2**20)
    except (OSError, EOFError, zlib.error) as err:
        raise SystemExit(f"error: {folder / file}.gz is damaged ({err}): {fetch(folder, file, False)}") from None


def fetch(folder, file, unpacked=True):
    """How to have `file` again: the repository's .gz from git (its only copy offline: never deleted), another
    folder's .gz deleted and copied again; the file unpacked from it deleted too, else it is read again."""
    gz, data_dir = folder / f"{file}.gz", folder.parent.parent
    if folder.resolve() == (VENDORED / SETS["mnist"].folder).resolve():
        gone = f"delete {folder / file}, " if unpacked else ""
        return f"{gone}restore the repository's {file}.gz (git checkout -- data/MNIST/raw/), then run `make data`"
    gone = f"{folder / file} and {gz}" if unpacked else gz
    return f"delete {gone}, then run `python tools/prepare_data.py {data_dir}`: it copies the repository's own again"


def prepare(data_dir, name="mnist"):
    """Make `name` ready in data_dir. MNIST: unpack the vendored .gz files after checking them (copied from the
    repository's data/ into another DATA_DIR), downloading only if absent; the others: torchvision's download,
    which checks them."""
    folder = Path(data_dir) / SETS[name].folder
    if name == "synthetic":
        print("synthetic is made in memory: nothing to prepare")
        return
    if name != "mnist":
        download(name, data_dir, train=True)
        download(name, data_dir, train=False)
        print(f"{name} ready in {folder}")
        return
    vendored = VENDORED / SETS[name].folder
    if not all((folder / f"{file}.gz").is_file() or (folder / file).is_file() for file in FILES):
        folder.mkdir(parents=True, exist_ok=True)
        for file in FILES:  # the repository's own copy first: no network needed
            if (vendored / f"{file}.gz").is_file() and not (folder / file).is_file():
                with open(vendored / f"{file}.gz", "rb") as src, atomic(folder / f"{file}.gz") as dst:
                    shutil.copyfileobj(src, dst)  # whole or not at all: a stop mid-copy leaves no half .gz
    if not all((folder / f"{file}.gz").is_file() or (folder / file).is_file() for file in FILES):
        download(name, data_dir, train=True)
        download(name, data_dir, train=False)
    for file, sha256 in FILES.items():
        if not (folder / file).is_file():
            part = folder / f"{file}.part"
            try:
                with gzip.open(folder / f"{file}.gz") as src, open(part, "wb") as dst:
                    while chunk := unpacked(src, folder, file):
                        dst.write(chunk)
                part.replace(folder / file)
            except OSError as err:  # the disk's (full, a quota): the .gz is whole, and is never blamed
                raise SystemExit(f"error: cannot write {part}: {err.strerror}: free some space, run it again") from None
            finally:  # a stop too: no .part is left behind
                part.unlink(missing_ok=True)
        if hashlib.sha256((folder / file).read_bytes()).hexdigest() != sha256:  # unpacked from a .gz of other data
            raise SystemExit(f"error: {folder / file} is not MNIST's (sha256 mismatch): {fetch(folder, file)}")
    print(f"MNIST ready in {folder}")


def parse(argv=None):
    cli = Parser(description="Prepare a data set in DATA_DIR (make data DATASET=NAME).")  # usage errors: one line
    cli.add_argument("data_dir", nargs="?", type=Path, default=VENDORED, metavar="DATA_DIR",
                     help="the stages' --data-dir (default: the repository's data/)")  # fmt: skip
    cli.add_argument("name", nargs="?", choices=list(SETS), default="mnist", metavar="NAME",
                     help=f"one of {', '.join(SETS)} (default: mnist)")  # fmt: skip
    args = cli.parse_args(argv)
    if str(args.data_dir) in SETS and not args.data_dir.exists():  # `prepare_data.py cifar10`: MNIST into ./cifar10
        cli.error(f"{args.data_dir} is read as DATA_DIR: give the folder first, `prepare_data.py data {args.data_dir}`")
    return args


if __name__ == "__main__":
    args = parse()
    prepare(args.data_dir, args.name)
