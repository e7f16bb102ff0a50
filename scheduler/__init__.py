"""Continuous-batching scheduler over a paged KV cache. Pure Python: no torch, no engine."""

from scheduler.block_hash import BlockHash, hash_block
from scheduler.block_pool import BlockPool, KVBlock
from scheduler.config import CacheConfig, SchedulerConfig
from scheduler.draft_proposer import (
    BatchDraftProposer,
    DraftProposer,
    DraftQuery,
    FeatureDraftProposer,
    SpecDecodeStats,
)
from scheduler.errors import (
    ContextLengthExceededError,
    DuplicateRequestIdError,
    EmptyPromptError,
    InvalidMaxTokensError,
    KVCacheTooSmallError,
    MediaSpanTooLongError,
    MinTokensOutOfRangeError,
    RequestRejectedError,
)
from scheduler.kv_cache_manager import KVCacheManager, PrefixCacheStats
from scheduler.kv_tier_index import KVTierIndex, KVTierStats
from scheduler.kv_tier_memory import MemoryTierIndex
from scheduler.kv_tiers import KVTiers, TierOps
from scheduler.output import NewRequestData, RequestStepOutput, SchedulerOutput, SchedulerStats
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler
from scheduler.step_cost import StepCost

__all__ = [
    "BatchDraftProposer",
    "BlockHash",
    "BlockPool",
    "CacheConfig",
    "ContextLengthExceededError",
    "DraftProposer",
    "DraftQuery",
    "DuplicateRequestIdError",
    "FeatureDraftProposer",
    "EmptyPromptError",
    "InvalidMaxTokensError",
    "KVCacheTooSmallError",
    "KVBlock",
    "KVCacheManager",
    "KVTierIndex",
    "KVTierStats",
    "KVTiers",
    "MediaSpanTooLongError",
    "MemoryTierIndex",
    "MinTokensOutOfRangeError",
    "NewRequestData",
    "PrefixCacheStats",
    "Request",
    "RequestRejectedError",
    "RequestStatus",
    "RequestStepOutput",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "TierOps",
    "SpecDecodeStats",
    "StepCost",
    "hash_block",
]
