"""The hang-triage labs (labs/): each patch applies to today's stage 03, a missing anchor is named, and each lab,
run as its README says, prints every line its README quotes, within its --dist-timeout and a few seconds, leaving
no process behind."""

import ast
import importlib.util
import re
import subprocess
import sys
import time
import uuid

import pytest
from helpers import HANG, REPO, S03, clean_env, processes_with

spec = importlib.util.spec_from_file_location("labs_run", REPO / "labs" / "run.py")
labs = importlib.util.module_from_spec(spec)  # labs/run.py, the runner
spec.loader.exec_module(labs)

NUMBERS = [folder.name.split("_")[0] for folder in labs.LABS]


def quoted(number):
    """The lines a lab's README quotes as printed: its ```text block under `## What the tools print`; `<...>` in
    them stands for what varies (pids, line numbers, hosts, ports)."""
    folder, _ = labs.lab(number)
    readme = (folder / "README.md").read_text()
    section = readme.split("## What the tools print", 1)[1]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def pattern(line):
    return re.compile(".*".join(re.escape(part) for part in re.split(r"<[^>]*>", line)))


def test_there_are_six_labs_each_with_a_readme_that_quotes_its_diagnosis():
    assert NUMBERS == ["1", "2", "3", "4", "5", "6"]
    for number in NUMBERS:
        assert quoted(number), number


@pytest.mark.parametrize("number", NUMBERS)
def test_each_patch_applies_to_todays_stage_03(number):
    folder, module = labs.lab(number)
    stage = S03.read_text().splitlines(keepends=True)
    lines = labs.patched(stage, module.PATCH, folder.name)
    assert lines != stage
    ast.parse("".join(lines))  # still Python


def test_a_missing_anchor_is_named():
    stage = S03.read_text().splitlines(keepends=True)
    with pytest.raises(SystemExit, match="no line holds the anchor 'dist.all_gather_into_tensor"):
        labs.patched(stage, [("dist.all_gather_into_tensor(", "before", "pass")], "labs/9_test")


def test_the_diff_is_shown_without_a_run():
    out = subprocess.run([sys.executable, "labs/run.py", "1", "--diff"], cwd=REPO, env=clean_env(),
                         capture_output=True, text=True, timeout=HANG)  # fmt: skip
    assert out.returncode == 0, out.stderr
    added = [line[1:].strip() for line in out.stdout.splitlines() if line.startswith("+")]
    assert "+++ runs/lab1.py" in out.stdout and "dist.barrier()" in added
    assert "== torchrun" not in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("number", NUMBERS)
def test_each_lab_prints_what_its_readme_quotes(number, tiny_data, tmp_path):
    marker = f"LAB_TEST={uuid.uuid4()}"
    env = clean_env(**dict([marker.split("=")]))
    cmd = [sys.executable, "labs/run.py", number, "--data-dir", tiny_data, "--output-dir", tmp_path / "run"]
    start = time.monotonic()
    try:
        out = subprocess.run(list(map(str, cmd)), cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    finally:
        seconds = time.monotonic() - start
        time.sleep(1)
        left = processes_with(marker)
    assert not left, f"lab {number} left processes behind: {left}"
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for line in quoted(number):
        assert any(pattern(line).search(printed) for printed in lines), f"lab {number}: {line!r} not in\n{out.stdout}"
    assert seconds < labs.LIMIT + 15, seconds  # the runner's bound on its job, and its own start and end


@pytest.mark.slow
def test_lab_4s_probe_sees_a_new_order_each_epoch_where_set_epoch_is_called(tiny_data, tmp_path, capsys):
    """The control of lab 4: its probe alone, in stage 03 as it is, draws another first batch in each epoch."""
    folder, module = labs.lab(4)
    probe = [change for change in module.PATCH if change[1] == "before"]
    script = REPO / "runs" / f"lab4-control-{uuid.uuid4().hex[:8]}.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text("".join(labs.patched(S03.read_text().splitlines(keepends=True), probe, folder.name)))
    args = type("Args", (), {"output_dir": tmp_path / "run", "data_dir": tiny_data})
    try:
        output = labs.launch(script, labs.options(folder, module, args), module.TOOLS)
    finally:
        script.unlink()
    assert labs.drawn(output).splitlines() == [
        f"rank {rank} drew another first batch in each epoch: a new order every epoch" for rank in (0, 1)
    ], capsys.readouterr().out[-3000:]
