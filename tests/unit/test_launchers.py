"""Which launcher started a rank and the start-up preflight, without a cluster (dsrl.core.launchers,
dsrl.core.rendezvous): Slurm's lists and variables as a real ``srun`` sets them (captured from a 2-node step of
the loopback cluster in tests/distributed/slurm_cluster.py), OpenMPI's, DeepSpeed's ``--world_info``, the
preflight's sentence. The check-in itself, over a real TCP store with ranks in threads and real time bounds, is
tests/distributed/test_preflight_store.py."""

from __future__ import annotations

import base64
import json

import pytest

from dsrl.core import launchers, rendezvous
from dsrl.core.errors import RunError
from dsrl.core.launchers import Launch, adopt, detect, expand_hostlist, expand_tasks_per_node, rank_variables

# Task 2 of `srun -N2 -n4` on the loopback cluster (nodes "localhost" and "vm", 2 tasks each), trimmed.
SLURM_TASK_2 = {
    "SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2",
    "SLURM_STEP_NODELIST": "localhost,vm", "SLURM_JOB_NODELIST": "localhost,vm", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_GTIDS": "2,3", "SLURMD_NODENAME": "vm",
}
# Rank 1 of `mpirun -n 2 -hostfile H` over two loopback hosts (OpenMPI 4.1), trimmed.
OMPI_RANK_1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "PMIX_HOSTNAME": "vm"}


@pytest.mark.parametrize("text, names", [
    ("n1", ["n1"]),
    ("localhost,vm", ["localhost", "vm"]),
    ("gpu[01-03,7]", ["gpu01", "gpu02", "gpu03", "gpu7"]),
    ("gpu[8-10],cpu-a", ["gpu8", "gpu9", "gpu10", "cpu-a"]),
    ("r[1-2]n[0-1]", ["r1n0", "r1n1", "r2n0", "r2n1"]),
    ("a[009-011].x", ["a009.x", "a010.x", "a011.x"]),
])
def test_slurm_hostlists_expand_as_scontrol_does(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text", ["gpu[1-", "gpu]1[", "gpu[a-b]"])
def test_bad_slurm_hostlists_are_refused(text):
    with pytest.raises(ValueError, match="Slurm hostlist"):
        expand_hostlist(text)


def test_slurm_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError):
        expand_tasks_per_node("2(x)")


def test_a_slurm_task_becomes_its_rank_with_the_first_node_as_master():
    launch = detect(SLURM_TASK_2)
    assert (launch.launcher, launch.rank, launch.local_rank, launch.world_size, launch.local_size) == ("slurm", 2, 0,
                                                                                                       4, 2)
    assert launch.node == "vm" and launch.master_addr == "localhost" and launch.nodes == (("localhost", 2), ("vm", 2))
    assert launch.master_port == launchers.slurm_port(12, 0) == 10120
    assert rank_variables(launch, SLURM_TASK_2) == {
        "RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_SIZE": "2", "MASTER_ADDR": "localhost",
        "MASTER_PORT": "10120", "CROSS_RANK": "1", "CROSS_SIZE": "2"}
    assert "job 12 step 0" in launch.name
    # The user's MASTER_ADDR/MASTER_PORT (exported to the step) win over the derived ones.
    chosen = detect({**SLURM_TASK_2, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29555"})
    assert (chosen.master_addr, chosen.master_port) == ("10.0.0.1", 29555)
    # Other steps of the job and the next jobs get other ports, all below the ephemeral range.
    ports = {launchers.slurm_port(job, step) for job in range(100, 110) for step in range(3)}
    assert len(ports) == 30 and all(10000 <= p < 32768 for p in ports)


def test_only_an_srun_step_is_slurm_and_a_launchers_own_rank_wins():
    batch_shell = {k: v for k, v in SLURM_TASK_2.items() if not k.startswith("SLURM_STEP")}
    assert detect(batch_shell).launcher == "none"  # `python launch/train.py` in an sbatch script: one process
    started = {**SLURM_TASK_2, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_SIZE": "4"}
    launch = detect(started, parent_cmdline=["python", "-u", "launch/train.py"])  # e.g. torchrun inside srun
    assert (launch.launcher, launch.rank, launch.world_size) == ("environment", 5, 8)
    assert rank_variables(launch, started) == {}


def test_openmpi_needs_master_addr_forwarded():
    launch = detect({**OMPI_RANK_1, "MASTER_ADDR": "127.0.0.1"})
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_size, launch.node) == ("openmpi", 1, 2, 1,
                                                                                               "vm")
    assert launch.master_port == 29500 and launch.nodes is None and not launch.problem
    env = dict(OMPI_RANK_1)
    with pytest.raises(RunError, match=r"rank 1 was started by OpenMPI's mpirun without MASTER_ADDR.*"
                                       r"\.deepspeed_env.*-x") as err:
        adopt(env)
    assert err.value.agreed and env["RANK"] == "1" and "MASTER_ADDR" not in env  # rank 1 leaves the print to rank 0


def test_another_mpi_without_rank_is_refused_not_run_as_singletons():
    with pytest.raises(RunError, match=r"PMI_SIZE=4.*--launcher openmpi"):
        detect({"PMI_RANK": "0", "PMI_SIZE": "4"})
    assert detect({"PMI_RANK": "0", "PMI_SIZE": "1"}).launcher == "none"


def test_a_plain_process_becomes_rank_0_of_1():
    env: dict[str, str] = {}
    launch = adopt(env)
    assert launch.launcher == "none" and env["RANK"] == "0" and env["WORLD_SIZE"] == "1"
    assert int(env["MASTER_PORT"]) == launch.master_port > 0


def _world_info(info: dict) -> str:
    return "--world_info=" + base64.urlsafe_b64encode(json.dumps(info).encode()).decode()


def test_deepspeed_launch_names_the_hostfile_nodes():
    parent = ["/usr/bin/python", "-u", "-m", "deepspeed.launcher.launch",
              _world_info({"127.0.0.1": [0], "127.0.0.3": [0]}), "--node_rank=0"]
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_SIZE": "1", "CROSS_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    launch = detect(env, parent_cmdline=parent)
    assert launch.launcher == "pdsh" and launch.node == "127.0.0.1"
    assert launch.nodes == (("127.0.0.1", 1), ("127.0.0.3", 1))
    one = detect(env, parent_cmdline=[*parent[:4], _world_info({"localhost": [0, 1]})])
    assert one.launcher == "deepspeed" and one.nodes == (("localhost", 2),)
    assert launchers.deepspeed_world_info(["python", "x.py", _world_info({"a": [0]})]) is None


def _launch(launcher: str, nodes, world: int) -> Launch:
    return Launch(launcher, 0, 0, world, 1, "n0", "n0", 29500, nodes, "job 7 step 0" if launcher == "slurm" else "")


def test_the_preflight_sentence_names_the_host_the_launcher_and_the_fix():
    pdsh = rendezvous.missing_sentence(_launch("pdsh", (("127.0.0.1", 1), ("127.0.0.3", 1)), 2), [1],
                                       {0: "127.0.0.1"}, 10)
    assert pdsh.startswith("preflight: host 127.0.0.3 never checked in: 1 of the job's 2 ranks (rank 1) is missing "
                           "within 10 s (dsrl.run.join_timeout_s), launched with DeepSpeed's pdsh launcher; fix: make "
                           "127.0.0.3 reachable by ssh"), pdsh
    assert "check-hosts HOSTFILE" in pdsh and pdsh.endswith("nothing was written to the output directory")
    assert pdsh.count(". ") == 0  # one sentence
    slurm = rendezvous.missing_sentence(_launch("slurm", (("a", 2), ("b", 2), ("c", 2)), 6), [3, 4, 5],
                                        {0: "a", 1: "a", 2: "b"}, 60)
    assert ("host b checked in only 1 of its 2 ranks, host c never checked in: 3 of the job's 6 ranks (ranks 3-5) are "
            "missing within 60 s") in slurm
    assert "launched with Slurm's srun (job 7 step 0); fix: see srun's error for b, c" in slurm
    assert "`sbatch --exclude=b,c`" in slurm
    mpi = rendezvous.missing_sentence(_launch("openmpi", None, 4), [2, 3], {0: "vm", 1: "vm"}, 5)
    assert ("2 of the job's 4 ranks (ranks 2-3) are missing (those that checked in run on vm; OpenMPI's mpirun does "
            "not say where the others were placed) within 5 s") in mpi and "reaches n0:29500" in mpi
    assert rendezvous.ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"


def test_cpu_ranks_share_the_hosts_cores_unless_omp_num_threads_says():
    import os

    from dsrl.core.launchers import cpu_threads_per_rank

    cores = len(os.sched_getaffinity(0))
    assert cpu_threads_per_rank(1, {}) == cores
    assert cpu_threads_per_rank(2, {}) == max(1, cores // 2)
    assert cpu_threads_per_rank(4 * cores, {}) == 1  # never 0
    assert cpu_threads_per_rank(2, {"OMP_NUM_THREADS": "3"}) is None  # the user chose
