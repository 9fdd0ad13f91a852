"""lorafusion: many LoRA adapters of one frozen base LLM, trained at once on Megatron-core."""

import warnings as _warnings

__version__ = "0.1.0"

# megatron-core warns at import that Apex / Transformer Engine are absent (UserWarning from megatron.*); the
# local paths it falls back to are the ones lorafusion uses. Filtered for megatron's modules only, for the CLI
# and the API.
_warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*", category=UserWarning,
                         module=r"megatron\.")
