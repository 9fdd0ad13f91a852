"""Exports: ``peft`` (an adapter's state in PEFT names, its config, writing and importing PEFT adapters) and
``hf`` (the run's base model and merged models as Hugging Face directories). Never imports
:mod:`lorafusion.runtime`."""
