"""What observes the training loop at its chunk boundaries: :class:`TrainerCallback` (the hooks) and
:class:`Boundary`, the boundary's own work, always the first callback of a run."""

from __future__ import annotations


class TrainerCallback:
    """Observes the loop (any subset of the hooks; ``Trainer(cfg, callbacks=[...])``): ``chunk_start(trainer,
    chunk)`` right before the pipeline runs the chunk, ``chunk_ran(trainer, chunk, result)`` right after it
    returns, ``chunk_end(trainer, chunk, record)`` once its steps are counted and the boundary's work is done
    (``record``: result, bubble ratio of the stage timers when pp > 1, peak memory in GiB)."""


class Boundary(TrainerCallback):
    """The boundary's own work, first of the callbacks: the status of the chunk starting; after it,
    evaluations (eval_loss rows, best checkpoint, early stop), the checkpoints due, ``lorafusion submit`` /
    ``cancel`` (collective; jobs that ended are handed over) and the background writes (one that failed fails
    the run)."""

    def chunk_start(self, trainer, chunk) -> None:
        trainer.telemetry.chunk_start(chunk)

    def chunk_end(self, trainer, chunk, record) -> None:
        trainer.evaluator.after_chunk(chunk, trainer.telemetry.metrics, trainer.telemetry.progress)
        trainer.checkpoints.save_due(chunk)
        trainer.live.poll()
        trainer.handover.check()
