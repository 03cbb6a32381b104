"""Data pipeline: tokenizers, Megatron's .bin/.idx indexed dataset, GPT samples with splits and
blending, and the per-data-parallel-rank micro-batch iterator. See each module's docstring."""
from megazero.data.gpt_dataset import (
                                       BlendedDataset,
                                       GPTDataset,
                                       IndexCache,
                                       MockGPTDataset,
                                       build_train_valid_test_datasets,
)
from megazero.data.tokenizers import (
                                       GPT2BPETokenizer,
                                       SentencePieceTokenizer,
                                       Tokenizer,
                                       build_tokenizer,
                                       tokenizer_from_config,
)

from .indexed_dataset import (
                                       IndexedDataset,
                                       IndexedDatasetError,
                                       IndexedDatasetWriter,
                                       best_dtype,
)
from .samplers import (
                                       MicroBatchIterator,
                                       build_data_iterators,
                                       micro_batch_sample_ids,
                                       samples_to_batch,
)

__all__ = ["BlendedDataset", "GPTDataset", "IndexCache", "MockGPTDataset",
           "build_train_valid_test_datasets", "IndexedDataset", "IndexedDatasetError", "IndexedDatasetWriter",
           "best_dtype", "MicroBatchIterator", "build_data_iterators", "micro_batch_sample_ids",
           "samples_to_batch", "GPT2BPETokenizer", "SentencePieceTokenizer", "Tokenizer",
           "build_tokenizer", "tokenizer_from_config"]
