"""Data pipeline: tokenizers, Megatron's .bin/.idx indexed dataset, GPT samples with splits and
blending, and the per-data-parallel-rank micro-batch iterator. See each module's docstring."""
from .gpt_dataset import (BlendedDataset, DataError, GPTDataset, IndexCache, MockGPTDataset,
                          build_train_valid_test_datasets)
from .indexed_dataset import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter, best_dtype
from .samplers import MicroBatchIterator, build_data_iterators, micro_batch_sample_ids, samples_to_batch
from .tokenizers import (GPT2BPETokenizer, SentencePieceTokenizer, Tokenizer, TokenizerError, build_tokenizer,
                         tokenizer_from_config)

__all__ = ["BlendedDataset", "DataError", "GPTDataset", "IndexCache", "MockGPTDataset",
           "build_train_valid_test_datasets", "IndexedDataset", "IndexedDatasetError", "IndexedDatasetWriter",
           "best_dtype", "MicroBatchIterator", "build_data_iterators", "micro_batch_sample_ids",
           "samples_to_batch", "GPT2BPETokenizer", "SentencePieceTokenizer", "Tokenizer", "TokenizerError",
           "build_tokenizer", "tokenizer_from_config"]
