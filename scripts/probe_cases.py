"""The cases of scripts/probe_cli.py: bad input and faults for every verb (train, plan, submit, cancel, status,
export, generate). ``prepare(work)`` writes the shared fixtures under ``work/fx``; each case may set up its own
directory ``{C}`` (a copy of the shared run when it would change it)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

QS = "{W}/qs/quickstart.yaml"
RUN = "{W}/run"
FX = "{W}/fx"
ROW = {"prompt": "after a=", "response": "bcdef"}


def short(out) -> list[str]:
    """Overrides for a short run of the quickstart (4 steps a job) into ``out``."""
    return [f"output_dir={out}", "logging.progress=false", "logging.tensorboard=false",
            *[f"jobs.{i}.max_steps=4" for i in range(3)], *[f"jobs.{i}.optimizer.warmup_steps=1" for i in range(3)]]


def _rows(n: int = 32, **edit) -> list[dict]:
    rows = [dict(ROW, prompt=f"after {chr(97 + i % 20)}=") for i in range(n)]
    for i, row in edit.items():
        rows[int(i[1:])] = row
    return rows


def _jsonl(path: Path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def prepare(work: Path) -> None:
    fx = work / "fx"
    if fx.is_dir():
        shutil.rmtree(fx)
    fx.mkdir()
    _jsonl(fx / "good.jsonl", _rows())
    (fx / "job.yaml").write_text("name: newjob\ndataset: {path: good.jsonl, format: prompt_response, max_seq_len: 64}\n"
                                 "lora: {r: 4, lora_alpha: 8}\nglobal_batch_size: 4\nmax_steps: 2\n")
    data = {
        "int_row4.jsonl": _rows(r4={"prompt": 4, "response": "x"}),
        "dup_key.json": None, "truncated.jsonl": None, "nul.jsonl": None, "surrogate.jsonl": None,
        "empty_resp.jsonl": [dict(ROW, response="")] * 32, "long.jsonl": _rows(r3=dict(ROW, response="x" * 500)),
        "one_row.jsonl": _rows(1), "no_prompt.jsonl": [{"response": "x"}] * 32, "list_rows.jsonl": [[1, 2]] * 32,
        "bom.jsonl": None, "rtl.jsonl": [dict(ROW, prompt="\u202eafter a=\u0301\u200d", response="\U0001f600é")] * 32,
        "big_int.jsonl": _rows(r5={"prompt": "p", "response": 2 ** 70}),
    }
    for name, rows in data.items():
        if rows is not None:
            _jsonl(fx / name, rows)
    (fx / "dup_key.json").write_text("[" + ",".join([json.dumps(ROW)] * 3 + ['{"prompt": "a", "prompt": "b", '
                                                                             '"response": "c"}']) + "]")
    (fx / "truncated.jsonl").write_text((fx / "good.jsonl").read_text()[:-20])
    (fx / "nul.jsonl").write_bytes((fx / "good.jsonl").read_bytes()[:50] + b"\x00\x00" + b"\n")
    (fx / "surrogate.jsonl").write_text('{"prompt": "a\\ud800b", "response": "x"}\n' * 32)
    (fx / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + (fx / "good.jsonl").read_bytes())
    (fx / "missing_col.csv").write_text("prompt\n" + "a\n" * 32)
    (fx / "bad.parquet").write_bytes(b"PAR1" + b"\x00" * 64)
    (fx / "notes.txt").write_text("hello\n")
    (fx / "afile").write_text("x")
    (fx / "adir").mkdir()
    (fx / "foreign").mkdir()
    (fx / "foreign" / "mine.txt").write_text("precious")
    os.symlink(fx / "loop", fx / "loop")
    os.symlink(fx / "nowhere", fx / "dangling")
    _jsonl(fx / "prompts.jsonl", [{"prompt": "after a=", "job": "successor"}, {"prompt": "shout hi=", "job": None}])
    (fx / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (fx / "run_as_list.yaml").write_text("- a\n- b\n")
    (fx / "tabs.yaml").write_text("model:\n\tpreset: tiny-llama\n")
    (fx / "bomb.yaml").write_text("".join(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}" if i else '"x"'] * 9) + "]\n"
                                          for i in range(10)) + "jobs: [*a9]\n")
    (fx / "huge_float.yaml").write_text((work / "qs" / "quickstart.yaml").read_text().replace("seed: 1234",
                                                                                              "seed: 1e400"))
    __import__("probe_cases_more").prepare_more(work)


def copy_run(work: Path, cdir: Path) -> None:
    if not (cdir / "run").exists():
        shutil.copytree(work / "run", cdir / "run", symlinks=True)


def _unchanged(rel: str, text: str):
    def check(work, cdir, res):
        p = Path(str(rel).replace("{W}", str(work)).replace("{C}", str(cdir)))
        return None if p.is_file() and p.read_text() == text else f"{p} changed or removed"
    return check


def _absent(rel: str):
    def check(work, cdir, res):
        p = Path(str(rel).replace("{W}", str(work)).replace("{C}", str(cdir)))
        return f"{p} was written" if p.exists() else None
    return check


# (case, override(s), what the error must name): refused before torch is imported
TRAIN_CONFIG_BAD = [  # (case, override, what the error must name) — all refused before torch is imported
        ("preset_unknown", "model.preset=nope", "model.preset"), ("preset_int", "model.preset=5", "model.preset"),
        ("dtype_bad", "model.dtype=float8", "model.dtype"), ("dtype_int", "model.dtype=3", "model.dtype"),
        ("model_path_missing", ("model.preset=null", "model.path={FX}/nothere"), "model.path"),
        ("model_path_file", ("model.preset=null", "model.path={FX}/afile"), "model.path"),
        ("model_path_nouser", ("model.preset=null", "model.path=~nosuchuser/m"), "nosuchuser"),
        ("tokenizer_type", "tokenizer.type=nope", "tokenizer.type"), ("tp_zero", "parallelism.tp=0", "parallelism.tp"),
        ("tp_negative", "parallelism.tp=-1", "parallelism.tp"), ("pp_string", "parallelism.pp=two", "parallelism.pp"),
        ("tp_float", "parallelism.tp=1.5", "parallelism.tp"), ("dp_mismatch", "parallelism.dp=3", "dp"),
        ("capacity_zero", "scheduler.token_capacity=0", "token_capacity"),
        ("capacity_negative", "scheduler.token_capacity=-5", "token_capacity"),
        ("capacity_huge", "scheduler.token_capacity=99999999999999999999999", "token_capacity"),
        ("capacity_string", "scheduler.token_capacity=lots", "token_capacity"),
        ("capacity_float_exp", "scheduler.token_capacity=1e100", "token_capacity"),
        ("milp_negative", "scheduler.milp_time_limit_s=-1", "milp_time_limit_s"),
        ("milp_nan", "scheduler.milp_time_limit_s=.nan", "milp_time_limit_s"),
        ("grouping_maybe", "scheduler.grouping=maybe", "grouping"),
        ("lookahead_zero", "scheduler.lookahead_batches=0", "lookahead_batches"),
        ("scheduler_unknown_key", "scheduler.capacity=5", "scheduler.capacity"),
        ("kernels_bad", "kernels=nope", "kernels"), ("seed_negative", "seed=-1", "seed"),
        ("seed_float", "seed=1.5", "seed"), ("seed_string", "seed=abc", "seed"),
        ("seed_huge", "seed=1180591620717411303424", "seed"), ("log_every_zero", "logging.log_every=0", "log_every"),
        ("log_every_s_negative", "logging.log_every_s=-1", "log_every_s"),
        ("progress_int", "logging.progress=3", "logging.progress"), ("wandb_int", "logging.wandb=5", "wandb"),
        ("ckpt_minutes_negative", "checkpoint.every_minutes=-1", "every_minutes"),
        ("output_dir_empty", "output_dir=", "output_dir"), ("output_dir_list", "output_dir=[a, b]", "output_dir"),
        ("jobs_empty", "jobs=[]", "jobs"), ("jobs_int", "jobs=5", "jobs"),
        ("name_empty", "jobs.0.name=''", "name"), ("name_slash", "jobs.0.name=a/b", "name"),
        ("name_unicode_accent", "jobs.0.name=ñame", "name"), ("name_cjk", "jobs.0.name=名前", "name"),
        ("name_emoji", "jobs.0.name=job😀", "name"), ("name_300", "jobs.0.name=" + "n" * 300, "name"),
        ("name_newline", "jobs.0.name='a\n'", "name"), ("name_dotdot", "jobs.0.name=..", "name"),
        ("name_duplicate", "jobs.1.name=successor", "duplicate"), ("name_int", "jobs.0.name=5", "name"),
        ("lora_r_zero", "jobs.0.lora.r=0", "lora.r"), ("lora_r_negative", "jobs.0.lora.r=-4", "lora.r"),
        ("lora_r_float", "jobs.0.lora.r=4.5", "lora.r"), ("lora_alpha_negative", "jobs.0.lora.lora_alpha=-1", "alpha"),
        ("lora_dropout_big", "jobs.0.lora.lora_dropout=1.5", "lora_dropout"),
        ("lora_targets_unknown", "jobs.0.lora.target_modules=[nope]", "target_modules"),
        ("lora_targets_empty", "jobs.0.lora.target_modules=[]", "target_modules"),
        ("lr_zero", "jobs.0.optimizer.lr=0", "lr"), ("lr_negative", "jobs.0.optimizer.lr=-1", "lr"),
        ("lr_inf", "jobs.0.optimizer.lr=.inf", "lr"), ("lr_string", "jobs.0.optimizer.lr=fast", "lr"),
        ("betas_one", "jobs.0.optimizer.betas=[0.9]", "betas"), ("betas_big", "jobs.0.optimizer.betas=[1.5, 0.9]",
                                                                 "betas"),
        ("schedule_bad", "jobs.0.optimizer.schedule=weird", "schedule"),
        ("warmup_negative", "jobs.0.optimizer.warmup_steps=-1", "warmup_steps"),
        ("warmup_over_steps", "jobs.0.optimizer.warmup_steps=1000", "warmup_steps"),
        ("grad_norm_zero", "jobs.0.optimizer.max_grad_norm=0", "max_grad_norm"),
        ("min_lr_ratio_big", "jobs.0.optimizer.min_lr_ratio=2", "min_lr_ratio"),
        ("gbs_zero", "jobs.0.global_batch_size=0", "global_batch_size"),
        ("max_steps_zero", "jobs.0.max_steps=0", "max_steps"), ("max_steps_negative", "jobs.0.max_steps=-3", "max_steps"),
        ("max_steps_float", "jobs.0.max_steps=1e30", "max_steps"),
        ("num_epochs_zero", "jobs.0.num_epochs=0", "num_epochs"), ("save_every_zero", "jobs.0.save_every=0", "save_every"),
        ("data_missing", "jobs.0.dataset.path={FX}/nothere.jsonl", "dataset"),
        ("data_is_dir", "jobs.0.dataset.path={FX}/adir", "dataset.path"),
        ("data_loop", "jobs.0.dataset.path={FX}/loop", "loop"),
        ("data_dangling", "jobs.0.dataset.path={FX}/dangling", "dataset"),
        ("data_txt_ext", "jobs.0.dataset.path={FX}/notes.txt", "file type"),
        ("format_bad", "jobs.0.dataset.format=nope", "format"),
        ("max_seq_len_zero", "jobs.0.dataset.max_seq_len=0", "max_seq_len"),
        ("max_seq_len_over_capacity", "jobs.0.dataset.max_seq_len=100000", "max_seq_len"),
        ("eval_split_big", "jobs.0.eval_split=1.5", "eval_split"),
        ("eval_every_no_set", "jobs.0.eval_every=5", "eval_every"),
        ("patience_no_eval", "jobs.0.early_stopping_patience=2", "early_stopping_patience"),
        ("init_from_missing", "jobs.0.init_from={FX}/nothere", "init_from"),
        ("priority_string", "jobs.0.priority=high", "priority"),
        ("nonfinite_zero", "jobs.0.max_nonfinite_steps=0", "max_nonfinite_steps"),
        ("unknown_top_key", "foo=1", "foo"), ("override_no_eq", "seed", "key=value"),
        ("override_no_key", "=5", "key"), ("job_index_range", "jobs.9.max_steps=1", "out of range"),
        ("job_name_unknown", "jobs.nope.max_steps=1", "nope"), ("override_twice", ("seed=1", "seed=2"), "seed"),
        ("override_in_mapping_twice", ("jobs.0.lora={r: 4}", "jobs.0.lora.r=8"), "lora.r"),
]


def train_config_cases(Case) -> list:
    cases = []
    for name, ov, word in TRAIN_CONFIG_BAD:
        ovs = [o.replace("{FX}", FX) for o in ((ov,) if isinstance(ov, str) else ov)]
        out = [] if name.startswith("output_dir") else ["output_dir={C}/out"]
        cases.append(Case(f"train_cfg_{name}", ["train", QS, *out, *ovs], words=(word,), check=_absent("{C}/out")))
    return cases


def train_run_cases(Case) -> list:
    """Past the config: data, output_dir and resume, each refused before anything is written (or resumed)."""
    def run(name, extra, words, expect="err", setup=None, check=None, out="{C}/out"):
        return Case(f"train_{name}", ["train", QS, *short(out), *extra], expect=expect, words=words, setup=setup,
                    check=check, timeout=300)
    data = [("int_row4", "row 4"), ("dup_key", "row 3"), ("truncated", "line 32"), ("nul", "nul"),
            ("surrogate", "row 0"), ("empty_resp", "row 0"), ("long", "row 3"), ("no_prompt", "prompt"),
            ("list_rows", "line 1"), ("big_int", "row 5"), ("missing_col", "response")]
    cases = [run(f"data_{n}", [f"jobs.0.dataset.path={FX}/{n}.{'csv' if n == 'missing_col' else 'json' if n == 'dup_key' else 'jsonl'}"],
                 (n.split("_")[0] if n in ("missing_col",) else w,)) for n, w in data]
    cases += [run("data_one_row_gbs16", [f"jobs.0.dataset.path={FX}/one_row.jsonl"], ("global_batch_size",)),
              run("data_bad_parquet", [f"jobs.0.dataset.path={FX}/bad.parquet"], ("bad.parquet",)),
              run("data_bom_ok", [f"jobs.0.dataset.path={FX}/bom.jsonl"], (), expect="ok"),
              run("data_odd_unicode_ok", [f"jobs.0.dataset.path={FX}/rtl.jsonl"], (), expect="ok"),
              run("out_is_file", [], ("output_dir",), out=f"{FX}/afile"),
              run("out_proc", [], ("output_dir",), out="/proc/self/x"),
              run("out_under_file", [], ("output_dir",), out=f"{FX}/afile/x"),
              run("out_loop", [], ("loop",), out=f"{FX}/loop"),
              run("out_foreign", [], ("not a lorafusion run",), out=f"{FX}/foreign",
                  check=_unchanged(f"{FX}/foreign/mine.txt", "precious")),
              run("out_finished_run", [], ("--resume",), out=RUN),
              run("resume_nothing_says_so", ["--resume"], (), expect="ok",
                  check=lambda w, c, r: None if "no checkpoint in" in r.stdout else "--resume of nothing: no word"),
              run("allow_diff_without_resume", ["--allow-different-result"], ("--resume",)),
              run("resume_below_saved", ["jobs.0.max_steps=1", "jobs.0.optimizer.warmup_steps=1", "--resume"],
                  ("max_steps",), setup=copy_run, out="{C}/run")]
    for name, what in (("train_config_missing", f"{FX}/nothere.yaml"), ("train_config_dir", f"{FX}/adir"),
                       ("train_config_empty", f"{FX}/afile"), ("train_config_binary", f"{FX}/binary.bin"),
                       ("train_config_list", f"{FX}/run_as_list.yaml"), ("train_config_tabs", f"{FX}/tabs.yaml"),
                       ("train_config_bomb", f"{FX}/bomb.yaml"), ("train_config_huge_float", f"{FX}/huge_float.yaml"),
                       ("train_config_loop", f"{FX}/loop")):
        cases.append(Case(name, ["train", what, "output_dir={C}/out"], words=(Path(what).name,), timeout=30))
    return cases


def _truncate_ckpts(work: Path, cdir: Path) -> None:
    copy_run(work, cdir)
    for pt in (cdir / "run" / "checkpoints").rglob("rank_*.pt"):
        pt.write_bytes(pt.read_bytes()[:64])


def resume_fault_cases(Case) -> list:
    steps6 = [o for o in short("{C}/run") if "max_steps" not in o] + [f"jobs.{i}.max_steps=6" for i in range(3)]
    return [Case("train_resume_all_ckpts_truncated", ["train", QS, *steps6, "--resume"], words=("checkpoint",),
                 setup=_truncate_ckpts, timeout=300)]


def plan_cases(Case) -> list:
    p = ["plan", QS, "output_dir={C}/out"]
    return [Case("plan_windows_zero", p + ["--windows", "0"], words=("--windows",)),
            Case("plan_windows_negative", p + ["--windows", "-1"], words=("--windows",)),
            Case("plan_windows_text", p + ["--windows", "abc"], words=("--windows",)),
            Case("plan_gpu_memory_text", p + ["--gpu-memory", "nope"], words=("--gpu-memory",)),
            Case("plan_gpu_memory_zero", p + ["--gpu-memory", "0"], words=("--gpu-memory",)),
            Case("plan_gpu_memory_negative", p + ["--gpu-memory=-80GiB"], words=("--gpu-memory",)),
            Case("plan_gpu_memory_empty", p + ["--gpu-memory", ","], words=("--gpu-memory",)),
            Case("plan_gpu_memory_huge", p + ["--gpu-memory", "1e30GiB"], expect="ok"),  # a what-if: all fits
            Case("plan_virtual_sweep_zero", p + ["--virtual-sweep", "0"], words=("--virtual-sweep",)),
            Case("plan_virtual_sweep_text", p + ["--virtual-sweep", "a,b"], words=("--virtual-sweep",)),
            Case("plan_out_file", p + ["--out", f"{FX}/afile", "--windows", "1"], words=("afile",),
                 check=_unchanged(f"{FX}/afile", "x")),
            Case("plan_out_proc", p + ["--out", "/proc/self/x", "--windows", "1"], words=("/proc/self/x",)),
            Case("plan_out_foreign_ok", p + ["--out", "{C}/plan", "--windows", "1"], expect="ok"),
            Case("plan_config_missing", ["plan", f"{FX}/nothere.yaml"], words=("nothere.yaml",)),
            Case("plan_bad_override", p + ["jobs.0.lora.r=0"], words=("lora.r",)),
            Case("plan_data_bad", p + [f"jobs.0.dataset.path={FX}/int_row4.jsonl"], words=("row 4",))]


def all_cases(Case) -> list:
    import probe_cases_more as m
    import probe_cases_run as r

    return (train_config_cases(Case) + train_run_cases(Case) + resume_fault_cases(Case) + plan_cases(Case)
            + r.submit_cases(Case) + r.cancel_cases(Case) + r.status_cases(Case) + r.export_cases(Case)
            + r.generate_cases(Case) + r.fault_cases(Case) + m.train_more(Case) + m.run_more(Case))
