"""Logs: plain lines every log_every steps when stdout is not a terminal; throughput and memory in the metrics."""

import json
import re

from runtime_utils import job_dict, train_inprocess, write_dataset, write_run


def test_plain_progress_lines_off_a_terminal_and_throughput_in_metrics(tmp_path, megatron_single, capsys):
    jobs = [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=5),
            job_dict("b", write_dataset(tmp_path / "b.jsonl", 2), r=4, steps=2)]
    _, out = train_inprocess(write_run(tmp_path, jobs, out="o", capacity=1024),
                             ["logging.progress=true", "logging.log_every=2"])
    printed = capsys.readouterr().out.splitlines()
    lines = [x for x in printed if re.match(r"\w+ step \d+/\d+  ", x)]
    assert [x.split("  ")[0] for x in lines] == ["a step 2/5", "b step 2/2", "a step 4/5", "a step 5/5"], lines
    # a job is handed over (adapter written) at the boundary after its last step, not at the end of the run
    ended = [i for i, x in enumerate(printed) if x.startswith("job b: done at step 2; its adapter goes to ")]
    assert len(ended) == 1 and printed.index(lines[1]) < ended[0] < printed.index(lines[2]), printed
    assert all("tok/s" in x and "GiB" in x and "loss " in x for x in lines)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tokens_per_s"] > 0 and r["max_memory_gib"] > 0 for r in rows)
