"""Tiny pooling-model folders for the tests: sentence-transformers' files beside any model folder, and random
BERT / RoBERTa encoders (and their classifiers) with a WordPiece tokenizer of the words the tests use."""
from __future__ import annotations

import json
import re
import string
from pathlib import Path

import torch

TEXTS = ["To be, or not to be, that is the question", "Now is the winter of our discontent",
         "All the world's a stage, and all the men and women merely players", "Et tu, Brute?",
         "A horse! a horse! my kingdom for a horse!"]
QUERIES = ["who wants a horse", "what is the question"]
ST_MODES = {"lasttoken": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
# [PAD] at id 1, as in RoBERTa's vocabulary: its positions then count from 2
SPECIALS = ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"]


def write_st_modules(path: Path, kind: str, dim: int, normalize: bool = True) -> Path:
    """Make a model folder a sentence-transformers one: modules.json with Transformer (the folder itself), Pooling
    (`kind`: lasttoken, mean or cls) and, if `normalize`, Normalize."""
    modules = [("", "sentence_transformers.models.Transformer"), ("1_Pooling", "sentence_transformers.models.Pooling")]
    if normalize:
        modules.append(("2_Normalize", "sentence_transformers.models.Normalize"))
    (path / "modules.json").write_text(json.dumps([{"idx": i, "name": str(i), "path": folder, "type": kind_}
                                                   for i, (folder, kind_) in enumerate(modules)]))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": dim, ST_MODES[kind]: True}))
    if normalize:
        (path / "2_Normalize").mkdir()
    return path


def write_wordpiece_tokenizer(path: Path, segments: bool = True) -> None:
    """A BERT tokenizer (uncased WordPiece) whose vocabulary holds the tests' words, letters and punctuation;
    `segments` False: it hands the model no token_type_ids (RoBERTa has one segment)."""
    from transformers import BertTokenizerFast

    words = sorted(set(re.findall(r"[a-z]+", " ".join(TEXTS + QUERIES).lower())))
    letters = list(string.ascii_lowercase)
    vocab = SPECIALS + list(string.punctuation) + letters + [f"##{c}" for c in letters] + words
    names = ["input_ids", "token_type_ids", "attention_mask"] if segments else ["input_ids", "attention_mask"]
    ids = {token: i for i, token in enumerate(dict.fromkeys(vocab))}
    BertTokenizerFast(vocab=ids, do_lower_case=True, model_input_names=names).save_pretrained(str(path))


def encoder_folder(path: Path, arch: str = "BertModel", seed: int = 0, **overrides) -> Path:
    """A random encoder (`arch`: a transformers class such as BertModel, RobertaForSequenceClassification) with
    the WordPiece tokenizer above, in fp32."""
    import transformers

    roberta = arch.startswith(("Roberta", "XLMRoberta"))
    config_cls = "RobertaConfig" if roberta else "BertConfig"
    settings = dict(vocab_size=160, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                    max_position_embeddings=130 if roberta else 128, type_vocab_size=1 if roberta else 2,
                    pad_token_id=1, hidden_act="gelu", initializer_range=0.2)
    config = getattr(transformers, config_cls)(**{**settings, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32)
    model.save_pretrained(path)
    write_wordpiece_tokenizer(path, segments=not roberta)
    return path
