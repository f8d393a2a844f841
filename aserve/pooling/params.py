"""PoolingParams (vLLM's name and fields) and how a folder says to pool: plain data, no torch."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TASKS = ("embed", "encode", "classify", "score")
POOLING_KINDS = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the embedding's first N features (Matryoshka models), renormalized when `normalize`;
    `normalize`: L2-normalize the embedding (default: as the folder says, a sentence-transformers Normalize module);
    `task`: "embed" (the embedding), "encode" (the raw pooled hidden state; a classifier's logits), "classify"
    (a classifier's label probabilities) or "score" (a one-label classifier's score: a cross-encoder's relevance),
    set by LLM.embed / encode / classify / score and by the routes."""
    dimensions: int | None = None
    normalize: bool | None = None
    task: str = "embed"
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens (else a long one is an error)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive int, got {self.dimensions!r}")
        if self.truncate_prompt_tokens is not None and (isinstance(self.truncate_prompt_tokens, bool)
                                                        or not isinstance(self.truncate_prompt_tokens, int)
                                                        or self.truncate_prompt_tokens < 1):
            raise ValueError(f"truncate_prompt_tokens must be a positive int, got {self.truncate_prompt_tokens!r}")


@dataclass(frozen=True)
class PoolingSpec:
    """How this model pools: `kind` (last token, mean over the prompt, or the first token), whether embeddings are
    normalized by default, and the Matryoshka dimensions it declares (None: any `dimensions` is refused). A
    classifier (*ForSequenceClassification) has `labels`, its head's outputs in order, and the activation of its
    score: sigmoid, or identity where sentence-transformers' config says so."""
    kind: str = "last"
    normalize: bool = True
    matryoshka_dimensions: tuple[int, ...] | None = None
    labels: tuple[str, ...] | None = None
    score_activation: str = "sigmoid"


# sentence-transformers' module types: "sentence_transformers.models.Pooling" before 6.0, then
# "sentence_transformers.sentence_transformer.modules.pooling.Pooling", "...base.modules.normalize.Normalize"
ST_PACKAGE = "sentence_transformers."
ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
ST_MODE_NAMES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}  # 6.x's "pooling_mode" values


def _is(module: dict, name: str) -> bool:
    kind = str(module.get("type", ""))
    return kind.startswith(ST_PACKAGE) and kind.rsplit(".", 1)[-1] == name


def is_sentence_transformers(model_dir: str | Path) -> bool:
    """A sentence-transformers folder: modules.json with a Pooling module."""
    return any(_is(m, "Pooling") for m in _modules(Path(model_dir)))


ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")  # config.json model_type: pool the first token by default


def read_spec(model_dir: str | Path, config: dict) -> PoolingSpec:
    """The folder's pooling: a classifier's head over its first (encoders) or last (decoders) token; else
    sentence-transformers' modules.json and its Pooling module's config.json (one mode of CLS, mean, last token;
    a Normalize module after it); else the architecture's default: CLS for encoders, last token for decoders,
    normalized."""
    folder = Path(model_dir)
    modules = _modules(folder)
    matryoshka = config.get("matryoshka_dimensions")
    dims = tuple(int(d) for d in matryoshka) if matryoshka else None
    default_kind = "cls" if config.get("model_type") in ENCODER_TYPES else "last"
    if any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        return PoolingSpec(default_kind, False, None, _labels(config), _score_activation(config))
    pooling = next((m for m in modules if _is(m, "Pooling")), None)
    if pooling is None:
        return PoolingSpec(default_kind, True, dims)
    settings = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
    if isinstance(settings.get("pooling_mode"), str):  # sentence-transformers 6
        modes = [ST_MODE_NAMES[settings["pooling_mode"]]] if settings["pooling_mode"] in ST_MODE_NAMES else []
        unsupported = [] if modes else [settings["pooling_mode"]]
    else:
        modes = [kind for key, kind in ST_MODES.items() if settings.get(key)]
        unsupported = [k for k, v in settings.items() if k.startswith("pooling_mode_") and v and k not in ST_MODES]
    if len(modes) != 1 or unsupported or settings.get("include_prompt") is False:
        raise ValueError(f"{folder}: sentence-transformers pooling {json.dumps(settings)} is not supported: one of "
                         f"last token, mean or CLS over the whole prompt is")
    normalize = any(_is(m, "Normalize") for m in modules)
    return PoolingSpec(modes[0], normalize, dims)


def num_labels(config: dict) -> int:
    """A classifier's label count: config.json's id2label (what transformers saves), else num_labels, else 2."""
    labels = config.get("id2label")
    return len(labels) if labels else int(config.get("num_labels", 2))


def _labels(config: dict) -> tuple[str, ...]:
    """A classifier's labels by index: id2label (what transformers saves), else LABEL_0..."""
    names = {int(k): str(v) for k, v in (config.get("id2label") or {}).items()}
    return tuple(names.get(i, f"LABEL_{i}") for i in range(num_labels(config)))


def _score_activation(config: dict) -> str:
    """sentence-transformers' CrossEncoder stores its activation in config.json (`sentence_transformers.
    activation_fn`, before 4.0 `sbert_ce_default_activation_function`); without one a one-label model's score is
    its sigmoid, as CrossEncoder.predict's default."""
    path = (config.get("sentence_transformers") or {}).get("activation_fn") or config.get(
        "sbert_ce_default_activation_function") or "Sigmoid"
    return "identity" if str(path).endswith("Identity") else "sigmoid"


def _modules(folder: Path) -> list[dict]:
    path = folder / "modules.json"
    if not path.is_file():
        return []
    try:
        modules = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return modules if isinstance(modules, list) else []


def check_params(params: PoolingParams, spec: PoolingSpec, model: str = "this model") -> None:
    """Refuse a task the model cannot do (embed on a classifier, classify or score on an embedder, score on a
    classifier of several labels) and `dimensions` it does not declare (Matryoshka), as vLLM does; ValueError
    says why."""
    if spec.labels is not None and params.task == "embed":
        raise ValueError(f"{model} is a classifier ({len(spec.labels)} labels): it classifies and scores "
                         f"(classify, score, rerank), it does not embed")
    if spec.labels is None and params.task in ("classify", "score"):
        raise ValueError(f"{model} is an embedding model, not a classifier: {params.task} needs a "
                         f"*ForSequenceClassification model (an embedding model scores pairs by cosine similarity)")
    if params.task == "score" and len(spec.labels) != 1:
        raise ValueError(f"{model} has {len(spec.labels)} labels: a score needs a one-label classifier "
                         f"(a cross-encoder); classify gives each label's probability")
    if params.dimensions is None:
        return
    if spec.matryoshka_dimensions is None:
        raise ValueError(f"dimensions={params.dimensions}: this model does not declare Matryoshka dimensions "
                         f"(matryoshka_dimensions in config.json), so its embeddings cannot be shortened")
    if params.dimensions not in spec.matryoshka_dimensions:
        raise ValueError(f"dimensions={params.dimensions}: this model's Matryoshka dimensions are "
                         f"{', '.join(map(str, spec.matryoshka_dimensions))}")
