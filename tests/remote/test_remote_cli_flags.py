"""`kprof run --remote NAME` reaches the remote path through the CLI's own flags; --remote-set needs --remote."""

import json

import pytest

from kprof.cli import main

SPEC = ["--spec", '{"m": 8, "n": 8, "k": 8, "dtype": "fp32"}']


def test_remote_refuses_db_through_the_cli(remote_yaml, capsys, tmp_path):
    remote_yaml("remotes:\n  sub:\n    kind: slurm\n    launch:\n      slurm:\n        cluster: local\n")
    assert main(["run", "single_gemm", "--backend", "torch-cpu", *SPEC, "--remote", "sub", "--db", "x.db",
                 "--output-dir", "out"]) == 2
    assert "--db" in capsys.readouterr().err
    assert not (tmp_path / "x.db").exists() and not (tmp_path / "out").exists()


def test_remote_needs_output_dir_through_the_cli(remote_yaml, capsys):
    remote_yaml("remotes:\n  sub:\n    kind: slurm\n    launch:\n      slurm:\n        cluster: local\n")
    assert main(["run", "single_gemm", "--backend", "torch-cpu", *SPEC, "--remote", "sub"]) == 2
    assert "--output-dir" in capsys.readouterr().err


def test_remote_set_without_remote_is_refused(capsys, tmp_path):
    assert main(["run", "single_gemm", "--backend", "torch-cpu", *SPEC, "--remote-set", "launch.slurm.time=5"]) == 2
    assert "--remote NAME" in capsys.readouterr().err
    assert not (tmp_path / "profile.db").exists()


def test_remote_set_is_one_key_value_per_flag_in_help_and_use(capsys, tmp_path):
    assert main(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--remote-set KEY=VALUE Change one of the remote's settings" in out and "repeatable" in out
    assert main(["run", "--backend", "torch-cpu", "--remote-set", "launch.slurm.time=5", "--remote-set",
                 "launch.slurm.gpus=1", "single_gemm", *SPEC]) == 2
    assert "error: --remote-set 'launch.slurm.time=5' changes a remote's settings; give --remote NAME" in \
        capsys.readouterr().err
    assert not (tmp_path / "profile.db").exists()


COLLECTIVE = ["all_reduce", "--backend", "nccl", "--gpu-name", "NVIDIA H200", "--spec",
              '{"message_size_bytes": 1048576, "dtype": "bf16", "world_size": 4}']


@pytest.mark.slow
def test_a_slurm_remote_asks_for_the_gpus_the_specs_need(remote_yaml, capsys):
    """A world_size 4 collective: each job asks for 4 GPUs (it asked for 1, and the worker found 1 of the 4 it
    needs). The job itself fails here (no GPU); what it asked for is in remote-run.json."""
    remote_yaml("remotes:\n  sub:\n    kind: slurm\n    launch:\n      slurm: {time: 5, cluster: local}\n")
    assert main(["run", *COLLECTIVE, "--remote", "sub", "--output-dir", "out", "--json"]) == 1
    with open("out/remote-run.json") as f:
        assert json.load(f)["engine"]["gpus_per_node"] == 4


def test_a_remote_asking_for_fewer_gpus_than_a_spec_needs_is_refused(remote_yaml, capsys, tmp_path):
    remote_yaml("remotes:\n  sub:\n    kind: slurm\n    launch:\n      slurm: {time: 5, cluster: local}\n")
    assert main(["run", *COLLECTIVE, "--remote", "sub", "--remote-set", "launch.slurm.gpus_per_node=2",
                 "--output-dir", "out"]) == 2
    err = capsys.readouterr().err
    assert "launch.slurm.gpus_per_node is 2 and a spec of this run needs 4 GPU(s); set it to 4" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "profile.db").exists()
