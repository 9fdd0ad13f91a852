"""The SmolLM2 example's exports in transformers + PEFT: do they give what ``lorafusion generate`` gave?

    python configs/smollm2/check_exports.py RUN_DIR [--result FILE]     # RUN_DIR: a run of run.py here

For every job of the run:
- ``lorafusion export RUN_DIR --job J`` (the PEFT adapter), loaded with ``PeftModel.from_pretrained`` on the
  base model directory: greedy ``generate()`` on each held-out prompt of the job, rendered with the base
  tokenizer's ``apply_chat_template`` (the model's own chat template), in one left-padded batch; its answers
  are compared with the adapter rows of RUN_DIR/answers.jsonl, and the base alone with the base rows;
- ``lorafusion export RUN_DIR --job J --merged``: its logits on the job's held-out prompts against base + PEFT
  adapter (the largest difference over the largest logit), and its own greedy answers, with the merged
  directory's exported tokenizer, against the adapter rows.

Prints one line per check and writes them as JSON (RUN_DIR/exports_check.json and ``--result``); exits 1 when
an answer differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def export(run: Path, job: str, out: Path, merged: bool) -> Path:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    cmd = [sys.executable, "-m", "lorafusion.cli", "export", str(run), "--job", job, "--out", str(out),
           "--force"]
    subprocess.run(cmd + (["--merged"] if merged else []), check=True, env=env, cwd=ROOT)
    return out


def prompt_ids(tok, messages) -> torch.Tensor:
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return enc["input_ids"]


@torch.no_grad()
def greedy(model, tok, prompts: list[torch.Tensor], max_new_tokens: int) -> list[str]:
    """Greedy answers of ``prompts`` (1-D id tensors) decoded together, left-padded (a decode step reads the
    weights once for all rows: one prompt at a time took about a second a token on the loaded 2-core CPU)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return [tok.decode(row[width:], skip_special_tokens=True) for row in out]


def same_answers(model, tok, rows: list[dict], max_new_tokens: int) -> list[int]:
    """[rows whose greedy answer equals the row's ``output``, rows]. The chat prompt must encode to the row's
    ``prompt_ids`` (what lorafusion generate decoded from). A row that differs in the padded batch is decoded
    again alone (padding can move a near-tie); the first few that still differ are printed."""
    prompts = []
    for row in rows:
        ids = prompt_ids(tok, row["messages"])[0]
        if ids.tolist() != row["prompt_ids"]:
            raise SystemExit(f"apply_chat_template encodes {row['messages']!r:.80} differently from "
                             f"lorafusion")
        prompts.append(ids)
    got = greedy(model, tok, prompts, max_new_tokens)
    same = 0
    for row, ids, answer in zip(rows, prompts, got):
        if answer != row["output"]:
            answer = greedy(model, tok, [ids], max_new_tokens)[0]
        same += answer == row["output"]
        if answer != row["output"]:
            print(f"  differs: {row['messages'][-1]['content'][:60]!r}: {answer!r} vs {row['output']!r}",
                  flush=True)
    return [same, len(rows)]


def main(argv: list[str] | None = None) -> int:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--result", type=Path)
    args = ap.parse_args(argv)
    run = args.run_dir.resolve()
    result = json.loads((run / "result.json").read_text())
    max_new = int(result["max_new_tokens"])
    rows = [json.loads(line) for line in (run / "answers.jsonl").read_text().splitlines()]
    base_dir = json.loads((run / "base_model.json").read_text())["path"]
    tok = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    report: dict = {"base_model": base_dir, "run": str(run), "commit": result.get("commit"), "jobs": {}}
    base_rows = [r for r in rows if not r.get("job")]
    report["base_answers_equal"] = same_answers(base, tok, base_rows, max_new)
    print(f"base alone: transformers' greedy answers equal lorafusion generate's on "
          f"{report['base_answers_equal'][0]}/{report['base_answers_equal'][1]} prompts", flush=True)
    exports = run.parent / f"{run.name}-exports"
    for job in result["accuracy"]:
        job_rows = [r for r in rows if r.get("job") == job]
        adapter = export(run, job, exports / job, merged=False)
        peft_model = PeftModel.from_pretrained(base, adapter).eval()
        res = {"peft_answers_equal": same_answers(peft_model, tok, job_rows, max_new)}
        merged_dir = export(run, job, exports / f"{job}-merged", merged=True)
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
        mtok = AutoTokenizer.from_pretrained(merged_dir)
        diff = scale = 0.0
        for row in job_rows[:8]:
            ids = prompt_ids(tok, row["messages"])
            if not torch.equal(prompt_ids(mtok, row["messages"]), ids):
                raise SystemExit(f"{merged_dir}: its tokenizer encodes the chat prompt differently")
            with torch.no_grad():
                ref, got = peft_model(ids).logits, merged(ids).logits
            diff, scale = max(diff, float((got - ref).abs().max())), max(scale, float(ref.abs().max()))
        res["merged_max_abs_logit_diff"], res["merged_max_abs_logit"] = diff, scale
        res["merged_answers_equal"] = same_answers(merged, mtok, job_rows, max_new)
        base = peft_model.unload()  # the plain base again for the next job
        report["jobs"][job] = res
        same, merged_same = res["peft_answers_equal"], res["merged_answers_equal"]
        print(f"{job}: PEFT adapter answers = lorafusion generate on {same[0]}/{same[1]}; merged: logits "
              f"within {diff:.2e} of base + adapter (largest {scale:.1f}), answers equal on {merged_same[0]}/"
              f"{merged_same[1]}", flush=True)
    text = json.dumps(report, indent=1) + "\n"
    (run / "exports_check.json").write_text(text)
    if args.result:
        args.result.write_text(text)
    pairs = [report["base_answers_equal"]] + [r[k] for r in report["jobs"].values()
                                              for k in ("peft_answers_equal", "merged_answers_equal")]
    return 0 if all(a == b for a, b in pairs) else 1


if __name__ == "__main__":
    sys.exit(main())
