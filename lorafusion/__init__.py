"""lorafusion: many LoRA adapters of one frozen base LLM, trained at once on Megatron-core."""
__version__ = "0.1.0"
