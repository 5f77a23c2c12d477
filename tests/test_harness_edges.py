"""Edges of the demo and the benchmark harness: verdicts that must not claim more than was
checked, argument checks at parsing, failures that keep partial results and name their cause,
and processes and namespaces that end with their launcher. CPU only, no root."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from compcomm import demo
from compcomm.bench import cli, runner, train_report, train_setups

# ------------------------------------------------------------------------------------------------
# compcomm-demo


def _row(opt, loss, bytes_per_step):
    return {"optimizer": opt, "dtype": "fp32", "final_val_loss": loss, "tokens_per_s": 1.0,
            "bytes_per_step_compressed_phase": bytes_per_step, "time_s": 1.0,
            "cpu_s_all_ranks": 1.0, "train_loss": [loss], "cum_bytes": [bytes_per_step]}


def test_demo_verdict_is_not_met_when_a_target_went_unchecked(tmp_path, capsys):
    # --optimizers adam,onebitlamb: 1-bit LAMB's bytes are checked, its loss (no lamb) is not,
    # nor 1-bit Adam's (not run): no MET, and the verdict names what was not checked
    args = demo.parse_args(["--dtypes", "fp32"])
    demo._report([_row("adam", 2.30, 714_624), _row("onebitlamb", 2.29, 22_494)], args,
                 str(tmp_path), 1.0, 2.0)
    text = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "): MET" not in text and summary["targets_met"] is None
    assert "NOT ALL CHECKED" in text and "onebitlamb fp32 loss (no lamb run)" in text
    assert "onebitadam fp32 (not run)" in text
    assert "onebitlamb fp32 loss (no lamb run)" in summary["targets_not_checked"]
    # a missed target stays NOT MET, and the unchecked ones are still named
    demo._report([_row("adam", 2.30, 714_624), _row("onebitlamb", 2.29, 714_624)], args,
                 str(tmp_path), 1.0, 2.0)
    text = capsys.readouterr().out
    assert "NOT MET (onebitlamb fp32 bytes); not checked:" in text


@pytest.mark.parametrize("argv, flag", [
    (["--world-size", "1"], "--world-size"), (["--world-size", "0"], "--world-size"),
    (["--heads", "3"], "--heads"), (["--val-batches", "0"], "--val-batches"),
    (["--batch", "0"], "--batch"), (["--data-bytes", "500"], "--data-bytes"),
])
def test_demo_rejects_bad_arguments_at_parsing(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        demo.parse_args(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [(["--calls", "0"], "--calls"),
                                        (["--world-size", "1"], "--world-size"),
                                        (["--numel", "0"], "--numel")])
def test_demo_allreduce_rejects_bad_arguments_at_parsing(argv, flag, capsys):
    from compcomm.demos import allreduce

    with pytest.raises(SystemExit) as e:
        allreduce.main(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def _averaged(rank, world):
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    avg = demo.averaged_copy(model, world)
    return [p.detach() for p in model.parameters()], [p.detach() for p in avg.parameters()]


def test_demo_evaluates_the_ranks_average():
    # 0/1 Adam's ranks drift apart between syncs: the demo evaluates their mean model
    from compcomm.testing import run_ranks

    (own0, avg0), (own1, avg1) = run_ranks(2, _averaged, timeout=120)
    for a, b, x, y in zip(own0, own1, avg0, avg1):
        assert not torch.equal(a, b)  # the copies differ, the originals are untouched
        assert torch.allclose(x, (a + b) / 2) and torch.equal(x, y)


# ------------------------------------------------------------------------------------------------
# compcomm-bench train: baseline freeze step, stopped runs


def test_train_baseline_never_compresses_with_more_baseline_steps(monkeypatch):
    from compcomm import optim

    made = []
    monkeypatch.setattr(optim, "OneBitAdam", lambda params, **kw: made.append(kw) or "opt")
    monkeypatch.setattr(optim, "OneBitLamb", lambda params, **kw: made.append(kw) or "opt")
    cfg = {"lr": 1e-3, "lamb_lr": 2e-3, "steps": 20, "baseline_steps": 100, "warmup": 5}
    for name in ("onebitadam_nofreeze", "lamb"):
        train_setups.make(name, torch.nn.Linear(2, 2), cfg, 2, torch.device("cpu"))
    assert [kw["freeze_step"] > 100 for kw in made] == [True, True]


def test_train_loss_check_gives_a_stopped_run_no_yes():
    def row(name, stopped):
        return {"profile": "eth1g", "world_size": 2, "optimizer": name, "loss": [3.0, 2.0],
                "val_curve": [[2, 2.0, 1.0, 10]], "stopped_early": stopped}

    # diverged and stopped at step 2 with the twin's loss there: not "within 2 %: yes"
    (c,) = train_report.loss_checks([row("onebitadam", True), row("onebitadam_nofreeze", False)])
    assert c["rel"] == 0 and c["stopped"] and c["within_2pct"] is False
    # the twin stopped: nothing to compare against, no verdict
    (c,) = train_report.loss_checks([row("onebitadam", False), row("onebitadam_nofreeze", True)])
    assert c["within_2pct"] is None and c["twin_stopped"]
    (c,) = train_report.loss_checks([row("onebitadam", False), row("onebitadam_nofreeze", False)])
    assert c["within_2pct"] is True


# ------------------------------------------------------------------------------------------------
# compcomm-bench (the allreduce sweep), with run_sweep replaced: no ranks are started


def _sweep_row(method, world, time_s, count=1024):
    return {"profile": "loopback", "world_size": world, "method": method, "count": count,
            "dtype": "float32", "time_s": time_s, "time_mean_s": time_s, "size_bytes": 4 * count,
            "wire_bytes": 4 * count if method != "compressed" else count // 4, "wrong": 0}


def _fake_sweeps(monkeypatch, plan):
    """runner.run_sweep replaced: ``plan[w]`` (rows, exception or None) for world size w."""
    def run_sweep(prof, w, sizes, methods, *, on_row=None, **kw):
        rows, exc = plan[w]
        for r in rows:
            if r["method"] in methods:
                on_row(r)
        if exc is not None:
            raise exc
        return [r for r in rows if r["method"] in methods]

    monkeypatch.setattr(runner, "run_sweep", run_sweep)


def _bench(tmp_path, *extra):
    return cli.main(["--profile", "loopback", "--sizes", "2^10", "--no-progress",
                     "--out", str(tmp_path), *extra])


def test_bench_append_takes_speedups_from_the_same_run_only(tmp_path, monkeypatch, capsys):
    _fake_sweeps(monkeypatch, {2: ([_sweep_row("gloo_fp32", 2, 2e-3),
                                    _sweep_row("compressed", 2, 1e-3)], None)})
    assert _bench(tmp_path, "--methods", "gloo_fp32,compressed") == 0
    _fake_sweeps(monkeypatch, {2: ([_sweep_row("compressed", 2, 4e-3)], None)})
    assert _bench(tmp_path, "--methods", "compressed", "--append") == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    comp = [r for r in rows if r["method"] == "compressed"]
    assert len(comp) == 1 and comp[0]["time_s"] == 4e-3
    # the fp32 time is the first run's: no ratio against it
    assert comp[0]["speedup_vs_fp32"] is None
    assert len({r["run"] for r in rows}) == 2
    capsys.readouterr()


def test_bench_failing_sweep_keeps_the_partial_results(tmp_path, monkeypatch, capsys):
    err = runner.SweepError("rank 1 was killed by SIGKILL (loopback, W=3)")
    _fake_sweeps(monkeypatch, {2: ([_sweep_row("gloo_fp32", 2, 2e-3)], None),
                               3: ([_sweep_row("gloo_fp32", 3, 3e-3)], err)})
    assert _bench(tmp_path, "--world-size", "2,3", "--methods", "gloo_fp32") == 1
    out = capsys.readouterr()
    assert "loopback W=3 FAILED: rank 1 was killed by SIGKILL" in out.err
    assert "Traceback" not in out.err + out.out
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert sorted(r["world_size"] for r in rows) == [2, 3]
    # Ctrl-C: what was measured is written, exit 130
    _fake_sweeps(monkeypatch, {2: ([_sweep_row("gloo_fp32", 2, 2e-3)], KeyboardInterrupt())})
    assert _bench(tmp_path / "b", "--methods", "gloo_fp32") == 130
    assert "interrupted" in capsys.readouterr().err
    assert len(json.loads((tmp_path / "b" / "results.json").read_text())["rows"]) == 1


@pytest.mark.parametrize("argv, flag", [
    (["--min-iters", "0"], "--min-iters"), (["--max-iters", "0"], "--max-iters"),
    (["--min-iters", "5", "--max-iters", "4"], "--max-iters"),
    (["--world-size", "251"], "--world-size"),
])
def test_bench_rejects_bad_arguments_at_parsing(argv, flag, tmp_path, monkeypatch, capsys):
    _fake_sweeps(monkeypatch, {})  # (a sweep started would raise KeyError)
    with pytest.raises(SystemExit) as e:
        _bench(tmp_path, *argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_bench_sizes_empty_range_says_so():
    with pytest.raises(ValueError, match="range '2\\^20..2\\^10' is empty"):
        cli.parse_sizes("2^20..2^10")
    with pytest.raises(ValueError, match="positive"):
        cli.parse_sizes("0")


@pytest.mark.parametrize("compute", ["foo", "-1", "0", "nan"])
def test_bench_project_rejects_a_bad_compute_rate(compute, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["project", "--results", str(tmp_path / "none.json"), "--compute", compute])
    assert e.value.code == 2 and "--compute" in capsys.readouterr().err


def test_bench_project_takes_a_compute_rate(tmp_path, capsys):
    assert cli.main(["project", "--results", str(tmp_path / "none.json"), "--compute", "2.5",
                     "--preset", "10gbe", "--sizes", "2^20"]) == 0
    assert "given compute (2.5 ns/elt)" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# processes: the cause of a failure, and nothing left behind

_KILLED_RANK = textwrap.dedent(
    """
    import os, signal, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    os._exit(0)
    """
)


def test_run_on_profile_names_the_killed_rank_first(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_KILLED_RANK)
    with pytest.raises(runner.SweepError) as err:
        runner.run_on_profile("loopback", 2, [str(script)], timeout=120)
    head = str(err.value).splitlines()[0]
    assert head.startswith("rank 1 was killed by SIGKILL (loopback, W=2); every process: "
                           "rank 1: killed by SIGKILL; rank 0: "), head


def test_netns_sighup_tears_down_like_sigterm(tmp_path):
    mark = tmp_path / "closed"
    code = textwrap.dedent(
        f"""
        import time
        from compcomm.bench import netns

        class Net:  # stands for a live Network (creating one needs root)
            def close(self):
                open({str(mark)!r}, "w").write("closed")

        netns._live.add(Net())
        netns._install_handlers()
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGHUP)
        assert p.wait(timeout=30) == 128 + signal.SIGHUP
        assert mark.read_text() == "closed"
    finally:
        p.kill()
        p.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # (a zombie has ended)
    except OSError:
        return False


def test_run_ranks_ranks_die_with_a_killed_launcher(tmp_path):
    # compcomm-demo killed with SIGTERM left its ranks running (run_ranks' cleanup never ran)
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(
        f"""
        import os, time
        from compcomm.testing import run_ranks

        def body(rank, world):
            open(os.path.join({str(tmp_path)!r}, f"pid{{rank}}"), "w").write(str(os.getpid()))
            time.sleep(120)

        if __name__ == "__main__":
            run_ranks(2, body, backend="none", timeout=300)
        """
    ))
    p = subprocess.Popen([sys.executable, str(script)])
    pids = []
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end and len(pids) < 2:
            time.sleep(0.2)
            pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)
                    if (tmp_path / f"pid{r}").exists() and (tmp_path / f"pid{r}").read_text()]
        assert len(pids) == 2, "the ranks did not start"
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        end = time.monotonic() + 10
        while time.monotonic() < end and any(_alive(q) for q in pids):
            time.sleep(0.2)
        assert not [q for q in pids if _alive(q)], "ranks outlived their launcher"
    finally:
        p.kill()
        p.wait()
        for q in pids:
            if _alive(q):
                os.kill(q, signal.SIGKILL)
