"""Typed configuration and its sources (file, environment, CLI)."""

from lmkit.config.loader import load_config
from lmkit.config.schema import (
    DEFAULT_MODEL,
    AttentionConfig,
    CacheConfig,
    ExecutorConfig,
    LMKitConfig,
    ModelConfig,
    OffloadConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
    StructuredOutputConfig,
)

__all__ = [
    "DEFAULT_MODEL", "AttentionConfig", "CacheConfig", "ExecutorConfig", "LMKitConfig", "ParallelConfig",
    "ModelConfig", "OffloadConfig", "SchedulerConfig", "ServerConfig", "SpeculativeConfig",
    "StructuredOutputConfig", "load_config",
]
