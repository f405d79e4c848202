"""`kiln launch` builds the torchrun command line, and nothing else."""

import argparse

import pytest

from kiln.distributed.launch import add_arguments, torchrun_args


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_single_node_is_standalone(monkeypatch):
    monkeypatch.delenv("PET_RDZV_ENDPOINT", raising=False)
    argv = torchrun_args(_args("--nproc-per-node", "4", "--", "train", "my.toml", "--set", "train.lr=1e-3"))
    assert argv == [
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "0",
        "--standalone",
        "-m",
        "kiln",
        "train",
        "my.toml",
        "--set",
        "train.lr=1e-3",
    ]


def test_multi_node_uses_a_c10d_rendezvous(monkeypatch):
    monkeypatch.delenv("PET_RDZV_ENDPOINT", raising=False)
    argv = torchrun_args(
        _args(
            "--nproc-per-node",
            "8",
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            "node0:29500",
            "--rdzv-id",
            "job7",
            "--max-restarts",
            "3",
            "--",
            "train",
        )
    )
    assert argv == [
        "--nproc-per-node",
        "8",
        "--max-restarts",
        "3",
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "node0:29500",
        "--rdzv-id",
        "job7",
        "-m",
        "kiln",
        "train",
    ]


def test_scheduler_rendezvous_is_left_to_torchrun(monkeypatch):
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "master:23456")
    argv = torchrun_args(_args("--nproc-per-node", "8", "--", "train"))
    assert "--standalone" not in argv and "--rdzv-endpoint" not in argv


def test_bad_launches_are_refused(monkeypatch):
    monkeypatch.delenv("PET_RDZV_ENDPOINT", raising=False)
    with pytest.raises(ValueError, match="needs --rdzv-endpoint"):
        torchrun_args(_args("--nnodes", "2", "--", "train"))
    with pytest.raises(ValueError, match="give the kiln command"):
        torchrun_args(_args("--nproc-per-node", "2"))
