"""A job's adapter leaving the model: its PEFT snapshot in host memory (collective), its export, and the
hand-over of a job that ended while the run goes on (its final checkpoint and adapter written in the
background)."""

from __future__ import annotations

from pathlib import Path

from lorafusion.rundir.layout import RunDir


class AdapterHandoff:
    """Snapshots, exports and hand-overs of the run's adapters (``out``: the run directory; ``handover``: the
    background writer, :class:`lorafusion.checkpoint.handover.Handover`)."""

    def __init__(self, cfg, out: Path, model, arch, device, jobs: dict, handover):
        self.cfg, self.out, self.model, self.arch, self.device = cfg, Path(out), model, arch, device
        self.jobs, self.handover = jobs, handover

    def snapshot(self, name: str) -> tuple | None:
        """Adapter ``name`` in host memory as a PEFT adapter of this run's base (collective; rank 0 gets
        it)."""
        from lorafusion.export.hf import base_reference
        from lorafusion.export.peft import peft_adapter_snapshot

        return peft_adapter_snapshot(self.model, name, self.arch,
                                     base_reference(self.cfg, self.out, self.arch, self.device))

    def export(self, name: str, out_dir: Path | None = None) -> None:
        """Write adapter ``name`` (default: to ``adapters/<name>/`` of the run)."""
        from lorafusion.export.peft import write_peft_adapter

        if (snap := self.snapshot(name)) is not None:
            write_peft_adapter(out_dir or RunDir(self.out).adapter(name), *snap)

    def finish(self, name: str, release: bool, checkpoints) -> None:
        """Hand over a job that ended (done, cancelled, diverged, early-stopped; collective, quick): its final
        checkpoint (its stream as of its last chunk) and its adapter are taken to host memory and written in
        the background (``js.written`` once complete); with ``release`` its adapter and optimizer state leave
        the model."""
        from lorafusion.export.peft import write_peft_adapter
        from lorafusion.layers import remove_adapter
        from lorafusion.rundir.atomic import copier, fill_dir_atomically

        js = self.jobs[name]
        snap = self.snapshot(name)
        save = checkpoints.start_final(name, snap)
        out = RunDir(self.out).adapter(name)

        def write() -> None:
            saved = save() if save is not None else None  # (the checkpoint's directory on rank 0)
            if saved is not None:  # its adapter, serialised once already: copied
                fill_dir_atomically(out, copier(saved / "adapter"))
            elif snap is not None:
                write_peft_adapter(out, *snap)

        js.hand_over()
        self.handover.submit(write, on_done=js.mark_written)
        if release:
            remove_adapter(self.model, name)
            js.optimizer = None
