"""The rank helper over plain, torchrun and srun environments, and the mistakes it must catch early."""

import os
import re
from types import SimpleNamespace

import pytest
import torch

from common import cli, distributed
from common.environment import Launch, first_host, launcher, master_port, nodes, ranks_per_node
from common.guards import check, launching
from common.guards.ending import Refusal
from common.options import loaders


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node1", ["node1"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),
        ("x-1,y[9-10]", ["x-1", "y9", "y10"]),
        ("nid[0001,0003]-ib,login", ["nid0001-ib", "nid0003-ib", "login"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),  # every bracket group, the first varying slowest
        ("r[1,3]n[08-09],x", ["r1n08", "r1n09", "r3n08", "r3n09", "x"]),
    ],
)
def test_the_ranks_meet_at_the_first_host_of_the_hostlist(hostlist, hosts):
    assert first_host(hostlist) == hosts[0]  # as scontrol lists it first (tests/slurm: the real scontrol)


def test_the_first_host_of_any_hostlist_comes_at_once():
    """The ranks meet at the first host: a list of ten million (a typo's range) was expanded whole, for minutes
    and gigabytes, at every reading of the launcher's variables."""
    env = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1",
           "SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "n[1-10000000]"}  # fmt: skip
    assert first_host("n[1-10000000]") == "n1" and launcher(env).addr == "n1"  # none of the others is made


def test_an_unreadable_hostlist_is_an_error():
    with pytest.raises(SystemExit, match="cannot read the Slurm hostlist"):
        check.check_hostlist("node[a-b]")


def test_sync_bn_on_cpus_is_refused():
    with pytest.raises(SystemExit, match="--sync-bn needs GPUs"):
        launching.check_device(SimpleNamespace(no_cuda=True, sync_bn=True, compile=False), 0)


def test_plain_python_is_rank_0_of_1():
    assert launcher({}) == (0, 0, 1, None, None)
    assert launcher({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == (0, 0, 1, None, None)  # a 1-task batch job


def test_torchrun_variables_win_over_slurm():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
           "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}  # fmt: skip
    assert launcher(env) == (5, 1, 8, "n1", 29500)


def test_srun_task_gets_rank_and_rendezvous():
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0",
           "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NTASKS_PER_NODE": "2(x2)"}  # fmt: skip
    assert launcher(env) == (3, 1, 4, "gpu07", master_port(123456))  # the first node, a port from the job id
    assert "MASTER_ADDR" not in env  # values travel as return values, not through the environment


def test_srun_keeps_a_given_rendezvous():
    env = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "9",
           "SLURM_JOB_NODELIST": "n[1-2]", "MASTER_ADDR": "n2-ib", "MASTER_PORT": "29500"}  # fmt: skip
    assert launcher(env)[3:] == ("n2-ib", 29500)


def test_the_nodes_are_torchruns_agents_or_the_srun_steps_not_the_ranks_over_this_nodes_count():
    """metrics.csv's `nodes`: two torchrun agents of 3 and 1 ranks are 2 nodes, not 4 // 3 or 4 // 1 (the ranks over
    rank 0's LOCAL_WORLD_SIZE, as it was); an srun step's own count; a plain run one."""
    for local in ("3", "1"):
        torchrun = {"GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": local, "WORLD_SIZE": "4", "SLURM_STEP_NUM_NODES": "1"}
        assert nodes(torchrun) == 2 and ranks_per_node(4, torchrun) == int(local)
    assert nodes({"SLURM_STEP_NUM_NODES": "3"}) == 3 and ranks_per_node(12, {"SLURM_STEP_NUM_NODES": "3"}) == 4
    assert nodes({}) == 1 and ranks_per_node(2, {}) == 2


def test_batch_step_is_not_a_rank():
    """The fix it names holds for every stage: stages 01 and 02, which refuse several ranks, are launched as one task
    (both of the fixes it named for them were refused in turn)."""
    env = {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "6"}
    with pytest.raises(SystemExit, match=r"`srun python train.py`, .*stages 01 and 02 .*`srun --ntasks=1`"):
        check.check_environment(env)


SRUN = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "6", "SLURM_NTASKS": "2"}
# exported into srun's tasks by a job (task 0 trained alone, exit 0): refused where they contradict srun's
TORCHRUN_VARIABLES = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}


def test_torchruns_variables_in_an_srun_task_are_read_where_they_agree_or_torchrun_set_them():
    agreeing = TORCHRUN_VARIABLES | {"WORLD_SIZE": "2"}
    for env in (SRUN | {"SLURM_JOB_NODELIST": "n1"} | agreeing, SRUN | {"SLURM_JOB_NODELIST": "n1", "SLURM_PROCID": "1",
                "TORCHELASTIC_RUN_ID": "x"} | TORCHRUN_VARIABLES):  # fmt: skip
        check.check_environment(env)


@pytest.mark.parametrize(
    "env, named",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK is not set"),
        ({"RANK": "one", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "RANK='one' is not an integer"),
        ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not an integer >= 1"),
        (SRUN | {"SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS": "2(x2)"}, "SLURM_NTASKS='2(x2)'"),
        (SRUN | {"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc'"),
        (SRUN, "SLURM_JOB_NODELIST is not set"),
        (SRUN | {"SLURM_JOB_NODELIST": "n[3-1]"}, "cannot read the Slurm hostlist 'n[3-1]'"),
        (SRUN | {"SLURM_JOB_NODELIST": "n[1-2"}, "cannot read the Slurm hostlist 'n[1-2'"),
        (SRUN | {"SLURM_JOB_NODELIST": ","}, "cannot read the Slurm hostlist ','"),  # no host: each rank alone
        (SRUN | {"SLURM_JOB_NODELIST": "n1", "SLURM_PROCID": "1"} | TORCHRUN_VARIABLES, "task 1 of 2: unset RANK"),
        ({"SLURM_NTASKS": "-1"}, "SLURM_NTASKS='-1'"),
    ],
)
def test_a_missing_or_malformed_launcher_variable_is_named(env, named):
    with pytest.raises(SystemExit, match=re.escape(named)):
        check.check_environment(dict(env))  # the guard rails, before the lesson reads the variables


@pytest.mark.parametrize("port", ["http", "0", "70000"])
def test_a_master_port_out_of_range_is_named(monkeypatch, port):
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", port)
    with pytest.raises(SystemExit, match=re.escape(f"MASTER_PORT='{port}' is not an integer in [1, 65535]")):
        start(args())


def test_a_world_size_that_does_not_divide_the_batch_names_those_that_do(monkeypatch):
    for k, v in ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3"} | NOWHERE).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit, match=re.escape("run on 1, 2, 4, 8, 16, 32, 64 ranks")):
        start(args())
    monkeypatch.setenv("RANK", "1")  # the same verdict on every rank: rank 0 alone says it
    with pytest.raises(SystemExit) as exit:
        start(args())
    assert exit.value.code == 1


def test_a_huge_batch_that_the_world_size_does_not_divide_is_named_at_once(monkeypatch):
    for k, v in ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"} | NOWHERE).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit, match=re.escape("--batch-size 1000000000001 is the global batch")) as stop:
        start(SimpleNamespace(**vars(args()) | {"batch_size": 1000000000001}))  # at once: NOWHERE is not reached
    assert "run on 1, 73, 137 ranks" in stop.value.code


def test_ports_differ_between_jobs_and_stay_in_range():
    ports = {master_port(job) for job in range(1000, 1100)}
    assert len(ports) == 100 and all(1024 < p < 65536 for p in ports)
    assert master_port(123) == master_port(123)


NOWHERE = {
    "MASTER_ADDR": "nowhere.invalid",
    "MASTER_PORT": "1",
}  # had setup() tried to meet there, it would fail otherwise


def args(**kw):
    return SimpleNamespace(batch_size=64, no_cuda=False, dist_timeout=30, sync_bn=False, compile=False, **kw)


def start(args):
    """What a stage runs before setup(): the guard rails' checks of the launch, then the rendezvous (which
    none of these tests must reach: NOWHERE is no address)."""
    check.check_environment()
    launch = launcher()
    launching.check_launch(launch, args)
    launching.check_device(args, launch.local_rank)
    return distributed.setup(args)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "4", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}, "inconsistent launch"),
        ({"RANK": "1", "LOCAL_RANK": "2", "WORLD_SIZE": "4"}, "inconsistent launch"),
        ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3"}, "--batch-size 64"),
    ],
)
def test_setup_refuses_before_any_rendezvous(monkeypatch, env, message):
    for k, v in (env | NOWHERE).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit, match=message):
        start(args())


def test_local_rank_beyond_visible_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for k, v in ({"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4"} | NOWHERE).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit, match="local rank 2 but only 2 GPUs"):
        start(args())


def test_one_visible_gpu_per_task_is_device_0(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(distributed, "launcher", lambda: Launch(3, 1, 4))
    assert distributed.setup(args())[3] == torch.device("cuda", 0)


def test_fake_gpus_fall_back_to_cpu(monkeypatch):
    """A test Slurm sets CUDA_VISIBLE_DEVICES for GPUs torch cannot see: CPU (and gloo), not an error."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert distributed.setup(args())[3] == torch.device("cpu")


@pytest.mark.parametrize(
    "env, workers",
    [
        ({"SLURM_CPUS_PER_TASK": "8"}, 7),
        ({"SLURM_CPUS_PER_TASK": "8", "LOCAL_WORLD_SIZE": "2"}, 3),  # torchrun: 2 ranks share the task's CPUs
        ({"SLURM_CPUS_PER_TASK": "1"}, 0),
    ],
)
def test_default_num_workers(env, workers, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))  # the task's 8 CPUs, as Slurm binds them
    assert loaders.num_workers(SimpleNamespace(loader="classic", num_workers=None), True, env) == workers


def test_default_output_dir(tmp_path):
    script = tmp_path / "03_ddp_single_node" / "train.py"
    assert cli.default_output_dir(script, {"SLURM_JOB_ID": "77"}) == tmp_path / "runs/03_ddp_single_node/77"
    array = {"SLURM_JOB_ID": "80", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}
    assert cli.default_output_dir(script, array).name == "80_3"
    assert cli.default_output_dir(script, {}).name.startswith("local-")


@pytest.mark.parametrize("flag", ["--batch-size=0", "--epochs=-1", "--lr=0", "--num-workers=-2", "--dist-timeout=0"])
def test_parser_refuses_zero_and_negative(flag, capsys):
    with pytest.raises(SystemExit):
        check.check_args(check.parse_args([flag])[0])
    assert flag.split("=")[0] in capsys.readouterr().err


def test_a_store_shared_across_restarts_the_nodes_count_apart_is_refused():
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "1"}
    with pytest.raises(Refusal, match="export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun"):
        launching.check_restarts(shared)
    for fine in (
        {"TORCHELASTIC_USE_AGENT_STORE": "False"},
        {"GROUP_WORLD_SIZE": "1"},
        {"TORCHELASTIC_MAX_RESTARTS": "0"},
    ):
        launching.check_restarts(shared | fine)  # its own store (the job scripts'), one node, or no restart
