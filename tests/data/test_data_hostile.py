"""Data files that no reader may crash on: every line is checked with the stdlib JSON parser before the
columnar reader sees the file (a ``null`` first line made it segfault: exit 139, no message); each bad line is
one DataError naming the file and the line. CPU, no training."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lorafusion.config import DatasetConfig, JobConfig
from lorafusion.core.lora import LoRASpec
from lorafusion.data import ByteTokenizer, DataError, load_job_samples

ROOT = Path(__file__).resolve().parents[2]
GOOD = [json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) for i in range(4)]


def _job(path: Path, section="dataset") -> JobConfig:
    ds = DatasetConfig(path=str(path), format="prompt_response", max_seq_len=64)
    return JobConfig(name="j", dataset=ds, lora=LoRASpec(r=4, lora_alpha=8), global_batch_size=2, max_steps=3)


@pytest.mark.parametrize("first, needle", [
    ("null", "line 1: expected a JSON object per line, got null"),
    ("[]", "line 1: expected a JSON object per line, got a JSON array"),
    ("7", "line 1: expected a JSON object per line, got a JSON number"),
    ('"x"', "line 1: expected a JSON object per line, got a JSON string"),
    ("true", "line 1: expected a JSON object per line, got a JSON boolean"),
    ("[" * 100_000 + "]" * 100_000, "line 1: nested too deep to be a row of data"),
    ('{"prompt": "a", "response": "b", "n": 1e999}', "line 1 (row 0): field 'n': inf is not a finite number"),
])
def test_a_bad_first_line_is_one_error_naming_file_and_line(tmp_path, first, needle):
    path = tmp_path / "d.jsonl"
    path.write_text(first + "\n" + "\n".join(GOOD) + "\n")
    with pytest.raises(DataError) as e:
        load_job_samples(_job(path), ByteTokenizer())
    assert str(path) in str(e.value) and needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_json_document_with_a_null_row(tmp_path):
    path = tmp_path / "d.json"
    path.write_text("[null, " + ", ".join(GOOD) + "]")
    with pytest.raises(DataError, match="row 0: expected a JSON object per row, got null"):
        load_job_samples(_job(path), ByteTokenizer())


def test_a_null_first_line_never_kills_the_process(tmp_path):
    """The process itself survives (the segfault took `plan` and the run down with exit 139)."""
    (tmp_path / "d.jsonl").write_text("null\n" + "\n".join(GOOD) + "\n")
    r = subprocess.run(
        [sys.executable, "-m", "lorafusion.cli", "plan", str(ROOT / "configs" / "quickstart.yaml"),
         f"jobs.countdown.dataset.path={tmp_path / 'd.jsonl'}", "--out", str(tmp_path / "p")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 2 and "line 1: expected a JSON object per line, got null" in r.stderr, \
        r.stderr[-2000:]


def test_a_prompt_row_nested_too_deep_is_one_error(tmp_path):
    """generate --prompts with a line nested 100,000 deep was a RecursionError traceback."""
    from lorafusion.config import ConfigError
    from lorafusion.inference.generate import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=r"p.jsonl:2: nested too deep to be a prompt row"):
        read_prompts(path, ByteTokenizer(), [], 1024, tmp_path)
