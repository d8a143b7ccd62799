"""`kprof run --remote NAME` reaches the remote path through the CLI's own flags; --remote-set needs --remote."""

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
