"""Slurm's variables, read strictly: node lists in Slurm's hostlist grammar, and numbers that must add up.

A node list read leniently (``node[1-`` as the host ``node``) or a rank beyond the step (SLURM_PROCID 7 of 2
tasks) once started a job whose rendezvous waited for ever; each is now one line before any rendezvous.
"""

from __future__ import annotations

import pytest

from visiontune.cluster import jobplan, slurm
from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig


@pytest.mark.parametrize(
    "text,hosts",
    [
        ("single", ["single"]),
        ("login-1.cluster.org", ["login-1.cluster.org"]),
        ("a,b,c", ["a", "b", "c"]),
        ("a[1-3,5],b[01-02]", ["a1", "a2", "a3", "a5", "b01", "b02"]),
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no padding: the lower bound has one digit
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # padded to the lower bound's width
        ("x[7]", ["x7"]),
        ("a[1-2]-ib,login5", ["a1-ib", "a2-ib", "login5"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("r[1-2]n[8-9]", ["r1n8", "r1n9", "r2n8", "r2n9"]),
        ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
        ("n[1-2],m[3],n5", ["n1", "n2", "m3", "n5"]),
        ("gpu_a[1,3]x,cpu[10-11]", ["gpu_a1x", "gpu_a3x", "cpu10", "cpu11"]),
    ],
)
def test_node_lists_expand_as_slurm_writes_them(text, hosts):
    assert slurm.expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text",
    [
        "node[1-",
        "node[1-2",
        "node[1-]",
        "node[-2]",
        "node[]",
        "node]1[",
        "node[[1-2]]",
        "node[a-b]",
        "node[3-1]",
        "node[1--2]",
        "node[1,,2]",
        "",
        "a,,b",
        "a,",
        ",a",
        "node 1",
        "node\n1",
        "node[1-2]$(reboot)",
        "n[0-999999999]",  # would be a billion hosts in memory
        "n[0-999]m[0-999]",  # a million, by multiplication
    ],
)
def test_a_node_list_that_does_not_parse_is_a_value_error(text):
    with pytest.raises(ValueError):
        slurm.expand_hostlist(text)


@pytest.mark.slow
def test_scontrol_expands_the_list_when_it_is_on_path(tmp_path, monkeypatch):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    # A stand-in that expands one list in its own way (so its answer is told from ours) and fails on any other.
    (bin_ / "scontrol").write_text('#!/bin/sh\n[ "$3" = "gpu[1-2]" ] && printf "gpu-a\\ngpu-b\\n" && exit 0\nexit 1\n')
    (bin_ / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_))
    assert slurm.hostnames("gpu[1-2]") == ["gpu-a", "gpu-b"]
    assert slurm.hostnames("cpu[3-4]") == ["cpu3", "cpu4"]  # scontrol failed: our parser
    with pytest.raises(UserError, match=r"SLURM_NODELIST='node\[1-' is not a Slurm node list"):
        slurm.hostnames("node[1-", "SLURM_NODELIST")


def _step(**changes: str | None) -> dict[str, str]:
    """Task 1 of a two-node step with one task per node; a change of None removes the variable."""
    env = {
        "SLURM_JOB_ID": "4711234",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_GPUS_ON_NODE": "4",
    }
    env.update(changes)
    return {k: v for k, v in env.items() if v is not None}


def _plan(env: dict[str, str]) -> jobplan.Plan:
    return jobplan.plan(jobplan.LaunchSettings.of(TrainConfig(data="d", strategy="ddp")), env)


def test_a_consistent_step_plans_as_before():
    p = _plan(_step())
    assert (p.source, p.nnodes, p.node_rank, p.nproc, p.master_addr, p.master_port) == (
        "Slurm",
        "2",
        1,
        4,
        "node1",
        16234,
    )


@pytest.mark.parametrize(
    "changes,words",
    [
        ({"SLURM_JOB_NODELIST": "node[1-"}, ["SLURM_JOB_NODELIST='node[1-'", "not a Slurm node list"]),
        ({"SLURM_JOB_NODELIST": "node[2-1]"}, ["SLURM_JOB_NODELIST", "runs backwards"]),
        ({"SLURM_JOB_NODELIST": "node1"}, ["SLURM_JOB_NODELIST='node1' names 1 host(s)", "SLURM_NNODES=2"]),
        ({"SLURM_PROCID": "7"}, ["SLURM_PROCID=7 is not below SLURM_NTASKS=2"]),
        ({"SLURM_NODEID": "2"}, ["SLURM_NODEID=2 is not below SLURM_NNODES=2"]),
        ({"SLURM_NODEID": "-1"}, ["SLURM_NODEID='-1' is not a whole number >= 0"]),
        ({"SLURM_PROCID": "-1"}, ["SLURM_PROCID='-1'"]),
        ({"SLURM_PROCID": "1.0"}, ["SLURM_PROCID='1.0'"]),
        ({"SLURM_PROCID": ""}, ["SLURM_PROCID=''"]),
        ({"SLURM_LOCALID": "1"}, ["SLURM_LOCALID=1 is not below this node's tasks=1"]),
        ({"SLURM_NNODES": "two"}, ["SLURM_NNODES='two'"]),
        ({"SLURM_NNODES": "0"}, ["SLURM_NNODES='0' is not a whole number >= 1"]),
        ({"SLURM_NTASKS": "0"}, ["SLURM_NTASKS='0' is not a whole number >= 1"]),
        ({"SLURM_NTASKS": "٢"}, ["SLURM_NTASKS='٢'"]),  # an Arabic-Indic 2: int() reads it, Slurm never writes it
        ({"SLURM_TASKS_PER_NODE": "1(x2"}, ["SLURM_TASKS_PER_NODE='1(x2'", "not a Slurm task count"]),
        ({"SLURM_GPUS_ON_NODE": "four"}, ["SLURM_GPUS_ON_NODE='four' is not a GPU count"]),
        ({"SLURM_JOB_ID": "12ab"}, ["SLURM_JOB_ID='12ab'"]),
    ],
)
def test_slurm_variables_that_do_not_parse_or_add_up_are_one_line_before_any_rendezvous(changes, words):
    with pytest.raises(UserError) as refused:
        _plan(_step(**changes))
    line = str(refused.value)
    assert "\n" not in line and all(w in line for w in words), line
    assert "run it under srun, or unset them" in line


def test_the_task_count_may_come_from_tasks_per_node_alone():
    env = _step(SLURM_NTASKS=None, SLURM_TASKS_PER_NODE="2(x2)", SLURM_PROCID="3", SLURM_LOCALID="1")
    assert slurm.allocation(env).ntasks == 4
    with pytest.raises(UserError, match="SLURM_PROCID=4 is not below the task count=4"):
        slurm.allocation({**env, "SLURM_PROCID": "4"})
