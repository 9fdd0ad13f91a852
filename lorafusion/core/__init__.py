"""The torch-free ground floor: vocabulary every other package may import.

``targets`` (PEFT ↔ Megatron linear names), ``lora`` (:class:`LoRASpec`, the one LoRA schema), ``arch``
(:class:`ModelArch`, presets, HF ``config.json`` mapping; torch only inside ``inv_freq``), ``routing``
(per-microbatch adapter segments and row ids), ``seeds`` (seed mixing, name keys, dropout threshold),
``errors`` (:class:`UserError`, the family of errors the CLI prints as one line), ``lengths`` (the bench
data's sample-length profiles). Modules here import nothing else of ``lorafusion`` and no torch at import
time (checked by ``tests/test_import_rules.py``).
"""
