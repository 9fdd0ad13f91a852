"""configs/smollm2/run.py's result: the held-out accuracy per job and side, and the actual answers beside the
expected ones (the first rows and the first misses), so that a run whose answers all miss can be read from
its result JSON alone. No model needed: an answers file as ``lorafusion generate`` writes it."""

import json
from pathlib import Path

import pytest

from runtime_utils import load_file_module

RUN = Path(__file__).resolve().parents[2] / "configs" / "smollm2" / "run.py"


@pytest.fixture(scope="module")
def run_py():
    return load_file_module(RUN, "smollm2_run")


def _answers(tmp_path: Path) -> Path:
    rows = []
    for i in range(5):
        msg = [{"role": "user", "content": f"Rewrite in the third person: I walk {i} dogs."}]
        want = f"The user walks {i} dogs."
        rows.append({"messages": msg, "job": "third", "expected": want, "output_ids": [1, 2, 3],
                     "output": want if i % 2 == 0 else f"I walk {i} dogs."})
        rows.append({"messages": msg, "task": "third", "expected": want, "output_ids": [1] * 28,
                     "output": f"Here is the sentence {i}"})
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_the_result_holds_answers_beside_the_expected_ones(run_py, tmp_path):
    answers = _answers(tmp_path)
    acc = run_py.accuracy(answers)
    assert acc["third"]["adapter"] == [3, 5] and acc["third"]["base"] == [0, 5]
    got = run_py.samples(answers, 2)["third"]
    assert [s["output"] for s in got["adapter"]["first"]] == ["The user walks 0 dogs.", "I walk 1 dogs."]
    assert [s["expected"] for s in got["adapter"]["misses"]] == ["The user walks 1 dogs.",
                                                                 "The user walks 3 dogs."]
    assert [s["output"] for s in got["adapter"]["misses"]] == ["I walk 1 dogs.", "I walk 3 dogs."]
    assert got["adapter"]["misses"][0]["prompt"] == "Rewrite in the third person: I walk 1 dogs."
    assert got["base"]["first"][0] == {"prompt": "Rewrite in the third person: I walk 0 dogs.",
                                       "expected": "The user walks 0 dogs.",
                                       "output": "Here is the sentence 0", "output_tokens": 28}
    assert len(got["base"]["misses"]) == 2


def test_generate_only_needs_a_trained_run_directory(run_py, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run_py.parse_args(["--generate-only", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "--generate-only: --out must name a trained run directory" in capsys.readouterr().err
    (tmp_path / "adapters").mkdir()
    args = run_py.parse_args(["--generate-only", "--out", str(tmp_path), "--decode", "dynamic"])
    assert args.generate_only and args.decode == "dynamic"


def test_a_model_directory_with_another_eos_is_refused_before_training(run_py, tmp_path, monkeypatch, capsys):
    from tests.data.test_smollm2_special_tokens import _as_transformers_5_17_writes_it

    model = _as_transformers_5_17_writes_it(tmp_path / "model")
    (model / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(run_py, "MODEL", model)
    monkeypatch.setattr(run_py, "lorafusion", lambda *a: pytest.fail("trained with the wrong eos"))
    assert run_py.main(["--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "not the GGUF's special tokens (tokenizer_config.json eos_token '<|im_start|>'" in err
    assert "python scripts/get_smollm2.py" in err
    assert not (tmp_path / "run").exists()
