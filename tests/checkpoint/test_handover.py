"""Hand-over writes in the background (checkpoint/handover.py) and the two-half checkpoint they use
(checkpoint.start_job_checkpoint): the same files as the synchronous save, complete or absent, errors
raised."""

import threading

import pytest
import torch

import lorafusion.checkpoint.format as checkpoint
from lorafusion.checkpoint.handover import Handover


def test_writes_run_in_order_off_the_main_thread_and_errors_come_back():
    h, order, threads = Handover(), [], set()
    gate = threading.Event()
    h.submit(lambda: (gate.wait(10), order.append(1)), on_done=lambda: order.append("done 1"))
    h.submit(lambda: (threads.add(threading.current_thread().name), order.append(2)))
    assert h.pending == 2 and order == []  # the caller went on while the first write waited
    gate.set()
    h.flush()
    assert order == [1, "done 1", 2] and all(t.startswith("lorafusion-handover") for t in threads)

    def fail():
        raise OSError(28, "No space left on device", "/x/adapter_model.safetensors")

    done = []
    h.submit(fail, on_done=lambda: done.append(1))
    h.submit(lambda: done.append(2))
    with pytest.raises(OSError, match="No space left"):
        h.flush()
    assert done == [2]  # no on_done for the failed write; the next one still ran
    h.submit(fail)
    while h.pending:
        pass
    with pytest.raises(OSError):
        h.check()
    h.check()  # reported once
    h.close()


def _params():
    g = torch.Generator().manual_seed(0)
    p = {"1.linear_qkv.lora_A": torch.randn(4, 8, generator=g),
         "1.linear_qkv.lora_B": torch.randn(24, 4, generator=g)}
    opt = torch.optim.AdamW([torch.nn.Parameter(v.clone()) for v in p.values()])
    for q in opt.param_groups[0]["params"]:
        q.grad = torch.ones_like(q)
    opt.step()
    return p, {"optimizer": opt.state_dict()}


def test_the_background_checkpoint_equals_the_synchronous_one(tmp_path, megatron_single):
    params, opt = _params()
    state = {"job": "a", "step": 3, "stream": {"pos": 7}}
    snap = ({"base_model.model.x.lora_A.weight": params["1.linear_qkv.lora_A"].clone()},
            {"peft_type": "LORA", "r": 4})

    sync = checkpoint.save_job_checkpoint(tmp_path / "sync", 3, adapter_params=params, optimizer_state=opt,
                                          state=state, adapter=snap)
    write = checkpoint.start_job_checkpoint(tmp_path / "bg", 3, adapter_params=params, optimizer_state=opt,
                                            state=state, adapter=snap)
    for v in params.values():  # the model goes on changing: the write holds the values at the call
        v.add_(1.0)
    assert not (tmp_path / "bg" / "step_000003").exists()
    bg = write()
    assert sorted(p.relative_to(bg).as_posix() for p in bg.rglob("*")) == \
        sorted(p.relative_to(sync).as_posix() for p in sync.rglob("*"))
    (s1, t1), (s2, t2) = checkpoint.load_job_checkpoint(sync), checkpoint.load_job_checkpoint(bg)
    assert s1 == s2 and (tmp_path / "bg" / "latest").read_text() == "step_000003\n"
    for k in t1["adapter"]:
        assert torch.equal(t2["adapter"][k], t1["adapter"][k]) \
            and torch.equal(t2["adapter"][k] + 1.0, params[k])
    assert all(torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in
               zip(t1["optimizer"]["optimizer"]["state"].values(),
                   t2["optimizer"]["optimizer"]["state"].values()))
    assert (bg / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (sync / "adapter" / "adapter_model.safetensors").read_bytes()


def test_a_failed_background_checkpoint_leaves_nothing_half_written(tmp_path, monkeypatch, megatron_single):
    params, opt = _params()
    job = tmp_path / "ckpt" / "a"
    write = checkpoint.start_job_checkpoint(job, 2, adapter_params=params, optimizer_state=opt,
                                            state={"job": "a", "step": 2, "stream": {}},
                                            adapter=({"k": params["1.linear_qkv.lora_A"]}, {"r": 4}))

    def full(path, data):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint, "write_bytes", full)
    with pytest.raises(OSError, match="No space left"):
        write()
    assert not job.exists()  # the job's first checkpoint: no empty directory left to mark a run
