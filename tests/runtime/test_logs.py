"""Logs: off a terminal, plain lines (every log_every steps, at most every log_every_s seconds, each job's
first and last step); throughput and memory in the metrics; on a terminal a live table, a row per job."""

import json
import re

from runtime_utils import job_dict, train_inprocess, write_dataset, write_run


def test_plain_progress_lines_off_a_terminal_and_throughput_in_metrics(tmp_path, megatron_single, capsys):
    jobs = [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=5),
            job_dict("b", write_dataset(tmp_path / "b.jsonl", 2), r=4, steps=2)]
    _, out = train_inprocess(write_run(tmp_path, jobs, out="o", capacity=1024),
                             ["logging.progress=true", "logging.log_every=2", "logging.log_every_s=0"])
    printed = capsys.readouterr().err.splitlines()
    lines = [x for x in printed if re.match(r"\w+ step \d+/\d+  ", x)]
    assert [x.split("  ")[0] for x in lines] == ["a step 2/5", "b step 2/2", "a step 4/5",
                                                 "a step 5/5"], lines
    # a job is handed over (adapter written) at the boundary after its last step, not at the end of the run
    ended = [i for i, x in enumerate(printed) if x.startswith("job b: done at step 2; its adapter goes to ")]
    assert len(ended) == 1 and printed.index(lines[1]) < ended[0] < printed.index(lines[2]), printed
    assert all("tok/s" in x and "GiB" in x and "loss " in x and "ETA " in x for x in lines)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tokens_per_s"] > 0 and r["max_memory_gib"] > 0 for r in rows)


def test_plain_lines_are_periodic_not_one_per_step(capsys):
    """A job's first and last step, and in between at most one line per log_every_s seconds."""
    from lorafusion.runtime.telemetry.progress import Progress

    p = Progress({"a": 50, "b": 50}, log_every=1, log_every_s=3600, terminal=False)
    for step in range(1, 51):
        p.update("a", step, 1.0 / step, 100)
        p.update("b", step, 2.0 / step, 100)
    p.eval("a", 0.5)
    p.close()
    lines = capsys.readouterr().err.splitlines()
    assert [x.split("  ")[0] for x in lines] == ["a step 1/50", "b step 1/50", "a step 50/50", "b step 50/50"]
    assert "ETA 0m00s" in lines[-1]


def test_live_table_has_a_row_per_job_with_eval_loss():
    """The terminal view: a table with step/max, loss, eval loss, tokens/s and ETA per job (a job may
    join)."""
    from rich.console import Console

    from lorafusion.runtime.telemetry.progress import Progress

    p = Progress({"a": 10}, enabled=False)  # no live display started; render its table
    p.update("a", 4, 0.25, 400)
    p.eval("a", 0.3125)
    p.update("late", 1, 2.0, 50, total=20)
    console = Console(width=120, record=True)
    console.print(p._table())
    text = console.export_text()
    for word in ("job", "step", "loss", "eval loss", "tokens/s", "ETA", "4/10", "0.2500", "0.3125",
                 "late", "1/20"):
        assert word in text, (word, text)


def test_rate_and_eta_are_over_the_steps_after_the_first(capsys, monkeypatch):
    """The first step's own time is unknown to the progress view: its line shows no rate or ETA (it printed
    hundreds of billions of tokens/s: 100 tokens over ~0 s), later lines the tokens since over the time
    since."""
    from lorafusion.runtime.telemetry import progress

    clock = iter([0.0, 10.0, 12.0, 14.0, 16.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    p = progress.Progress({"a": 3}, log_every=1, log_every_s=0, terminal=False)  # t0 = 0
    p.update("a", 1, 1.0, 100)  # at 10 s
    p.update("a", 2, 0.5, 100)  # at 12 s: 100 tokens in 2 s
    p.update("a", 3, 0.25, 100)  # at 14 s: 200 tokens in 4 s
    p.close()
    lines = capsys.readouterr().err.splitlines()
    assert "  - tok/s  ETA -" in lines[0], lines[0]
    assert "  50 tok/s  ETA 0m02s" in lines[1], lines[1]
    assert "  50 tok/s  ETA 0m00s" in lines[2], lines[2]
