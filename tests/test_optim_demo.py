"""compcomm-demo: a tiny end-to-end run writes its summary and plot; subcommand dispatch."""

from __future__ import annotations

import json
import os

import compcomm.demo as demo


def test_demo_tiny_run_writes_summary_and_plot(tmp_path):
    out = tmp_path / "demo"
    rc = demo.main(["--steps", "6", "--world-size", "2", "--optimizers", "adam,onebitadam,onebitlamb",
                    "--dtypes", "fp32", "--d-model", "32", "--layers", "1", "--batch", "2",
                    "--seq", "16", "--data-bytes", "50000", "--val-batches", "2",
                    "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["optimizer"]: r for r in summary["results"]}
    assert set(rows) == {"adam", "onebitadam", "onebitlamb"}
    for r in rows.values():
        assert len(r["train_loss"]) == 6 and r["final_val_loss"] > 0
    # the compressed phase really sends far fewer bytes than the fp32 allreduce
    assert rows["onebitadam"]["compressed_steps"] > 0
    assert rows["onebitadam"]["bytes_fewer_than_adam"] > 4
    assert rows["adam"]["compressed_steps"] == 0
    assert os.path.getsize(out / "loss.png") > 1000


def test_demo_allreduce_subcommand_dispatch(capsys, monkeypatch):
    import sys
    import types

    calls = []
    fake = types.ModuleType("compcomm.demos.allreduce")
    fake.main = lambda argv: calls.append(argv) or 0
    pkg = types.ModuleType("compcomm.demos")
    pkg.allreduce = fake
    monkeypatch.setitem(sys.modules, "compcomm.demos", pkg)
    monkeypatch.setitem(sys.modules, "compcomm.demos.allreduce", fake)
    assert demo.main(["allreduce", "--sizes", "1000"]) == 0
    assert calls == [["--sizes", "1000"]]


def test_demo_zero_one_local_step_schedule_scales_with_the_run():
    # DeepSpeed's local_step_scaler 32678 is ~1/3 of a 100k-step run; the demo keeps that share
    assert demo.local_step_scaler(demo.parse_args([])) == 98
    assert demo.local_step_scaler(demo.parse_args(["--steps", "1000"])) == 327
    assert demo.local_step_scaler(demo.parse_args(["--local-step-scaler", "7"])) == 7
    assert demo.parse_args([]).local_step_clipper == 4
