"""The cases of scripts/probe_cli.py that act on a trained run: submit, cancel, status, export, generate and two
verbs at once (see :mod:`probe_cases` for the fixtures and the train and plan cases)."""

from __future__ import annotations

import json
from pathlib import Path

from probe_cases import FX, QS, RUN, _absent, _jsonl, _unchanged, copy_run


def submit_cases(Case) -> list:
    job = f"{FX}/job.yaml"
    s = ["submit", "{C}/run", job]
    cases = [Case("submit_run_missing", ["submit", "{C}/nothere", job], words=("nothere",)),
             Case("submit_run_not_run", ["submit", f"{FX}/adir", job], words=("not a lorafusion run",)),
             Case("submit_run_is_file", ["submit", f"{FX}/afile", job], words=("afile",)),
             Case("submit_job_missing", ["submit", RUN, f"{FX}/nothere.yaml"], words=("nothere.yaml",)),
             Case("submit_job_is_run_yaml", ["submit", RUN, QS], words=("quickstart.yaml",)),
             Case("submit_job_binary", ["submit", RUN, f"{FX}/binary.bin"], words=("binary.bin",))]
    bad = [("r_zero", ["lora.r=0"], "lora.r"), ("r_huge", ["lora.r=1000000000000"], "lora"),
           ("name_taken", ["name=successor"], "successor"), ("name_slash", ["name=a/b"], "name"),
           ("seq_over_capacity", ["dataset.max_seq_len=4096"], "token_capacity"),
           ("data_invalid", [f"dataset.path={FX}/truncated.jsonl"], "truncated.jsonl"),
           ("data_int_row4", [f"dataset.path={FX}/int_row4.jsonl"], "row 4"),
           ("data_long_sample", [f"dataset.path={FX}/long.jsonl"], "row 3"),
           ("override_twice", ["optimizer.lr=1", "optimizer.lr=2"], "optimizer.lr"),
           ("warmup_over", ["optimizer.warmup_steps=99"], "warmup_steps"),
           ("unknown_key", ["lrr=1"], "lrr"), ("gbs_over_samples", ["global_batch_size=1000"], "global_batch_size")]
    cases += [Case(f"submit_{n}", s + ov, words=(w,), setup=copy_run, timeout=120,
                   check=lambda w, c, r: "a request was queued" if list((c / "run" / "requests").glob("*.json"))
                   else None) for n, ov, w in bad]
    cases += [Case("submit_ok", s, expect="ok", setup=copy_run),
              Case("submit_ok_twice", ["submit", "{C}/run", job], words=("newjob",), setup=_submitted)]
    return cases


def _submitted(work: Path, cdir: Path) -> None:
    copy_run(work, cdir)
    from probe_cli import run_cli

    assert run_cli(["submit", str(cdir / "run"), str(work / "fx" / "job.yaml")], cdir, 60).returncode == 0


def _status(rows: dict):
    def setup(work: Path, cdir: Path) -> None:
        copy_run(work, cdir)
        (cdir / "run" / "status.json").write_text(json.dumps({"run": {"state": "running"}, "jobs": rows}))
    return setup


def cancel_cases(Case) -> list:
    c = ["cancel", "{C}/run", "--job"]
    live = _status({"successor": {"state": "running", "step": 2}, "shout": {"state": "cancelling", "step": 2}})
    return [Case("cancel_run_missing", ["cancel", "{C}/nothere", "--job", "x"], words=("nothere",)),
            Case("cancel_run_not_run", ["cancel", f"{FX}/adir", "--job", "x"], words=("not a lorafusion run",)),
            Case("cancel_run_is_file", ["cancel", f"{FX}/afile", "--job", "x"], words=("afile",)),
            Case("cancel_no_job_flag", ["cancel", RUN], words=("--job",)),
            Case("cancel_unknown_job", ["cancel", RUN, "--job", "nope"], words=("nope",)),
            Case("cancel_finished_job", ["cancel", RUN, "--job", "shout"], words=("already",)),
            Case("cancel_empty_name", ["cancel", RUN, "--job", ""], words=("job",)),
            Case("cancel_unicode_name", ["cancel", RUN, "--job", "名前\u202e"], words=("job",)),
            Case("cancel_dotdot_name", ["cancel", RUN, "--job", "../run"], words=("job",)),
            Case("cancel_live_ok", c + ["successor"], expect="ok", setup=live),
            Case("cancel_cancelling", c + ["shout"], words=("already being cancelled",), setup=live),
            Case("cancel_twice", c + ["successor"], words=("already queued",), setup=_cancelled_once(live)),
            Case("cancel_submitted_ok", c + ["newjob"], expect="ok", setup=_submitted)]


def _cancelled_once(setup):
    def both(work: Path, cdir: Path) -> None:
        setup(work, cdir)
        from probe_cli import run_cli

        assert run_cli(["cancel", str(cdir / "run"), "--job", "successor"], cdir, 60).returncode == 0
    return both


def status_cases(Case) -> list:
    def bad(text: bytes):
        def setup(work: Path, cdir: Path) -> None:
            (cdir / "run").mkdir(exist_ok=True)
            (cdir / "run" / ".lock").write_text("")
            (cdir / "run" / "status.json").write_bytes(text)
        return setup
    shapes = {"list": b"[]", "jobs_int": b'{"jobs": 5}', "binary": b"\xff\xfe\x00", "truncated": b'{"run": {"sta',
              "empty": b"", "job_row_list": b'{"jobs": {"a": [1]}}', "run_string": b'{"run": "x", "jobs": {}}',
              "step_string": b'{"jobs": {"a": {"state": "running", "step": "x", "max_steps": "y"}}}',
              "huge_numbers": b'{"jobs": {"a": {"state": "running", "step": 1e400, "tokens": -5}}}'}
    cases = [Case(f"status_json_{n}", ["status", "{C}/run"], words=("status.json",), setup=bad(t))
             for n, t in shapes.items()]
    def odd(work: Path, cdir: Path) -> None:  # odd values in the run's own status: shown or one error line
        copy_run(work, cdir)
        st = json.loads((cdir / "run" / "status.json").read_text())
        st["jobs"]["successor"].update(step="x", max_steps=None, tokens=-5, last_loss="nan")
        st["jobs"]["shout"].update(step=10 ** 30, eta_s=-1)
        (cdir / "run" / "status.json").write_text(json.dumps(st))
    cases = [c for c in cases if c.name not in ("status_json_step_string", "status_json_huge_numbers")]
    cases.append(Case("status_json_odd_values", ["status", "{C}/run"], expect="any", words=("status.json",), setup=odd))
    return cases + [Case("status_missing", ["status", "{C}/nothere"], words=("nothere",)),
                    Case("status_not_run", ["status", f"{FX}/adir"], words=("adir",)),
                    Case("status_file", ["status", f"{FX}/afile"], words=("afile",)),
                    Case("status_loop", ["status", f"{FX}/loop"], words=("loop",)),
                    Case("status_ok", ["status", RUN], expect="ok"),
                    Case("status_json_ok", ["status", RUN, "--json"], expect="ok",
                         check=lambda w, c, r: None if json.loads(r.stdout).get("jobs") else "no jobs in --json")]


def _export_setup(kind: str):
    def setup(work: Path, cdir: Path) -> None:
        if kind == "earlier":
            from probe_cli import run_cli

            assert run_cli(["export", str(work / "run"), "--job", "shout", "--out", str(cdir / "e")], cdir,
                           60).returncode == 0
        elif kind == "truncated":
            copy_run(work, cdir)
            w = cdir / "run" / "adapters" / "shout" / "adapter_model.safetensors"
            w.write_bytes(w.read_bytes()[:-100])
        elif kind == "bad_config":
            copy_run(work, cdir)
            (cdir / "run" / "adapters" / "shout" / "adapter_config.json").write_text("{not json")
        elif kind == "interrupted":  # an export killed midway leaves its temporary directory
            (cdir / ".e.tmp-deadbeef").mkdir()
            (cdir / ".e.tmp-deadbeef" / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
    return setup


def export_cases(Case) -> list:
    e = ["export", RUN, "--job", "shout", "--out"]
    step = "{W}/run/checkpoints/successor/step_000002"
    return [Case("export_run_missing", ["export", "{C}/nothere", "--job", "shout", "--out", "{C}/e"], words=("nothere",)),
            Case("export_no_job", ["export", RUN, "--out", "{C}/e"], words=("--job",)),
            Case("export_unknown_job", e[:3] + ["nope", "--out", "{C}/e"], words=("nope",)),
            Case("export_job_path", e[:3] + ["../adapters/shout", "--out", "{C}/e"], words=("--job",)),
            Case("export_job_empty", e[:3] + ["", "--out", "{C}/e"], words=("--job",)),
            Case("export_out_is_run", e + [RUN, "--force"], words=("--out",)),
            Case("export_out_inside_run", e + [RUN + "/adapters", "--force"], words=("--out",)),
            Case("export_out_parent_of_run", e + ["{W}", "--force"], words=("--out",)),
            Case("export_out_foreign_force", e + [f"{FX}/foreign", "--force"], words=("not an earlier",),
                 check=_unchanged(f"{FX}/foreign/mine.txt", "precious")),
            Case("export_out_file_force", e + [f"{FX}/afile", "--force"], words=("afile",),
                 check=_unchanged(f"{FX}/afile", "x")),
            Case("export_out_symlink_force", e + [f"{FX}/dangling", "--force"], words=("symlink",)),
            Case("export_out_exists", e + [f"{FX}/adir"], words=("already exists",)),
            Case("export_out_earlier_force_ok", e + ["{C}/e", "--force"], expect="ok", setup=_export_setup("earlier")),
            Case("export_out_proc", e + ["/proc/self/x"], words=("/proc/self",)),
            Case("export_out_under_file", e + [f"{FX}/afile/x"], words=("afile",)),
            Case("export_truncated_adapter", ["export", "{C}/run", "--job", "shout", "--out", "{C}/e"],
                 words=("truncated",), setup=_export_setup("truncated"), check=_absent("{C}/e")),
            Case("export_adapter_config_garbled", ["export", "{C}/run", "--job", "shout", "--out", "{C}/e"],
                 words=("adapter_config.json",), setup=_export_setup("bad_config"), check=_absent("{C}/e")),
            Case("export_best_no_eval", e[:4] + ["--best", "--out", "{C}/e"], words=("eval",)),
            Case("export_merged_no_job", ["export", RUN, "--merged", "--out", "{C}/e"], words=("--merged",)),
            Case("export_base_with_job", ["export", RUN, "--base", "--job", "shout", "--out", "{C}/e"],
                 words=("--base",)),
            Case("export_step_of_other_job", ["export", step, "--job", "shout", "--out", "{C}/e"],
                 words=("successor",)),
            Case("export_step_ok", ["export", step, "--job", "successor", "--out", "{C}/e"], expect="ok"),
            Case("export_after_interrupted_ok", e + ["{C}/e"], expect="ok", setup=_export_setup("interrupted")),
            Case("export_base_ok", ["export", RUN, "--base", "--out", "{C}/b"], expect="ok"),
            Case("export_merged_ok", ["export", RUN, "--job", "shout", "--merged", "--out", "{C}/m"], expect="ok"),
            Case("export_live_no_ckpt", ["export", "{C}/run", "--job", "newjob", "--out", "{C}/e"],
                 words=("no checkpoint yet",), setup=_status({"newjob": {"state": "running", "step": 1}}))]


def _prompts(lines: list, raw: bytes | None = None):
    def setup(work: Path, cdir: Path) -> None:
        if raw is not None:
            (cdir / "p.jsonl").write_bytes(raw)
        else:
            _jsonl(cdir / "p.jsonl", lines)
    return setup


def generate_cases(Case) -> list:
    g = ["generate", RUN, "--prompts", "{C}/p.jsonl", "--out", "{C}/o.jsonl"]
    ok = _prompts([{"prompt": "after a=", "job": "successor"}])
    rows = {"invalid_json": (["{not json"], "p.jsonl:1"), "no_prompt": ([{"job": "successor"}], "p.jsonl:1"),
            "unknown_job": ([{"prompt": "a", "job": "nope"}], "nope"), "job_int": ([{"prompt": "a", "job": 5}], "job"),
            "row_list": ([[1, 2]], "p.jsonl:1"), "prompt_int": ([{"prompt": 5}], "prompt"),
            "prompt_too_long": ([{"prompt": "x" * 5000}], "context"), "empty_file": ([], "no prompts"),
            "surrogate": (['{"prompt": "a\\ud800"}'], "p.jsonl:1"),
            "messages_bad": ([{"messages": "hi", "job": "shout"}], "messages"),
            "prompt_and_messages": ([{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}], "p.jsonl:1")}
    cases = [Case(f"generate_rows_{n}", g, words=(w,), setup=_prompts(lines), check=_absent("{C}/o.jsonl"))
             for n, (lines, w) in rows.items()]
    flags = {"temperature_negative": (["--temperature=-1"], "--temperature"),
             "temperature_nan": (["--temperature", "nan"], "--temperature"),
             "temperature_inf": (["--temperature", "inf"], "--temperature"),
             "top_p_zero": (["--top-p", "0"], "--top-p"), "top_p_big": (["--top-p", "2"], "--top-p"),
             "max_new_zero": (["--max-new-tokens", "0"], "--max-new-tokens"),
             "batch_zero": (["--batch-size", "0"], "--batch-size"), "seed_text": (["--seed", "x"], "--seed"),
             "seed_negative": (["--seed=-1"], "--seed"), "seed_huge": (["--seed", str(2 ** 70)], "--seed")}
    cases += [Case(f"generate_flag_{n}", g + f, words=(w,), setup=ok) for n, (f, w) in flags.items()]
    cases += [
        Case("generate_run_missing", ["generate", "{C}/nothere", "--prompts", "{C}/p.jsonl", "--out", "{C}/o.jsonl"],
             words=("nothere",), setup=ok),
        Case("generate_run_not_run", ["generate", f"{FX}/adir", "--prompts", "{C}/p.jsonl", "--out", "{C}/o.jsonl"],
             words=("adir",), setup=ok),
        Case("generate_prompts_missing", g[:3] + ["{C}/nothere.jsonl", "--out", "{C}/o.jsonl"], words=("nothere",)),
        Case("generate_prompts_dir", g[:3] + [f"{FX}/adir", "--out", "{C}/o.jsonl"], words=("directory",)),
        Case("generate_prompts_binary", g[:3] + [f"{FX}/binary.bin", "--out", "{C}/o.jsonl"], words=("binary.bin:1",)),
        Case("generate_prompts_loop", g[:3] + [f"{FX}/loop", "--out", "{C}/o.jsonl"], words=("loop",)),
        Case("generate_out_exists", g[:5] + [f"{FX}/afile"], words=("already exists",), setup=ok),
        Case("generate_out_is_prompts", g[:5] + ["{C}/p.jsonl", "--force"], words=("--prompts",), setup=ok),
        Case("generate_out_foreign_force", g[:5] + [f"{FX}/notes.txt", "--force"], words=("notes.txt",), setup=ok,
             check=_unchanged(f"{FX}/notes.txt", "hello\n")),
        Case("generate_out_dir", g[:5] + [f"{FX}/adir", "--force"], words=("adir",), setup=ok),
        Case("generate_out_proc", g[:5] + ["/proc/self/x/o.jsonl"], words=("/proc/self",), setup=ok),
        Case("generate_ok", g, expect="ok", setup=ok,
             check=lambda w, c, r: None if "output" in json.loads((c / "o.jsonl").read_text().splitlines()[0])
             else "no output"),
        Case("generate_odd_unicode_ok", g, expect="ok",
             setup=_prompts([{"prompt": "\u202eafter a=\u0301😀", "job": "successor"}, {"prompt": "Ω≈ç√ ", "job": None}])),
        Case("generate_max_new_huge_ok", g + ["--max-new-tokens", str(10 ** 12)], expect="ok", setup=ok,
             timeout=300),
    ]
    return cases


def fault_cases(Case) -> list:
    """Two verbs at once on one run: a submit and a cancel of the same job, and two exports to one --out."""
    def race(work: Path, cdir: Path) -> None:
        copy_run(work, cdir)
        from probe_cli import run_cli
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(run_cli, ["submit", str(cdir / "run"), str(work / "fx" / "job.yaml")], cdir, 60)
            b = pool.submit(run_cli, ["cancel", str(cdir / "run"), "--job", "newjob"], cdir, 60)
            (cdir / "race.txt").write_text(f"{a.result().returncode} {b.result().returncode}")

    def race_check(work, cdir, res):
        rc_submit, rc_cancel = (cdir / "race.txt").read_text().split()
        queued = sorted(p.name.split("-", 1)[1] for p in (cdir / "run" / "requests").glob("*.json"))
        # a cancel that said "queued" must be behind its submit; a refused one queues nothing
        if rc_submit != "0" or (rc_cancel == "0") != ("cancel-newjob.json" in queued):
            return f"submit rc {rc_submit}, cancel rc {rc_cancel}, queued {queued}"
        return None

    def two_exports(work: Path, cdir: Path) -> None:
        from probe_cli import run_cli
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            rcs = list(pool.map(lambda j: run_cli(["export", str(work / "run"), "--job", j, "--out", str(cdir / "e")],
                                                  cdir, 60).returncode, ("shout", "countdown")))
        (cdir / "race.txt").write_text(" ".join(map(str, rcs)))

    def exports_check(work, cdir, res):
        rcs = (cdir / "race.txt").read_text().split()
        left = [p.name for p in cdir.iterdir() if p.name.startswith(".")]
        if sorted(rcs) != ["0", "2"] or left:
            return f"two exports to one --out: rcs {rcs}, left behind {left}"
        return None

    return [Case("serial_submit_cancel_race", ["status", "{C}/run"], expect="ok", setup=race, check=race_check),
            Case("serial_two_exports_one_out", ["status", RUN], expect="ok", setup=two_exports, check=exports_check)]
