"""Round two of scripts/probe_cli.py's cases (names ``r2_...``): special files (FIFOs, /dev/zero), odd but valid
paths, types that YAML makes easy to get wrong, damaged checkpoints and run files, numeric edges of generate and
two trainings of one output_dir at once."""

from __future__ import annotations

import json
import os
from pathlib import Path

from probe_cases import FX, QS, RUN, _absent, _jsonl, copy_run, short


def prepare_more(work: Path) -> None:
    fx = work / "fx"
    os.mkfifo(fx / "fifo.jsonl")
    os.mkfifo(fx / "fifo.yaml")
    _jsonl(fx / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                                 "content": "yo"}]}] * 32)
    (fx / "crlf.jsonl").write_bytes((fx / "good.jsonl").read_bytes().replace(b"\n", b"\r\n"))
    (fx / "bom.csv").write_bytes(b"\xef\xbb\xbfprompt,response\n" + b"after a=,bcdef\n" * 32)
    (fx / "jobdir.yaml").mkdir()
    (work / "qs" / "null_jobs.yaml").write_text((work / "qs" / "quickstart.yaml").read_text().replace(
        "  - quickstart/successor.yaml", "  - null"))
    (fx / "run_links_dir.yaml").write_text((work / "qs" / "quickstart.yaml").read_text().replace(
        "  - quickstart/successor.yaml", f"  - {fx / 'jobdir.yaml'}"))


def _train(name: str, extra: list[str], words=(), expect="err", out="{C}/out", **kw):
    return dict(name=f"r2_train_{name}", argv=["train", QS, *short(out), *extra], expect=expect, words=words,
                timeout=kw.pop("timeout", 300), **kw)


def train_more(Case) -> list:
    specs = [
        _train("data_fifo", [f"jobs.0.dataset.path={FX}/fifo.jsonl"], ("fifo.jsonl",), timeout=120),
        _train("data_dev_zero", ["jobs.0.dataset.path=/dev/zero", "jobs.0.dataset.file_type=jsonl"], ("/dev/zero",),
               timeout=120),
        _train("data_crlf_ok", [f"jobs.0.dataset.path={FX}/crlf.jsonl"], expect="ok"),
        _train("data_bom_csv_ok", [f"jobs.0.dataset.path={FX}/bom.csv"], expect="ok"),
        _train("data_chat_as_prompt_response", [f"jobs.0.dataset.path={FX}/chat.jsonl"], ("prompt",)),
        _train("data_prompt_response_as_chat", ["jobs.0.dataset.format=chat"], ("messages",)),
        _train("data_wrong_file_type", ["jobs.0.dataset.file_type=parquet"], ("successor.jsonl",)),
        _train("eval_split_leaves_nothing", ["jobs.0.eval_split=0.999", "jobs.0.eval_every=2"], ("eval_split",)),
        _train("out_unicode_spaces_ok", [], expect="ok", out="{C}/ñ 名 out"),
        _train("out_dot_in_cwd_with_files", [], ("output_dir",), out=".", setup=lambda w, c: (c / "mine.txt")
               .write_text("x"), check=lambda w, c, r: None if (c / "mine.txt").read_text() == "x" else "mine.txt"),
        _train("out_root", [], ("output_dir",), out="/"),
        _train("out_long_component", [], ("output_dir",), out="{C}/" + "o" * 300),
        _train("kernels_triton_on_cpu", ["kernels=triton"], ("kernels",)),
        _train("pp2_single_process", ["parallelism.pp=2"], ("pp",)),
        _train("tokenizer_path_missing", [f"tokenizer.path={FX}/nothere"], ("tokenizer",)),
        _train("bool_as_int", ["jobs.0.lora.r=true"], ("lora.r",)),
        _train("seed_bool", ["seed=true"], ("seed",)),
        _train("gbs_string_number", ["jobs.0.global_batch_size='4'"], ("global_batch_size",)),
        _train("max_steps_bool", ["jobs.0.max_steps=true"], ("max_steps",)),
        _train("name_space", ["jobs.0.name=my job"], ("name",)),
        _train("eval_split_zero", ["jobs.0.eval_split=0"], ("eval_split",)),
        _train("truncate_maybe", ["jobs.0.dataset.truncate=maybe"], ("truncate",)),
        _train("wandb_mode_bad", ["logging.wandb={mode: weird}"], ("mode",)),
        _train("priority_huge_ok", ["jobs.0.priority=1000000000000000000000000000000"], expect="any",
               words=("priority",)),
    ]
    cases = [Case(**s) for s in specs]
    cases += [Case("r2_train_config_fifo", ["train", f"{FX}/fifo.yaml"], words=("fifo.yaml",), timeout=60),
              Case("r2_train_config_dev_zero", ["train", "/dev/zero"], words=("/dev/zero",), timeout=60),
              Case("r2_train_job_null", ["train", "{W}/qs/null_jobs.yaml", "output_dir={C}/out"], words=("jobs.0",)),
              Case("r2_train_job_is_dir", ["train", f"{FX}/run_links_dir.yaml", "output_dir={C}/out"],
                   words=("jobdir.yaml",))]
    return cases + resume_more(Case)


def _damage(how: str):
    def setup(work: Path, cdir: Path) -> None:
        copy_run(work, cdir)
        ck = cdir / "run" / "checkpoints" / "successor"
        if how == "latest_garbage":
            (ck / "latest").write_text("../../../etc\n")
        elif how == "latest_missing_dir":
            (ck / "latest").write_text("step_000099\n")
        elif how == "manifest_missing":
            for m in ck.glob("step_*/manifest.json"):
                m.unlink()
        elif how == "state_not_object":
            for m in ck.glob("step_*/state.json"):
                m.write_text("[1, 2]")
        elif how == "summary_garbage":
            (cdir / "run" / "summary.json").write_text("{\"jobs\": [")
    return setup


def resume_more(Case) -> list:
    steps6 = [o for o in short("{C}/run") if "max_steps" not in o] + [f"jobs.{i}.max_steps=6" for i in range(3)]
    out = []
    for how, expect in (("latest_garbage", "any"), ("latest_missing_dir", "any"), ("manifest_missing", "any"),
                        ("state_not_object", "any")):
        out.append(Case(f"r2_resume_{how}", ["train", QS, *steps6, "--resume"], expect=expect,
                        words=("checkpoint",), setup=_damage(how), timeout=300))
    return out


def run_more(Case) -> list:
    g = ["generate", RUN, "--prompts", "{C}/p.jsonl", "--out", "{C}/o.jsonl"]

    def prompts(rows):
        return lambda w, c: _jsonl(c / "p.jsonl", rows)
    ok = prompts([{"prompt": "after a=", "job": "successor"}])

    def req_file(w: Path, c: Path) -> None:
        copy_run(w, c)
        (c / "run" / "requests").write_text("x")
    return [
        Case("r2_generate_temperature_denormal", g + ["--temperature", "1e-320"], expect="any",
             words=("--temperature",), setup=ok),
        Case("r2_generate_temperature_huge_ok", g + ["--temperature", "1e308"], expect="ok", setup=ok),
        Case("r2_generate_top_p_tiny_ok", g + ["--top-p", "1e-300", "--temperature", "1"], expect="ok", setup=ok),
        Case("r2_generate_batch_huge_ok", g + ["--batch-size", str(10 ** 9)], expect="ok", setup=ok),
        Case("r2_generate_prompts_fifo", g[:3] + [f"{FX}/fifo.jsonl", "--out", "{C}/o.jsonl"], words=("fifo",),
             timeout=60),
        Case("r2_generate_prompts_dev_zero", g[:3] + ["/dev/zero", "--out", "{C}/o.jsonl"], words=("/dev/zero",),
             timeout=60),
        Case("r2_generate_out_fifo", g[:5] + [f"{FX}/fifo.yaml", "--force"], words=("fifo.yaml",), setup=ok,
             timeout=60),
        Case("r2_generate_extra_keys_ok", g, expect="ok", setup=prompts([{"prompt": "a", "job": None, "id": 7,
                                                                            "meta": {"x": [1]}}])),
        Case("r2_generate_job_list", g, words=("job",), setup=prompts([{"prompt": "a", "job": ["successor"]}]),
             check=_absent("{C}/o.jsonl")),
        Case("r2_export_out_fifo", ["export", RUN, "--job", "shout", "--out", f"{FX}/fifo.jsonl", "--force"],
             words=("fifo.jsonl",)),
        Case("r2_status_summary_garbage", ["status", "{C}/run"], expect="any", words=("summary.json",),
             setup=_damage("summary_garbage")),
        Case("r2_export_summary_garbage", ["export", "{C}/run", "--job", "shout", "--out", "{C}/e"], expect="any",
             words=("summary.json",), setup=_damage("summary_garbage")),
        Case("r2_submit_requests_is_file", ["submit", "{C}/run", f"{FX}/job.yaml"], words=("requests",),
             setup=req_file),
        Case("r2_cancel_requests_is_file", ["cancel", "{C}/run", "--job", "newjob"], words=("requests",),
             setup=req_file),
        Case("r2_plan_gpu_memory_units_ok", ["plan", QS, "output_dir={C}/out", "--gpu-memory", "80GB,80gib,24"],
             expect="ok"),
        Case("r2_plan_windows_huge_ok", ["plan", QS, "output_dir={C}/out", "--windows", str(10 ** 9)], expect="ok",
             timeout=300),
        Case("r2_status_fifo", ["status", f"{FX}/fifo.jsonl"], words=("fifo.jsonl",), timeout=60),
        Case("serial_r2_two_trains_one_output_dir", ["status", "{C}/out"], expect="ok", setup=_two_trains,
             check=_two_trains_check, timeout=600),
    ]


def _two_trains(work: Path, cdir: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from probe_cli import run_cli

    argv = ["train", str(work / "qs" / "quickstart.yaml"), *short(cdir / "out")]
    with ThreadPoolExecutor(2) as pool:
        res = list(pool.map(lambda _: run_cli(argv, cdir, 600), range(2)))
    (cdir / "race.json").write_text(json.dumps([[r.returncode, r.stderr.strip().splitlines()[-1:]] for r in res]))


def _two_trains_check(work: Path, cdir: Path, res) -> str | None:
    got = json.loads((cdir / "race.json").read_text())
    rcs = sorted(r[0] for r in got)
    refused = [r[1] for r in got if r[0] == 2]
    if rcs == [0, 2] and refused and ("in use by another" in refused[0][0] or "already holds a run" in refused[0][0]):
        return None
    return f"two trains of one output_dir: {got}"
