"""README.md as a new user follows it: every ```bash and ```python block runs as written, in order, in a fresh
directory with the repository's Makefile and configs (`make demo` through the real Makefile; a stand-in .venv
whose `lorafusion` is this tree's CLI). Training lines are shortened with max_steps overrides, nothing else is
changed. Blocks whose first line starts with "# on GPUs" are not run (they need GPUs or a cluster); `make
test` is not run, nor the real-model lines (`make real-model`, `make real-example` and the example's scripts:
a 93 MB download and minutes of training, run by hand as docs/results/real-model.json records).

`make demo` runs as shipped (not shortened): the README's own `generate` line then answers the held-out
prompts (configs/quickstart/heldout.jsonl), and each of the three adapters must answer at least 90% of them
right, with no library warning or solver banner on the demo's output (the issue-28 demo check, on the same
run)."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lorafusion.inference.generate import expected_matches

ROOT = Path(__file__).resolve().parents[2]
SHORT = " ".join(f"jobs.{i}.max_steps=4" for i in range(3))


def readme_blocks() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w+)\n(.*?)```", text, re.S)]


def _fake_venv(tmp: Path) -> None:
    bin_ = tmp / ".venv" / "bin"
    bin_.mkdir(parents=True)
    exe = bin_ / "lorafusion"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m lorafusion.cli \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    (bin_ / "activate").write_text(f"export PATH={bin_}:$PATH\n")
    (tmp / ".venv" / ".installed").touch()  # newer than pyproject.toml: make does not reinstall


def _shell_line(line: str) -> str | None:
    """The line as the test runs it (None: not run)."""
    s = line.strip()
    if s.startswith(("make test", "make real-", "python configs/smollm2/", "python scripts/fp8_quality.py")):
        return None
    if s.startswith("make demo"):
        return f"make demo PYTHON={sys.executable}"
    if s.startswith("lorafusion train"):
        return f"{s.split('#')[0].rstrip()} {SHORT}"
    return line


@pytest.mark.slow
def test_readme_runs_as_written(tmp_path):
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "configs", tmp_path / "configs", ignore=shutil.ignore_patterns("__pycache__"))
    _fake_venv(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    ran = {"bash": 0, "python": 0}
    activated = False  # the reader's shell keeps what a block sourced
    for lang, body in readme_blocks():
        if lang == "bash" and not body.startswith("# on GPUs"):
            script = "\n".join(x for x in map(_shell_line, body.splitlines()) if x is not None)
            script = ("source .venv/bin/activate\n" if activated else "") + script
            activated = activated or "source .venv/bin/activate" in body
            res = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                                 text=True, timeout=900)
        elif lang == "python":
            res = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=env, capture_output=True,
                                 text=True, timeout=600)
        else:
            continue
        assert res.returncode == 0, f"README {lang} block failed:\n{body}\n" \
                                    f"--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"
        ran[lang] += 1
        if "make demo" in body:  # it ends with the next commands, for the link the README uses
            assert "lorafusion status outputs/quickstart/latest" in res.stdout, res.stdout[-2000:]
            assert (tmp_path / "outputs" / "quickstart" / "latest" / "summary.json").is_file()
            assert "Warning" not in res.stderr and "HiGHS" not in res.stdout, res.stderr[-2000:]
    assert ran["bash"] >= 2 and ran["python"] >= 2, ran
    # what the blocks made: the adapter, base and merged exports, the best-eval export, the API example's
    # adapter
    latest = tmp_path / "outputs" / "quickstart" / "latest"
    for d in (tmp_path / "outputs" / "countdown-adapter", latest / "base",
              tmp_path / "outputs" / "countdown-merged",
              tmp_path / "outputs" / "countdown-best", tmp_path / "outputs" / "api-example" / "sql"):
        assert d.is_dir() and any(d.iterdir()), d
    # nothing written into the repository outside the ignored outputs/ (the API example wrote out/)
    assert {p.name for p in tmp_path.iterdir()} == {"Makefile", "pyproject.toml", "configs",
                                                    ".venv", "outputs"}
    assert set(json.loads((latest / "summary.json").read_text())["jobs"]) == {
        "successor", "shout", "countdown"}
    score = expected_matches(
        [json.loads(line) for line in (latest / "answers.jsonl").read_text().splitlines()])
    assert set(score) == {"successor", "shout", "countdown"}
    for job, (right, total) in score.items():  # the demo's adapters learned their tasks
        assert right >= 0.9 * total, (job, score)


def test_make_demo_ends_with_the_readmes_next_commands():
    """`make demo` prints the next commands; the README lists the same ones, in the same order."""
    make = (ROOT / "Makefile").read_text()
    printed = [m.group(1).replace("$(DEMO_LINK)", "outputs/quickstart/latest").replace("$(VENV)", ".venv")
               for m in re.finditer(r'@echo "  (lorafusion [^"]*)"', make)]
    text = (ROOT / "README.md").read_text()
    block = next(body for lang, body in readme_blocks() if lang == "bash" and "lorafusion status" in body
                 and body.lstrip().startswith("source .venv/bin/activate"))
    assert "it ends by printing these next commands:\n\n```bash\n" + block in text
    listed = [line.split("#")[0].strip() for line in block.splitlines() if line.startswith("lorafusion ")]
    assert printed == listed and len(listed) >= 4
