"""Run and job configuration: pydantic models (:mod:`.schema`) and YAML loading (:mod:`.load`).
Imports neither torch nor megatron."""

from lorafusion.config.load import load_job_config, load_run_config
from lorafusion.config.schema import (
    DATASET_FILE_TYPES,
    DatasetConfig,
    JobConfig,
    CheckpointConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    RunConfig,
    SchedulerSection,
    TokenizerConfig,
)
from lorafusion.core.errors import ConfigError
from lorafusion.core.lora import LoRASpec

__all__ = [
    "DATASET_FILE_TYPES",
    "ConfigError",
    "DatasetConfig",
    "JobConfig",
    "LoRASpec",
    "CheckpointConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "RunConfig",
    "SchedulerSection",
    "TokenizerConfig",
    "load_job_config",
    "load_run_config",
]
