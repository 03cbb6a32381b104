"""megazero.checkpoint.hf_tokenizer: the files and special ids an export writes for each tokenizer type,
and the tokenizer an import records (AutoTokenizer's ids are tested in test_convert_checkpoint.py)."""
import json

from helpers.data import GPT2_MERGES, GPT2_VOCAB
from helpers.hf_tokenizers import bos_tokenizer_dir

from megazero.checkpoint.hf_tokenizer import SpecialTokens, run_tokenizer, tokenizer_of, write_tokenizer
from megazero.config import DataConfig
from megazero.data.sample import CORPUS


def test_sentencepiece_writes_the_model_and_its_own_special_pieces(tmp_path):
    special = write_tokenizer(DataConfig(), tmp_path, model_max_length=64)       # the embedded sample's model
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (tmp_path / "tokenizer.model").is_file() and special == SpecialTokens(bos=1, eos=2)
    assert (config["tokenizer_class"], config["bos_token"], config["eos_token"], config["unk_token"]) == \
        ("LlamaTokenizer", "<s>", "</s>", "<unk>")
    assert config["add_bos_token"] is False and config["add_prefix_space"] is False and config["model_max_length"] == 64
    assert tokenizer_of(tmp_path).tokenizer_type == "SentencePieceTokenizer"


def test_gpt2_bpe_writes_vocab_merges_and_endoftext(tmp_path):
    data = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(GPT2_VOCAB), merge_file=str(GPT2_MERGES))
    assert write_tokenizer(data, tmp_path) == SpecialTokens(bos=50256, eos=50256)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "GPT2Tokenizer" and config["split_special_tokens"] is True
    assert run_tokenizer(tokenizer_of(tmp_path)).tokenize("Hello world") == [15496, 995]


def test_a_tokenizer_json_without_config_gets_one_naming_eos_and_bos(tmp_path):
    source = bos_tokenizer_dir(tmp_path / "src", CORPUS.read_text()[:20000], vocab_size=300)
    data = DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(source))
    (tmp_path / "out").mkdir()
    special = write_tokenizer(data, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert special == SpecialTokens(bos=0, eos=1)
    assert (config["tokenizer_class"], config["bos_token"], config["eos_token"]) == ("PreTrainedTokenizerFast", "<s>", "</s>")
    assert tokenizer_of(tmp_path / "out").tokenizer_type == "HuggingFaceTokenizer"     # tokenizer.json comes first


def test_unknown_tokenizer_writes_nothing(tmp_path):
    assert write_tokenizer(DataConfig(mock_data=True), tmp_path) == SpecialTokens() and not any(tmp_path.iterdir())
    assert tokenizer_of(tmp_path) == DataConfig()
