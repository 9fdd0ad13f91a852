"""Data: tokenizers, dataset loading (``datasets`` on local files), per-job sample streams, and packing of
planned microbatches into tensors."""

from lorafusion.data.dataset import DataError, JobData, build_sample, load_job_samples, read_rows
from lorafusion.data.packing import PackedBatch, pack_microbatch, pad_to_multiple
from lorafusion.data.stream import JobStream, epoch_permutation
from lorafusion.data.tokenizer import (
    SIMPLE_CHAT_TEMPLATE,
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerError,
    build_tokenizer,
    render_simple_chat,
)

__all__ = [
    "SIMPLE_CHAT_TEMPLATE",
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "JobData",
    "JobStream",
    "PackedBatch",
    "SentencePieceTokenizer",
    "Tokenizer",
    "TokenizerError",
    "build_sample",
    "build_tokenizer",
    "epoch_permutation",
    "load_job_samples",
    "pack_microbatch",
    "pad_to_multiple",
    "read_rows",
    "render_simple_chat",
]
