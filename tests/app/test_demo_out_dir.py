"""`weightsync demo --out-dir`: the demo deletes nothing it did not make. Found by a new user: with a
bad --store, the demo used to remove everything in --out-dir, then report the store."""

from __future__ import annotations

from pathlib import Path

from weightsync.app.cli import main
from weightsync.app.demo import DemoConfig
from weightsync.app.demo.run import OUT_DIR_MARKER, prepare_out_dir


def _plant(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    precious = directory / "thesis.tex"
    precious.write_text("three years of work")
    return precious


def test_a_bad_store_is_refused_before_out_dir_is_touched(tmp_path, capsys):
    out = tmp_path / "out"
    precious = _plant(out)
    code = main(["demo", "--quick", "--out-dir", str(out), "--store", "s4://bad"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "s4://bad" in err and "supported" in err
    assert precious.read_text() == "three years of work"
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]


def test_a_missing_vllm_is_refused_before_out_dir_is_touched(tmp_path, capsys):
    out = tmp_path / "out"
    precious = _plant(out)
    code = main(
        ["demo", "--quick", "--out-dir", str(out), "--engine", "vllm", "--vllm-python", str(tmp_path / "no-python")]
    )
    err = capsys.readouterr().err
    assert code == 2 and "needs vLLM" in err, err
    assert sorted(p.name for p in out.iterdir()) == [precious.name]


def test_a_directory_the_demo_did_not_make_is_refused_and_kept(tmp_path, capsys):
    out = tmp_path / "out"
    precious = _plant(out)
    code = main(["demo", "--quick", "--out-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "not a previous demo's output" in err and str(out) in err
    assert sorted(p.name for p in out.iterdir()) == [precious.name]


def test_a_file_as_out_dir_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("not a directory")
    assert main(["demo", "--quick", "--out-dir", str(out)]) == 2
    assert "is a file" in capsys.readouterr().err
    assert out.read_text() == "not a directory"


def test_a_previous_demos_output_is_cleared_of_what_it_wrote_and_nothing_else(tmp_path):
    out = tmp_path / "out"
    config = DemoConfig(out_dir=str(out))
    assert prepare_out_dir(config) == out.resolve()  # a new directory: made, marked
    assert (out / OUT_DIR_MARKER).is_file()
    (out / "logs" / "trainer.log").write_text("old run")
    (out / "store").mkdir()
    (out / "store" / "old-object").write_text("old version")
    (out / "summary.json").write_text("{}")
    precious = _plant(out)  # put there by the user between the runs

    prepare_out_dir(config)
    assert precious.read_text() == "three years of work"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [OUT_DIR_MARKER, "agents", "logs", "rollouts", "trainer", precious.name]
    )
    assert not any((out / "logs").iterdir())


def test_a_store_given_inside_a_previous_demos_output_is_never_deleted(tmp_path):
    out = tmp_path / "out"
    store = out / "store"
    config = DemoConfig(out_dir=str(out), store=f"file://{store}")
    prepare_out_dir(config)
    store.mkdir()
    (store / "object").write_text("the user's versions")
    prepare_out_dir(config)
    assert (store / "object").read_text() == "the user's versions"
