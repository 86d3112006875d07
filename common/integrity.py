"""Guard rail: is a sharded checkpoint whole? Before a resume reads a stage 05 checkpoint folder, every file
its .metadata lists must be there and long enough, so that a truncated or missing shard is named by file
instead of failing deep inside torch.distributed.checkpoint (or, worse, on one rank of many)."""


def damage(folder):
    """What is wrong with the sharded checkpoint `folder`, in a few words naming the file, or None."""
    from torch.distributed.checkpoint import FileSystemReader  # here: the stages that do not shard skip the import

    index = folder / ".metadata"
    if not index.is_file():
        return f"{index} is missing"
    try:
        pieces = FileSystemReader(folder).read_metadata().storage_data.values()
    except Exception as err:  # truncated or foreign: unpickling raises a dozen kinds of error
        return f"{index} cannot be read ({type(err).__name__})"
    ends = {}
    for piece in pieces:  # each piece of a tensor lies in one file, at an offset, with a length
        ends[piece.relative_path] = max(ends.get(piece.relative_path, 0), piece.offset + piece.length)
    for name, end in sorted(ends.items()):
        file = folder / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size < end:
            return f"{file} is truncated ({file.stat().st_size} of at least {end} bytes)"
    return None
