"""The job spec: a TOML file -> frozen dataclasses, every field validated.

`load_job(path)` / `parse_job(text)` / `job_from_dict(mapping)` return a `JobSpec` or raise
`JobSpecError` whose message (and `.field`) names the offending field as a dotted path, e.g.
`optimizer.lr: must be > 0, got -1.0`. Unknown tables and keys are errors too: a typo must not
silently fall back to a default. The format is documented field by field in docs/jobs.md.

Validation here is structural and local (types, ranges, files that must exist on the submitting
machine). Whether a model factory imports and builds is checked by `fusiond.train.model`, when
the submitter captures the model.
"""

from __future__ import annotations

import re
import sysconfig
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fusiond.errors import LocalError
from fusiond.plan.accuracy import DEFAULT_ACCURACY_BUDGET
from fusiond.plan.model import DEFAULT_DENSITY_FLOOR, EdgeEncoding

__all__ = [
    "DATA_KINDS",
    "LEGACY_LOSSES",
    "OBJECTIVES",
    "ZOO",
    "BatchSpec",
    "CompressionSpec",
    "DataSpec",
    "JobSpec",
    "JobSpecError",
    "LossSpec",
    "ModelSpec",
    "OptimizerSpec",
    "default_text_path",
    "job_from_dict",
    "load_job",
    "parse_job",
]


class JobSpecError(LocalError):
    """A job spec field is missing, mistyped or out of range; `.field` is its dotted path."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


ZOO: dict[str, str] = {
    "gpt2": "fusiond.models.gpt2:gpt2",
    "hf-gpt2": "fusiond.models.hf:hf_gpt2",
    "hf": "fusiond.models.hf:hf_model",
    "resnet18": "fusiond.models.resnet:resnet18",
    "resnet50": "fusiond.models.resnet:resnet50",
    "resnet101": "fusiond.models.resnet:resnet101",
}
"""Zoo model name -> `module:function` building it from the `[model.config]` keyword arguments."""

_FACTORY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")

DataKind = Literal["text", "jsonl", "parquet", "hf_dataset", "image_folder", "images"]
DATA_KINDS: tuple[DataKind, ...] = ("text", "jsonl", "parquet", "hf_dataset", "image_folder",
                                    "images")
TEXT_KINDS: tuple[DataKind, ...] = ("text", "jsonl", "parquet", "hf_dataset")
"""Sources of text: files or a directory of them, JSON lines, Parquet, a Hugging Face `datasets`
dataset saved with `save_to_disk`."""
IMAGE_KINDS: tuple[DataKind, ...] = ("image_folder", "images")
LossKind = Literal["causal_lm", "masked_lm", "seq2seq_lm", "classification", "regression"]
OBJECTIVES: tuple[LossKind, ...] = ("causal_lm", "masked_lm", "seq2seq_lm", "classification",
                                    "regression")
LEGACY_LOSSES: dict[str, LossKind] = {"lm_cross_entropy": "causal_lm",
                                      "cross_entropy": "classification", "mse": "regression"}
"""The loss names of earlier job files, still accepted: what each means now."""
LM_OBJECTIVES: tuple[LossKind, ...] = ("causal_lm", "masked_lm", "seq2seq_lm")
Layout = Literal["windows", "rows"]
AUGMENTS = ("hflip", "crop")
"""Random image transforms the data path applies per step (seeded from the job)."""
FIELD_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
"""A batch field / model keyword name (`input_ids`, `attention_mask`, ...)."""
OptimizerKind = Literal["adamw", "sgd"]
ScheduleKind = Literal["constant", "cosine"]
PipelineKind = Literal["1f1b", "gpipe"]
CodecKind = Literal["auto", "topk", "bf16", "int8", "int4", "lowrank"]
CODECS: tuple[CodecKind, ...] = ("auto", "topk", "bf16", "int8", "int4", "lowrank")
MAX_ACCURACY_BUDGET = 0.5


def default_text_path() -> Path:
    """The default text corpus: this Python's standard library sources (every machine has it)."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class ModelSpec:
    """Which model to train: exactly one of `zoo` (a name in `ZOO`) or `factory`.

    `factory` is `package.module:function`, imported and called only on the submitting machine
    (capture happens there; no user code leaves it). `config` is passed as keyword arguments.
    """

    zoo: str | None
    factory: str | None
    config: Mapping[str, Any] = field(default_factory=dict)
    inputs: tuple[str, ...] | None = None
    """The batch fields the model takes by keyword (None: every field its forward names,
    else the main input by position)."""

    @property
    def target(self) -> str:
        """The `module:function` that builds the model."""
        if self.zoo is not None:
            return ZOO[self.zoo]
        assert self.factory is not None
        return self.factory


@dataclass(frozen=True)
class DataSpec:
    """Where samples come from, and what the data path does to them (docs/jobs.md, [data]).

    `kind`: "text" (a file, or a directory whose `*.py`/`*.txt`/`*.md`/`*.rst` files are read
    sorted; default the stdlib), "jsonl" / "parquet" (the string `column` of each record),
    "hf_dataset" (a `datasets` dataset saved with `save_to_disk`), "image_folder" (one
    directory per class), "images" (synthetic, deterministic per seed).
    `tokenizer`: "bytes" (vocabulary 256), a `tokenizers` JSON file, or a transformers
    tokenizer directory. `layout`: "windows" (the token stream cut into random windows of
    `seq_len + 1`) or "rows" (one example per record, truncated and padded to `seq_len`, with
    its attention mask). `objective` and the masking settings come from `[loss]`: the data path
    makes the labels (next token, masked positions with `ignore_index` elsewhere, the target
    text with its decoder inputs, the class or value). `heldout`: the fraction of examples (or
    of the token stream's tail) never trained on, for the held-out loss.
    """

    kind: DataKind
    path: Path | None
    tokenizer: str
    seq_len: int
    image_size: int
    channels: int
    num_classes: int
    objective: LossKind = "causal_lm"
    layout: Layout = "windows"
    column: str = "text"
    label_column: str = "label"
    target_column: str = "target"
    pair_column: str | None = None
    target_len: int = 0
    """Target tokens per seq2seq example (0: `seq_len`)."""
    split: str | None = None
    heldout: float = 0.0
    max_examples: int = 1_000_000
    augment: tuple[str, ...] = ()
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    ignore_index: int = -100
    mask_probability: float = 0.15
    mask_token_id: int | None = None
    decoder_start_token_id: int | None = None

    @property
    def is_text(self) -> bool:
        """Whether the samples are token ids (the first model input is `input_ids`)."""
        return self.kind in TEXT_KINDS

    @property
    def targets_len(self) -> int:
        """Target tokens of a seq2seq example."""
        return self.target_len or self.seq_len


@dataclass(frozen=True)
class LossSpec:
    """The objective appended to the model's output. Every LM objective and classification is
    cross-entropy over the last axis against labels of the same leading shape (positions
    labelled `ignore_index` count for nothing); regression is mean squared error."""

    kind: LossKind
    ignore_index: int = -100
    mask_probability: float = 0.15
    mask_token_id: int | None = None


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer and learning-rate schedule (applied identically on every partition)."""

    kind: OptimizerKind
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    momentum: float
    schedule: ScheduleKind
    warmup_steps: int
    min_lr: float


@dataclass(frozen=True)
class BatchSpec:
    """`size` samples per step, split into `micro_batches` equal micro-batches. `replicas`:
    the planner may run a stage on several machines, each on its share of the micro-batches
    (data parallelism; gradients reduced dense every step). `recompute`: the planner may
    have a stage whose kept activations would not fit its machine recompute them in the
    backward instead (activation checkpointing; one more forward per micro-batch)."""

    size: int
    micro_batches: int
    pipeline: PipelineKind
    replicas: bool = False
    recompute: bool = True
    offload: bool = True
    """The planner may have a stage whose optimizer state would not fit its machine's memory
    keep it on the machine's disk (read and written once per step)."""

    @property
    def micro_batch_size(self) -> int:
        """Samples per micro-batch."""
        return self.size // self.micro_batches


DEFAULT_GRAD_RANK = 4
"""The rank of a compressed gradient reduction unless the job says (docs/runtime.md: the
held-out loss it costs)."""
MAX_GRAD_RANK = 64
DEFAULT_GRAD_WARMUP_STEPS = 10
"""Dense steps before low-rank gradients start (torch's PowerSGD docs: the start of training
is the most sensitive to inexact gradients)."""


@dataclass(frozen=True)
class CompressionSpec:
    """How cut edges are compressed.

    `codec`: "auto" (the default unless `adatopk` or `density` is given: the planner picks each
    slow link's codec, exact, bf16, int8, int4 or top-k, among those whose measured held-out
    loss cost is within `accuracy_budget`; `fusiond.plan.codecs`), "topk" (AdaTopK or a
    forced `density`, as below; neither = exact), or "bf16" / "int8" / "int4" / "lowrank"
    (every float cut edge except `exact_edges` carries its activation and its gradient so
    encoded, decoded dense; int8 is the SWARM-style job; no top-k: `adatopk` is False).
    `accuracy_budget`: with "auto", the most held-out loss (a fraction, default 0.01) a codec
    may cost to be chosen.
    `adatopk`: let the planner pick per-edge densities from link speeds (>= `density_floor`).
    `density`: if set, force this density on every cut edge (except `exact_edges`) instead.
    `exact_edges`: edge ids or producing node ids never compressed.
    `per_row`: top-k over each row of the last axis (each token's features) rather than the
    whole tensor.
    `readapt_interval_s`: with `adatopk` (and no forced `density`), every this many seconds the
    scheduler recomputes the densities from the links as measured then; 0 = never.
    `grad_rank`: the gradients holders sum (replicas of a stage, tied parameters) may travel
    as rank-`grad_rank` factors with error feedback (PowerSGD) when the planner finds the dense
    reduction would not hide behind the pipeline's drain; 0 = always dense.
    `grad_warmup_steps`: with low-rank gradients, the job's first steps still reduce dense.
    """

    adatopk: bool
    density_floor: float
    density: float | None
    exact_edges: tuple[str, ...]
    per_row: bool = True
    readapt_interval_s: float = 10.0
    codec: CodecKind = "topk"
    grad_rank: int = DEFAULT_GRAD_RANK
    grad_warmup_steps: int = DEFAULT_GRAD_WARMUP_STEPS
    accuracy_budget: float = DEFAULT_ACCURACY_BUDGET

    @property
    def int8(self) -> bool:
        """Whether cut edges travel int8 block-quantized."""
        return self.codec == "int8"

    @property
    def edge_encoding(self) -> EdgeEncoding:
        """The one encoding of every float cut edge ("raw" unless `codec` is bf16, int8, int4
        or lowrank)."""
        c = self.codec
        return c if c in ("bf16", "int8", "int4", "lowrank") else "raw"

    @property
    def choice(self) -> bool:
        """Whether the planner picks each link's codec (`codec = "auto"`)."""
        return self.codec == "auto"

    @property
    def compress(self) -> bool:
        """Whether the planner compresses slow links (AdaTopK, or the per-link choice)."""
        return self.choice or (self.adatopk and self.density is None)


@dataclass(frozen=True)
class JobSpec:
    """A whole training job."""

    name: str
    model: ModelSpec
    data: DataSpec
    loss: LossSpec
    optimizer: OptimizerSpec
    batch: BatchSpec
    compression: CompressionSpec
    steps: int
    seed: int
    checkpoint_interval: int
    output: Path
    max_restarts: int = 2
    """After a stage machine fails, re-plan on the machines still alive and resume from the
    last checkpoint (or step 0 without one) at most this many times; 0 = fail at once."""
    precision: str = "fp32"
    """The stages' compute dtype: "fp32", "bf16" or "fp16" (mixed precision: autocast
    forward, float32 weights and optimizer; fp16 with a dynamic loss scale every stage agrees
    on; `fusiond.train.stage.StageConfig.precision`)."""
    eval_interval: int = 0
    """Every this many steps the scheduler gathers the whole model and scores it on the
    held-out split (the live held-out curve: `held_out_loss` in the step records); 0 = at
    checkpoints only."""
    device: str = "auto"
    """Where stages compute (`fusiond.profile.DEVICE_POLICIES`): "auto", each machine's first
    usable accelerator and the CPU of a machine without one (or whose driver fails); "cpu",
    CPUs only; "cuda", only machines with a usable CUDA device (no fallback to a CPU)."""


# -- field readers: each names the field it rejects ------------------------------------------


class _Table:
    """A TOML table being read; remembers which keys were consumed to reject unknown ones."""

    def __init__(self, data: Mapping[str, Any], prefix: str) -> None:
        self.data = data
        self.prefix = prefix
        self.used: set[str] = set()

    def name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def get(self, key: str) -> Any:
        self.used.add(key)
        return self.data.get(key)

    def has(self, key: str) -> bool:
        return key in self.data

    def sub(self, key: str, required: bool = False) -> _Table:
        value = self.get(key)
        if value is None:
            if required:
                raise JobSpecError(self.name(key), "missing table")
            value = {}
        if not isinstance(value, Mapping):
            raise JobSpecError(self.name(key), f"must be a table, got {type(value).__name__}")
        return _Table(value, self.name(key))

    def string(self, key: str, default: str | None = None, *, required: bool = False) -> str:
        value = self.get(key)
        if value is None:
            if required or default is None:
                raise JobSpecError(self.name(key), "missing")
            return default
        if not isinstance(value, str) or not value:
            raise JobSpecError(self.name(key), f"must be a non-empty string, got {value!r}")
        return value

    def opt_string(self, key: str) -> str | None:
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise JobSpecError(self.name(key), f"must be a non-empty string, got {value!r}")
        return value

    def choice(self, key: str, default: str, choices: tuple[str, ...]) -> str:
        value = self.string(key, default)
        if value not in choices:
            raise JobSpecError(self.name(key), f"must be one of {list(choices)}, got {value!r}")
        return value

    def integer(self, key: str, default: int | None = None, *, lo: int = 0,
                hi: int | None = None) -> int:
        value = self.get(key)
        if value is None:
            if default is None:
                raise JobSpecError(self.name(key), "missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise JobSpecError(self.name(key), f"must be an integer, got {value!r}")
        if value < lo or (hi is not None and value > hi):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise JobSpecError(self.name(key), f"must be {rng}, got {value}")
        return value

    def number(self, key: str, default: float | None, *, lo: float = 0.0,
               hi: float | None = None, lo_open: bool = False) -> float:
        value = self.get(key)
        if value is None:
            if default is None:
                raise JobSpecError(self.name(key), "missing")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise JobSpecError(self.name(key), f"must be a number, got {value!r}")
        v = float(value)
        if v != v or v in (float("inf"), float("-inf")):
            raise JobSpecError(self.name(key), f"must be finite, got {v}")
        if (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
            lo_s = f"> {lo}" if lo_open else f">= {lo}"
            rng = lo_s if hi is None else f"{lo_s} and <= {hi}"
            raise JobSpecError(self.name(key), f"must be {rng}, got {v}")
        return v

    def boolean(self, key: str, default: bool) -> bool:
        value = self.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise JobSpecError(self.name(key), f"must be true or false, got {value!r}")
        return value

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            raise JobSpecError(self.name(unknown[0]), "unknown key (check the spelling)")


def _model(t: _Table) -> ModelSpec:
    zoo = t.opt_string("zoo")
    factory = t.opt_string("factory")
    if (zoo is None) == (factory is None):
        raise JobSpecError(t.name("zoo"), "set exactly one of model.zoo or model.factory")
    if zoo is not None and zoo not in ZOO:
        raise JobSpecError(t.name("zoo"), f"unknown model {zoo!r}; known: {sorted(ZOO)}")
    if factory is not None and not _FACTORY_RE.match(factory):
        raise JobSpecError(
            t.name("factory"), f"must look like 'package.module:function', got {factory!r}"
        )
    config = t.get("config")
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise JobSpecError(t.name("config"), "must be a table of keyword arguments")
    for key, value in config.items():
        if not isinstance(value, (str, int, float, bool, list)):
            raise JobSpecError(
                t.name(f"config.{key}"), f"must be a string, number, bool or list, got {value!r}"
            )
    inputs: tuple[str, ...] | None = None
    raw_inputs = t.get("inputs")
    if raw_inputs is not None:
        if (not isinstance(raw_inputs, list) or not raw_inputs
                or not all(isinstance(x, str) and FIELD_RE.match(x) for x in raw_inputs)
                or len(set(raw_inputs)) != len(raw_inputs)):
            raise JobSpecError(t.name("inputs"), "must be a non-empty list of distinct batch field "
                               f"names such as ['input_ids', 'attention_mask'], got {raw_inputs!r}")
        inputs = tuple(raw_inputs)
    t.finish()
    return ModelSpec(zoo=zoo, factory=factory, config=dict(config), inputs=inputs)


def _column(t: _Table, key: str, default: str) -> str:
    value = t.string(key, default)
    if len(value) > 256:
        raise JobSpecError(t.name(key), "must be a column name of at most 256 characters")
    return value


def _floats(t: _Table, key: str, n: int, default: float, lo: float, lo_open: bool = False,
            ) -> tuple[float, ...]:
    raw = t.get(key)
    if raw is None:
        return (default,) * n
    if (not isinstance(raw, list) or len(raw) != n or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
            and abs(x) < 1e6 and (x > lo if lo_open else x >= lo) for x in raw)):
        rel = ">" if lo_open else ">="
        raise JobSpecError(t.name(key), f"must be a list of {n} numbers (one per channel) "
                           f"{rel} {lo}, got {raw!r}")
    return tuple(float(x) for x in raw)


def _data(t: _Table, base: Path, loss: LossSpec, check_paths: bool = True) -> DataSpec:
    kind: DataKind = t.choice("kind", "text", DATA_KINDS)  # type: ignore[assignment]
    raw_path = t.opt_string("path")
    path: Path | None = None
    tokenizer = t.string("tokenizer", "bytes")
    objective = loss.kind
    if kind in IMAGE_KINDS and objective not in ("classification", "regression"):
        raise JobSpecError("loss.kind", f"{objective!r} needs text data (data.kind = "
                           f"{kind!r} gives images); use 'classification'")
    if kind in TEXT_KINDS and kind != "text" and raw_path is None:
        raise JobSpecError(t.name("path"), f"data.kind = {kind!r} needs a path")
    if kind == "images":
        if raw_path is not None:
            raise JobSpecError(t.name("path"), "images are synthetic; remove data.path")
    elif kind == "image_folder" and raw_path is None:
        raise JobSpecError(t.name("path"), "data.kind = 'image_folder' needs the directory "
                           "holding one subdirectory per class")
    else:
        path = default_text_path() if raw_path is None else (base / raw_path).expanduser()
        if check_paths and not path.exists():
            raise JobSpecError(t.name("path"), f"no such file or directory: {path}")
        if kind == "hf_dataset" and check_paths and not path.is_dir():
            raise JobSpecError(t.name("path"), f"must be a directory written by a datasets "
                               f"dataset's save_to_disk: {path}")
    if kind in TEXT_KINDS and tokenizer != "bytes":
        tok_path = (base / tokenizer).expanduser()
        if check_paths and not (tok_path.is_file() or (tok_path / "tokenizer.json").is_file()
                                or (tok_path / "tokenizer_config.json").is_file()):
            raise JobSpecError(
                t.name("tokenizer"), "must be 'bytes', a tokenizers JSON file or a transformers "
                f"tokenizer directory (with tokenizer.json or tokenizer_config.json): {tok_path}")
        tokenizer = str(tok_path)
    text_default_layout = "windows" if objective == "causal_lm" else "rows"
    layout: Layout = t.choice("layout", text_default_layout,  # type: ignore[assignment]
                              ("windows", "rows"))
    if layout == "windows" and objective not in ("causal_lm", "masked_lm"):
        raise JobSpecError(t.name("layout"), f"'windows' (a token stream without example "
                           f"boundaries) cannot hold the labels of loss.kind = {objective!r}; "
                           "use 'rows'")
    if kind == "text" and objective in ("classification", "regression", "seq2seq_lm"):
        raise JobSpecError("loss.kind", f"{objective!r} needs a label or target per example: "
                           "text files have none; use data.kind = 'jsonl', 'parquet' or "
                           "'hf_dataset' with data.label_column / data.target_column")
    channels = t.integer("channels", 3, lo=1, hi=64)
    augment_raw = t.get("augment")
    if augment_raw is None:
        augment: tuple[str, ...] = ("hflip",) if kind == "image_folder" else ()
    elif (isinstance(augment_raw, list) and all(a in AUGMENTS for a in augment_raw)
          and len(set(augment_raw)) == len(augment_raw)):
        augment = tuple(augment_raw)
    else:
        raise JobSpecError(t.name("augment"), f"must be a list of {list(AUGMENTS)}, got "
                           f"{augment_raw!r}")
    if augment and kind not in IMAGE_KINDS:
        raise JobSpecError(t.name("augment"), "image transforms need image data")
    seq_len = t.integer("seq_len", 64, lo=1, hi=1 << 20)
    decoder_start: int | None = None
    if t.has("decoder_start_token_id"):
        decoder_start = t.integer("decoder_start_token_id", lo=0, hi=(1 << 31) - 1)
    spec = DataSpec(
        kind=kind,
        path=path,
        tokenizer=tokenizer,
        seq_len=seq_len,
        image_size=t.integer("image_size", 32, lo=1, hi=4096),
        channels=channels,
        num_classes=t.integer("num_classes", 10, lo=2, hi=1 << 20),
        objective=objective,
        layout=layout if kind in TEXT_KINDS else "rows",
        column=_column(t, "column", "text"),
        label_column=_column(t, "label_column", "label"),
        target_column=_column(t, "target_column", "target"),
        pair_column=t.opt_string("pair_column"),
        target_len=t.integer("target_len", 0, lo=0, hi=1 << 20),
        split=t.opt_string("split"),
        heldout=t.number("heldout", 0.05, lo=0.0, hi=0.5),
        max_examples=t.integer("max_examples", 1_000_000, lo=1, hi=100_000_000),
        augment=augment,
        mean=_floats(t, "mean", channels, 0.5, -1e6) if kind == "image_folder" else (),
        std=_floats(t, "std", channels, 0.5, 0.0, lo_open=True) if kind == "image_folder"
        else (),
        ignore_index=loss.ignore_index,
        mask_probability=loss.mask_probability,
        mask_token_id=loss.mask_token_id,
        decoder_start_token_id=decoder_start,
    )
    t.finish()
    return spec


def _loss(t: _Table, data_kind: Any) -> LossSpec:
    image = data_kind in IMAGE_KINDS
    raw = t.get("kind")
    if raw is None:
        kind: LossKind = "classification" if image else "causal_lm"
    elif isinstance(raw, str) and raw in LEGACY_LOSSES:
        kind = LEGACY_LOSSES[raw]
    elif isinstance(raw, str) and raw in OBJECTIVES:
        kind = raw
    else:
        raise JobSpecError(t.name("kind"), f"must be one of {list(OBJECTIVES)} (or the older "
                           f"{list(LEGACY_LOSSES)}), got {raw!r}")
    ignore = t.integer("ignore_index", -100, lo=-(1 << 31), hi=(1 << 31) - 1)
    prob = t.number("mask_probability", 0.15, lo=0.0, lo_open=True, hi=1.0)
    mask_id: int | None = None
    if t.has("mask_token_id"):
        mask_id = t.integer("mask_token_id", lo=0, hi=(1 << 31) - 1)
    if kind != "masked_lm":
        for key in ("mask_probability", "mask_token_id"):
            if t.has(key):
                raise JobSpecError(t.name(key), f"applies to loss.kind = 'masked_lm' only "
                                   f"(this job's is {kind!r})")
    t.finish()
    return LossSpec(kind=kind, ignore_index=ignore, mask_probability=prob, mask_token_id=mask_id)


def _optimizer(t: _Table, steps: int) -> OptimizerSpec:
    kind = t.choice("kind", "adamw", ("adamw", "sgd"))
    betas_raw = t.get("betas")
    if betas_raw is None:
        betas = (0.9, 0.95)
    else:
        if (
            not isinstance(betas_raw, list)
            or len(betas_raw) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas_raw)
            or not all(0.0 <= float(b) < 1.0 for b in betas_raw)
        ):
            raise JobSpecError(t.name("betas"), f"must be two numbers in [0, 1), got {betas_raw!r}")
        betas = (float(betas_raw[0]), float(betas_raw[1]))
    lr = t.number("lr", 3e-4, lo=0.0, lo_open=True, hi=10.0)
    spec = OptimizerSpec(
        kind=kind,  # type: ignore[arg-type]
        lr=lr,
        weight_decay=t.number("weight_decay", 0.0, hi=10.0),
        betas=betas,
        eps=t.number("eps", 1e-8, lo=0.0, lo_open=True, hi=1.0),
        momentum=t.number("momentum", 0.0, hi=1.0),
        schedule=t.choice("schedule", "constant", ("constant", "cosine")),  # type: ignore[arg-type]
        warmup_steps=t.integer("warmup_steps", 0, hi=steps),
        min_lr=t.number("min_lr", 0.0, hi=lr),
    )
    t.finish()
    return spec


def _batch(t: _Table) -> BatchSpec:
    has_mbs, has_count = t.has("micro_batch_size"), t.has("micro_batches")
    size = t.integer("size", 8, lo=1, hi=1 << 20)
    if has_mbs and has_count:
        raise JobSpecError(
            t.name("micro_batches"), "set batch.micro_batches or batch.micro_batch_size, not both"
        )
    if has_mbs:
        mbs = t.integer("micro_batch_size", lo=1, hi=size)
        if size % mbs:
            raise JobSpecError(
                t.name("micro_batch_size"), f"must divide batch.size={size}, got {mbs}"
            )
        count = size // mbs
    else:
        count = t.integer("micro_batches", min(4, size), lo=1, hi=size)
        if size % count:
            raise JobSpecError(
                t.name("micro_batches"), f"must divide batch.size={size}, got {count}"
            )
    pipeline = t.choice("pipeline", "1f1b", ("1f1b", "gpipe"))
    replicas = t.boolean("replicas", False)
    recompute = t.boolean("recompute", True)
    offload = t.boolean("offload", True)
    t.finish()
    return BatchSpec(size=size, micro_batches=count, pipeline=pipeline,  # type: ignore[arg-type]
                     replicas=replicas, recompute=recompute, offload=offload)


def _compression(t: _Table) -> CompressionSpec:
    raw_codec = t.get("codec")
    if raw_codec is None:
        codec: CodecKind = "topk" if t.has("adatopk") or t.has("density") else "auto"
    elif isinstance(raw_codec, str) and raw_codec in CODECS:
        codec = raw_codec
    else:
        raise JobSpecError(t.name("codec"), f"must be one of {list(CODECS)}, got {raw_codec!r}")
    if codec != "topk":
        # top-k and int8 do not stack: an int8 edge is never also top-k'd
        for key, on in (("adatopk", t.get("adatopk") is True), ("density", t.has("density"))):
            if on:
                raise JobSpecError(t.name(key), f"top-k does not apply with compression.codec = "
                                                f"{codec!r}; remove {key} or set codec = 'topk'")
    adatopk = t.boolean("adatopk", codec == "topk")
    floor = t.number("density_floor", DEFAULT_DENSITY_FLOOR, lo=0.0, lo_open=True, hi=1.0)
    density: float | None = None
    if t.has("density"):
        density = t.number("density", None, lo=0.0, lo_open=True, hi=1.0)
        if density < floor:
            raise JobSpecError(
                t.name("density"), f"must be >= compression.density_floor={floor}, got {density}"
            )
    exact_raw = t.get("exact_edges")
    if exact_raw is None:
        exact: tuple[str, ...] = ()
    elif isinstance(exact_raw, list) and all(isinstance(e, str) and e for e in exact_raw):
        exact = tuple(exact_raw)
    else:
        raise JobSpecError(t.name("exact_edges"), f"must be a list of edge ids, got {exact_raw!r}")
    per_row = t.boolean("per_row", True)
    readapt_s = t.number("readapt_interval_s", 10.0, lo=0.0)
    grad_rank = t.integer("grad_rank", DEFAULT_GRAD_RANK, lo=0, hi=MAX_GRAD_RANK)
    grad_warmup = t.integer("grad_warmup_steps", DEFAULT_GRAD_WARMUP_STEPS, lo=0)
    budget = t.number("accuracy_budget", DEFAULT_ACCURACY_BUDGET, lo=0.0,
                      hi=MAX_ACCURACY_BUDGET)
    if t.has("accuracy_budget") and codec != "auto":
        raise JobSpecError(t.name("accuracy_budget"), f"applies to compression.codec = 'auto' "
                                                      f"only, not {codec!r}; remove it")
    t.finish()
    return CompressionSpec(
        adatopk=adatopk, density_floor=floor, density=density, exact_edges=exact, per_row=per_row,
        readapt_interval_s=readapt_s, codec=codec, grad_rank=grad_rank,
        grad_warmup_steps=grad_warmup, accuracy_budget=budget,
    )


def job_from_dict(data: Mapping[str, Any], *, base: Path | None = None,
                  out_base: Path | None = None, check_paths: bool = True) -> JobSpec:
    """Validate a parsed TOML document. Relative input paths (data, tokenizer) resolve against
    `base`, the relative output path against `out_base` (both default: the current directory).
    `check_paths=False`: the data and tokenizer need not exist here (the scheduler of a job
    whose corpus the submitter shipped).
    """
    base = Path.cwd() if base is None else base
    out_base = Path.cwd() if out_base is None else out_base
    root = _Table(data, "")
    job = root.sub("job", required=True)
    name = job.string("name", "job")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
        raise JobSpecError("job.name", f"must be 1-64 of [A-Za-z0-9_.-], got {name!r}")
    steps = job.integer("steps", lo=1, hi=10**9)
    seed = job.integer("seed", 0, hi=2**63 - 1)
    ckpt = job.integer("checkpoint_interval", 0, hi=10**9)
    restarts = job.integer("max_restarts", 2, hi=100)
    eval_every = job.integer("eval_interval", 0, hi=10**9)
    precision = job.choice("precision", "fp32", ("fp32", "bf16", "fp16"))
    device = job.choice("device", "auto", ("auto", "cpu", "cuda"))
    output = (out_base / job.string("output", f"runs/{name}")).expanduser()
    job.finish()
    data_t = root.sub("data")
    loss = _loss(root.sub("loss"), data_t.data.get("kind", "text"))
    spec = JobSpec(
        name=name,
        model=_model(root.sub("model", required=True)),
        data=_data(data_t, base, loss, check_paths),
        loss=loss,
        optimizer=_optimizer(root.sub("optimizer"), steps),
        batch=_batch(root.sub("batch")),
        compression=_compression(root.sub("compression")),
        steps=steps,
        seed=seed,
        checkpoint_interval=ckpt,
        output=output,
        max_restarts=restarts,
        eval_interval=eval_every,
        precision=precision,
        device=device,
    )
    root.finish()
    return spec


def parse_job(text: str, *, base: Path | None = None, out_base: Path | None = None,
              check_paths: bool = True) -> JobSpec:
    """Parse and validate TOML text; a syntax error is a `JobSpecError` naming the line."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise JobSpecError("<toml>", f"not valid TOML: {e}") from e
    return job_from_dict(data, base=base, out_base=out_base, check_paths=check_paths)


def load_job(path: str | Path) -> JobSpec:
    """Read and validate a job file. Its relative data paths resolve against its directory (the
    job and its data travel together); its relative output path against the current directory
    (results land where the user runs the job)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise JobSpecError("<file>", f"cannot read job file {p}: {e.strerror}") from e
    return parse_job(text, base=p.resolve().parent)
