"""Per-job checkpoints: the on-disk format (``format``), the save policy of a run (``policy``) and the
background writer that hands an ended job over (``handover``). Never imports :mod:`lorafusion.runtime`."""
