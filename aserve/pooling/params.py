"""PoolingParams (vLLM's name and fields) and how a folder says to pool: plain data, no torch."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TASKS = ("embed", "encode")
POOLING_KINDS = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the embedding's first N features (Matryoshka models), renormalized when `normalize`;
    `normalize`: L2-normalize the embedding (default: as the folder says, a sentence-transformers Normalize module);
    `task`: "embed" (the embedding) or "encode" (the raw pooled hidden state), set by LLM.embed / LLM.encode."""
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
    normalized by default, and the Matryoshka dimensions it declares (None: any `dimensions` is refused)."""
    kind: str = "last"
    normalize: bool = True
    matryoshka_dimensions: tuple[int, ...] | None = None


ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def is_sentence_transformers(model_dir: str | Path) -> bool:
    """A sentence-transformers folder: modules.json with a Pooling module."""
    return any(m.get("type") == ST_POOLING for m in _modules(Path(model_dir)))


def read_spec(model_dir: str | Path, config: dict) -> PoolingSpec:
    """The folder's pooling: sentence-transformers' modules.json and its Pooling module's config.json (one mode of
    CLS, mean, last token; a Normalize module after it), else a decoder's default (last token, normalized)."""
    folder = Path(model_dir)
    modules = _modules(folder)
    matryoshka = config.get("matryoshka_dimensions")
    dims = tuple(int(d) for d in matryoshka) if matryoshka else None
    pooling = next((m for m in modules if m.get("type") == ST_POOLING), None)
    if pooling is None:
        return PoolingSpec("last", True, dims)
    settings = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
    modes = [kind for key, kind in ST_MODES.items() if settings.get(key)]
    unsupported = [k for k, v in settings.items() if k.startswith("pooling_mode_") and v and k not in ST_MODES]
    if len(modes) != 1 or unsupported:
        raise ValueError(f"{folder}: sentence-transformers pooling {sorted(k for k, v in settings.items() if v)} "
                         f"is not supported: one of {', '.join(ST_MODES)} is")
    normalize = any(m.get("type") == ST_NORMALIZE for m in modules)
    return PoolingSpec(modes[0], normalize, dims)


def _modules(folder: Path) -> list[dict]:
    path = folder / "modules.json"
    if not path.is_file():
        return []
    try:
        modules = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return modules if isinstance(modules, list) else []


def check_params(params: PoolingParams, spec: PoolingSpec) -> None:
    """Refuse `dimensions` the model does not declare (Matryoshka), as vLLM does; ValueError says why."""
    if params.dimensions is None:
        return
    if spec.matryoshka_dimensions is None:
        raise ValueError(f"dimensions={params.dimensions}: this model does not declare Matryoshka dimensions "
                         f"(matryoshka_dimensions in config.json), so its embeddings cannot be shortened")
    if params.dimensions not in spec.matryoshka_dimensions:
        raise ValueError(f"dimensions={params.dimensions}: this model's Matryoshka dimensions are "
                         f"{', '.join(map(str, spec.matryoshka_dimensions))}")
