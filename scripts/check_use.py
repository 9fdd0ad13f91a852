#!/usr/bin/env python3
"""Check a trained run's outputs against HF transformers + PEFT on this machine (GPU if present):

* ``lorafusion generate``'s greedy rows (``--generated``, written with temperature 0) equal transformers +
  PEFT greedy ``generate`` of the exported base (``--base``, from ``lorafusion export RUN --base``) with each
  row's adapter (the base for rows without a job);
* the merged export of ``--job`` (``--merged``, from ``lorafusion export RUN --job J --merged``) gives the
  logits of base + PEFT adapter.

Prints one JSON line; exits 1 if a check fails. Used by ``scripts/device/use.sh`` (the quickstart on a GPU).

    python scripts/check_use.py RUN --base BASE --merged MERGED --job countdown --generated G.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main() -> int:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--base", required=True)
    ap.add_argument("--merged", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--generated", required=True)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [json.loads(x) for x in Path(args.generated).read_text().splitlines() if x.strip()]
    out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "rows": len(rows),
           "mismatches": []}
    for row in rows:
        base = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.float32).to(dev).eval()
        model = PeftModel.from_pretrained(base, str(Path(args.run) / "adapters" / row["job"])).eval() \
            if row.get("job") else base
        ids = torch.tensor([row["prompt_ids"]], device=dev)
        with torch.no_grad():
            hf = model.generate(ids, max_new_tokens=len(row["output_ids"]), do_sample=False, num_beams=1,
                                eos_token_id=257, pad_token_id=258)
        theirs = hf[0, ids.shape[1]:].tolist()
        if theirs != row["output_ids"]:
            out["mismatches"].append(
                {"job": row.get("job"), "ours": row["output_ids"], "transformers_peft": theirs})
    base = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.float32).to(dev).eval()
    peft = PeftModel.from_pretrained(base, str(Path(args.run) / "adapters" / args.job)).eval()
    merged = AutoModelForCausalLM.from_pretrained(args.merged, torch_dtype=torch.float32).to(dev).eval()
    ids = torch.tensor([rows[0]["prompt_ids"]], device=dev)
    with torch.no_grad():
        a, b = merged(ids).logits.float(), peft(ids).logits.float()
    out["merged_max_abs_diff"] = float((a - b).abs().max())
    out["merged_rel"] = out["merged_max_abs_diff"] / float(b.abs().max())
    out["ok"] = not out["mismatches"] and out["merged_rel"] < 1e-4
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
