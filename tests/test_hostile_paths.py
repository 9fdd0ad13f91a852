"""Hostile input found by a repeated probe of the CLI: each case one error line naming the right
file or field, never a traceback. CPU, no training."""

from __future__ import annotations

import json

import pytest

from lorafusion.core.errors import ConfigError, MissingFileError


def _one_line(capsys, cmd: str, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"lorafusion {cmd}: error: "), err
    for n in needles:
        assert n in err, (n, err)
    return err


LONG = "s" * 300  # over NAME_MAX: every os.stat of it is ENAMETOOLONG


@pytest.mark.parametrize("argv", [
    ["status", LONG], ["cancel", "--job", "x", LONG], ["submit", LONG, "job.yaml"], ["train", LONG + ".yaml"],
    ["generate", LONG, "--prompts", "p.jsonl", "--out", "o.jsonl"],
])
def test_a_path_too_long_is_one_line(argv, tmp_path, monkeypatch, capsys):
    """A name over NAME_MAX (any verb, any path argument) was an OSError traceback."""
    from lorafusion.cli import main

    monkeypatch.chdir(tmp_path)
    _job_yaml(tmp_path, "")
    assert main(argv) == 2
    _one_line(capsys, argv[0], "File name too long")


def _job_yaml(tmp_path, extra: str) -> str:
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    p = tmp_path / "job.yaml"
    p.write_text("name: j\ndataset: {path: d.jsonl, format: prompt_response, max_seq_len: 64}\n"
                 "lora: {r: 4, lora_alpha: 8}\nglobal_batch_size: 1\nmax_steps: 1\n" + extra)
    return str(p)


def test_a_job_yaml_typo_lists_the_job_keys(tmp_path):
    """submit's job YAML with an unknown key listed the *run* config's keys (model, ..., output_dir) as
    expected."""
    from lorafusion.config.load import job_config_from, load_job_config

    with pytest.raises(ConfigError) as e:
        load_job_config(_job_yaml(tmp_path, "lrr: 1\n"))
    msg = str(e.value)
    assert "unknown key 'lrr'" in msg and "global_batch_size" in msg and "output_dir" not in msg, msg
    with pytest.raises(ConfigError) as e:
        job_config_from({"name": "x", "lrr": 1}, "request.json")
    assert "unknown key 'lrr'" in str(e.value) and "output_dir" not in str(e.value), str(e.value)


def test_a_non_finite_float_says_expected(tmp_path):
    """pydantic's own 'Input should be a finite number' read unlike every other message."""
    from lorafusion.config.load import load_job_config

    with pytest.raises(ConfigError) as e:
        load_job_config(_job_yaml(tmp_path, "optimizer: {lr: .nan}\n"))
    assert "optimizer.lr: expected a finite number, got nan" in str(e.value), str(e.value)


def test_export_from_a_directory_that_is_no_run(tmp_path, monkeypatch, capsys):
    """`export /tmp --out x` said '--out is inside the run directory /tmp' (no run there)."""
    from lorafusion.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["export", str(tmp_path), "--job", "a", "--out", "x"]) == 2
    err = _one_line(capsys, "export", "the directory", "it exports from")
    assert "run directory" not in err, err


def test_generate_row_with_prompt_and_messages(tmp_path):
    """A row with both 'prompt' and 'messages' decoded the messages silently; a --prompts directory was 'not
    found'."""
    from lorafusion.data.tokenizer import ByteTokenizer
    from lorafusion.inference.generate import encode_prompt, read_prompts

    row = {"prompt": "x", "messages": [{"role": "user", "content": "y"}], "job": None}
    with pytest.raises(ConfigError, match="p.jsonl:1: expected 'prompt' or 'messages', not both"):
        encode_prompt(row, ByteTokenizer(), "p.jsonl:1")
    with pytest.raises(MissingFileError, match="is a directory, expected a file"):
        read_prompts(tmp_path, ByteTokenizer(), [], 1024, tmp_path)


@pytest.mark.parametrize("rows", [1, 2])
def test_a_data_row_with_a_duplicate_key(tmp_path, rows):
    """A JSONL row with a key twice read 'If using all scalar values, you must pass an index' (one row) or
    'Trailing data at position 47' (two rows): neither names the line nor the key."""
    from lorafusion.config.load import load_job_config
    from lorafusion.data.dataset import DataError, read_rows

    job = load_job_config(_job_yaml(tmp_path, ""))
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "response": "b", "prompt": "z"}\n'
                                      + '{"prompt": "a", "response": "c"}\n' * (rows - 1))
    with pytest.raises(DataError, match=r"d.jsonl: cannot read as json: line 1: invalid JSON \(duplicate key "
                                        r"'prompt'\)"):
        read_rows(job)


def test_a_dataset_path_that_is_a_directory(tmp_path):
    """dataset.path=/tmp said 'cannot tell the file type of '/tmp' from its extension'."""
    from lorafusion.config.load import load_job_config

    (tmp_path / "data").mkdir()
    with pytest.raises(ConfigError, match="dataset.path: expected a data file, got a directory"):
        load_job_config(_job_yaml(tmp_path, ""), [f"dataset.path={tmp_path / 'data'}"])


def test_a_status_json_not_utf8_keeps_its_message(tmp_path, capsys):
    """The reason lost its first quote: "(utf-8' codec can't decode ...)"."""
    from lorafusion.cli import main

    (tmp_path / "status.json").write_bytes(b"\xff\xfe")
    assert main(["status", str(tmp_path)]) == 2
    _one_line(capsys, "status", "not a readable run status (not UTF-8 text (byte 0))")


def _rows_error(tmp_path, name: str, text: str) -> str:
    from lorafusion.config.load import load_job_config
    from lorafusion.data.dataset import DataError, read_rows

    (tmp_path / name).write_text(text)
    job = load_job_config(_job_yaml(tmp_path, ""), [f"dataset.path={tmp_path / name}"])
    with pytest.raises(DataError) as e:
        read_rows(job)
    return str(e.value)


@pytest.mark.parametrize("nested", [False, True])
def test_a_json_array_row_with_a_duplicate_key_is_named(tmp_path, nested):
    """A JSON array (not JSON lines) with a key twice in row 3 was read silently, the last value kept."""
    rows = [json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) for i in range(6)]
    rows[3] = ('{"prompt": "a", "messages": [{"role": "u", "role": "v"}], "response": "x"}' if nested
               else '{"prompt": "a", "prompt": "b", "response": "x"}')
    msg = _rows_error(tmp_path, "d.json", "[" + ",\n".join(rows) + "]")
    assert msg.endswith(f"d.json: row 3: duplicate key {'role' if nested else 'prompt'!r} (a key given "
                        f"twice; the reader would keep the last)"), msg


def test_a_bad_value_is_named_at_its_own_line_and_row(tmp_path):
    """The reader named the row within a block of the file (row 26087 for row 90000 of a 33 MB file), or no
    row, for a number where the rows before have a string (a blank line defeats its fallback) or over 64
    bits."""
    rows = [json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) for i in range(6)]
    rows[4] = json.dumps({"prompt": 5, "response": "x"})
    msg = _rows_error(tmp_path, "rows.jsonl", "\n".join(rows[:1] + [""] + rows[1:]) + "\n")
    assert msg.endswith("line 6 (row 4): field 'prompt': a number, where the rows before have a string"), msg
    rows[4] = json.dumps({"prompt": "p", "response": 2 ** 70})
    msg = _rows_error(tmp_path, "rows.jsonl", "\n".join(rows) + "\n")
    assert msg.endswith("line 5 (row 4): field 'response': a number too large for 64 bits"), msg
    msg = _rows_error(tmp_path, "d.json", "[" + ",".join(rows) + "]")
    assert msg.endswith(
        "d.json: cannot read as json: row 4: field 'response': a number too large for 64 bits"), msg


def test_an_output_dir_that_cannot_be_created_is_one_error(tmp_path):
    """output_dir=/proc/self/x (or under a file) was a FileNotFoundError traceback from the lock."""
    from lorafusion.rundir.lock import OutputDirLock

    (tmp_path / "f").write_text("x")
    for out, why in (("/proc/self/x", "No such file or directory"),
                     (str(tmp_path / "f" / "x"), "Not a directory")):
        with pytest.raises(ConfigError, match=f"run.yaml: output_dir: cannot create .*{why}"):
            OutputDirLock(__import__("pathlib").Path(out), "run.yaml").acquire(True)


def _live_run(tmp_path, state: str):
    run = tmp_path / "run"
    (run / "checkpoints" / "b").mkdir(parents=True)  # b: its first checkpoint being written (no complete one)
    (run / ".lock").write_text("1\n")
    (run / "status.json").write_text(json.dumps({"run": {"state": "running"}, "jobs": {
        "a": {"state": state, "step": 3, "max_steps": 100},
        "b": {"state": "running", "step": 2, "max_steps": 9}}}))
    return run


def test_export_of_a_live_job_before_its_first_checkpoint(tmp_path, capsys):
    """It said "unknown job 'a'; the run's jobs: ..." (the live run's status.json was not asked)."""
    from lorafusion.cli import main

    run = _live_run(tmp_path, "running")
    for job, where in (("a", "running at step 3"), ("b", "running at step 2")):
        assert main(["export", str(run), "--job", job, "--out", str(tmp_path / "e")]) == 2
        _one_line(capsys, "export", f"job {job!r} has no checkpoint yet ({where}): nothing to export yet")
    assert main(["export", str(run), "--job", "c", "--out", str(tmp_path / "e")]) == 2
    _one_line(capsys, "export", "unknown job 'c'; the run's jobs: a, b")
    assert not (tmp_path / "e").exists()


def test_cancel_twice_says_it_is_already_under_way(tmp_path, capsys):
    """A second cancel said "cancel of job 'a' queued" again."""
    from lorafusion.cli import main

    run = _live_run(tmp_path, "running")
    assert main(["cancel", str(run), "--job", "a"]) == 0
    capsys.readouterr()
    assert main(["cancel", str(run), "--job", "a"]) == 2
    _one_line(capsys, "cancel", "a cancel of job 'a' is already queued (requests/", "-cancel-a.json)")
    assert len(list((run / "requests").glob("*.json"))) == 1
    run = _live_run(tmp_path / "2", "cancelling")  # the run took the first one
    assert main(["cancel", str(run), "--job", "a"]) == 2
    _one_line(capsys, "cancel",
              "job 'a' is already being cancelled: it leaves once its planned batches have run")


def test_generate_force_replaces_only_an_earlier_output(tmp_path):
    """generate --out FILE --force replaced any file — a user's notes, or the --prompts file itself."""
    from lorafusion.inference.generate import generate_file

    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a"}) + "\n")
    (tmp_path / "d").mkdir()
    for out, what in (("notes.txt", "not an earlier lorafusion generate output"),
                      ("p.jsonl", "is the --prompts file"), ("d", "a directory")):
        with pytest.raises(ConfigError, match=what):
            generate_file(tmp_path / "norun", tmp_path / "p.jsonl", tmp_path / out, force=True)
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    (tmp_path / "o.jsonl").write_text(
        json.dumps({"prompt": "a", "prompt_ids": [1], "output_ids": [2]}) + "\n")
    with pytest.raises(MissingFileError):  # an earlier output: replaced, so the run is looked for next
        generate_file(tmp_path / "norun", tmp_path / "p.jsonl", tmp_path / "o.jsonl", force=True)


def test_a_lone_surrogate_in_data_or_prompts_is_named(tmp_path):
    """'\\ud800' in a JSON string: the data reader said 'Trailing data at position 39'; generate a
    UnicodeEncodeError traceback."""
    from lorafusion.data.tokenizer import ByteTokenizer
    from lorafusion.inference.generate import read_prompts

    msg = _rows_error(tmp_path, "rows.jsonl", '{"prompt": "a\\ud800b", "response": "x"}\n' * 3)
    assert msg.endswith("line 1 (row 0): \\ud800 is a lone surrogate (half a UTF-16 pair), not text"), msg
    (tmp_path / "p.jsonl").write_text('{"prompt": "ok"}\n{"prompt": "a\\udfff"}\n')
    with pytest.raises(ConfigError, match=r"p.jsonl:2: \\udfff is a lone surrogate"):
        read_prompts(tmp_path / "p.jsonl", ByteTokenizer(), [], 1024, tmp_path)


@pytest.mark.parametrize("verb", ["plan", "export", "generate"])
def test_an_out_that_cannot_be_written_is_one_line(verb, tmp_path, monkeypatch, capsys):
    """--out /proc/self/x: a FileNotFoundError traceback (plan, generate) or one naming a temporary
    '/proc/self/.x.tmp-dd62384a' (export), after the work was done."""
    from lorafusion.cli import main
    from config_utils import make_tree

    monkeypatch.chdir(tmp_path)
    run = make_tree(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    argv = {"plan": ["plan", str(run), "--out", "/proc/self/x"],
            "export": ["export", str(tmp_path), "--job", "a", "--out", "/proc/self/x"],
            "generate": ["generate", str(tmp_path), "--prompts", "p.jsonl", "--out",
                         "/proc/self/x/o.jsonl"]}[verb]
    assert main(argv) == 2
    _one_line(capsys, verb, "--out: cannot write in /proc/self", "No such file or directory")


def test_export_refuses_a_damaged_adapter_config(tmp_path, capsys):
    """A garbled adapter_config.json was copied and reported 'exported final adapter'."""
    from lorafusion.cli import main

    (tmp_path / "run" / "adapters" / "a").mkdir(parents=True)
    (tmp_path / "run" / "adapters" / "a" / "adapter_config.json").write_text("{not json")
    assert main(["export", str(tmp_path / "run"), "--job", "a", "--out", str(tmp_path / "e")]) == 2
    _one_line(capsys, "export", "adapter_config.json: damaged: not a readable adapter config")
    assert not (tmp_path / "e").exists()


def test_generate_seed_out_of_range(tmp_path):
    """--seed -1 and --seed 2**70 were taken (greedy decoding never used them; sampling would fail or
    wrap)."""
    from lorafusion.inference.generate import generate_file

    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    for seed in (-1, 2 ** 70):
        with pytest.raises(ConfigError, match="--seed: expected an integer from 0 to 2"):
            generate_file(tmp_path, tmp_path / "p.jsonl", tmp_path / "o.jsonl", seed=seed)


def test_a_second_export_to_the_same_new_out_is_refused(tmp_path):
    """Two exports to one new --out at once: the second replaced the first's without --force (or failed with
    an OSError traceback, ENOTEMPTY); now it is refused and the first's stays whole."""
    from lorafusion.rundir.atomic import fill_dir_atomically

    out = tmp_path / "e"

    def fill(tmp):  # the other export finishes while this one writes
        (tmp / "mine").write_text("second")
        if not out.exists():
            out.mkdir()
            (out / "first").write_text("first")
    with pytest.raises(ConfigError, match="written meanwhile by another process"):
        fill_dir_atomically(out, fill, replace=False)
    assert [p.name for p in tmp_path.iterdir()] == ["e"] and (out / "first").read_text() == "first"
    assert (fill_dir_atomically(out, fill) / "mine").read_text() == "second"  # (replace: --force)


def test_round_two_of_the_probe(tmp_path, capsys):
    """Faults found by probing every verb with bad input: a CSV saved with a BOM was unreadable (KeyError
    '\\ufeffprompt'); a byte tokenizer's tokenizer.path was ignored even when missing; an output_dir component
    over NAME_MAX said 'cannot access' without naming output_dir; a FIFO was '--prompts file not found',
    '--out is a directory' and 'no such run directory'; a CSV header without rows was 'Instruction "train"
    corresponds to no data!'."""
    import os
    from pathlib import Path

    from lorafusion.cli import main
    from lorafusion.config.schema import TokenizerConfig
    from lorafusion.rundir.lock import check_output_dir

    # (a header only: its name is read right)
    msg = _rows_error(tmp_path, "rows.csv", "\ufeffprompt,response\n")
    assert msg.endswith("rows.csv: empty dataset (a csv header, no rows)"), msg
    from lorafusion.config.load import load_job_config
    from lorafusion.data.dataset import read_rows

    (tmp_path / "rows.csv").write_text("\ufeffprompt,response\na,b\n", encoding="utf-8")
    job = load_job_config(_job_yaml(tmp_path, ""), [f"dataset.path={tmp_path / 'rows.csv'}"])
    assert read_rows(job).column_names == ["prompt", "response"]
    with pytest.raises(ValueError, match="the byte tokenizer reads no file"):
        TokenizerConfig(type="byte", path="/nowhere")
    with pytest.raises(ConfigError, match="run.yaml: output_dir: cannot use .* \\(File name too long\\)"):
        check_output_dir(tmp_path / ("o" * 300), "run.yaml", resume=False)
    os.mkfifo(tmp_path / "fifo")
    fifo = str(tmp_path / "fifo")
    from lorafusion.data.tokenizer import ByteTokenizer
    from lorafusion.inference.generate import read_prompts

    with pytest.raises(MissingFileError, match="fifo: --prompts is not a regular file"):
        read_prompts(fifo, ByteTokenizer(), [], 1024, tmp_path)
    for argv, words in (
        (["generate", str(tmp_path), "--prompts", "p.jsonl", "--out", fifo, "--force"], "--out is a special "
         "file (FIFO, device)"),
                        (["export", str(tmp_path / "run"), "--job", "a", "--out", fifo, "--force"],
                         "--out is a special file"),
                        (["status", fifo], "fifo: not a directory")):
        assert main(argv) == 2
        _one_line(capsys, argv[0], words)
    assert Path(fifo).exists()


def test_sampling_at_extreme_temperature_and_top_p(tmp_path):
    """--temperature 1e-320 (logits / t overflowed to inf, then NaN) and --top-p 1e-300 (nothing kept in
    float32) were 'probability tensor contains inf/nan' / 'invalid multinomial distribution' tracebacks: both
    are greedy."""
    import torch

    from lorafusion.inference.sampling import pick_tokens

    logits = torch.randn(3, 50)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert pick_tokens(logits, 1e-320, 1.0, gens) == logits.argmax(-1).tolist()
    assert pick_tokens(logits, 1.0, 1e-300, gens) == logits.argmax(-1).tolist()
