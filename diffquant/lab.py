"""The experiments' and researchers' toolbox: stable names for the internals that experiments/ uses.

    import diffquant as dq                     # loading, profiling, quantizing, evaluating, sweeping: the API
    from diffquant import lab                  # what a study needs beyond it: training runs, statistics, reports

`dq` is what a user of diffquant needs; this module is what a study of it needs besides: matched training runs
and their outlier tracking, the statistics of planned comparisons, the pieces of a report (tables, display names,
colours, figures), synthetic data, model presets, custom quantization schemes and KV-cache decoding, and the sweep's
cells. Every name here is re-exported from the module that implements it, and this file (with api.py) is the only
place that says where that is, so internal modules can move without breaking an experiment: the experiments import
`diffquant` and `diffquant.lab` only (tests/test_imports.py checks it). A name that is vague outside its module
gets a longer one here (`parse` of data/synthetic.py is `synthetic_spec`).
"""

from __future__ import annotations

# run folders: atomic writes, the settings-and-environment record of a run, worker slices, durations
from diffquant.paths import atomic_write_json as atomic_write_json
from diffquant.paths import atomic_write_text as atomic_write_text
from diffquant.runs import fmt_ms as fmt_ms
from diffquant.runs import parse_worker as parse_worker
from diffquant.runs import start_run as start_run

# the command line, for an experiment that records and runs the exact `diffquant ...` command
from diffquant.cli import main as command_line

# training matched runs and tracking their outliers through training
from diffquant.track import loglog_fit as loglog_fit
from diffquant.track import snapshot as snapshot
from diffquant.track import tokens_to_reach as tokens_to_reach
from diffquant.training import TrainConfig as TrainConfig
from diffquant.training import prepare_data as prepare_data
from diffquant.training import train_pair as train_pair

# models: presets built from configs, the designs' registry, checkpoints, DIFF's fused attention, the zoo
from diffquant.designs import DESIGNS as DESIGNS
from diffquant.models.fused import fuse as fuse
from diffquant.models.fused import layer_lambdas as layer_lambdas
from diffquant.models.presets import PRESETS as PRESETS
from diffquant.models.presets import build as build_model
from diffquant.models.presets import build_pair as build_pair
from diffquant.models.presets import get_preset as get_preset
from diffquant.models.zoo import zoo_entry as zoo_entry
from diffquant.pretrained import from_pretrained as from_pretrained

# data: corpora and their train/validation split, tokenization, synthetic tasks, multiple-choice and needle tasks
from diffquant.data.corpora import load_text as load_text
from diffquant.data.corpora import split as split_corpus
from diffquant.data.needle import needle_accuracy as needle_accuracy
from diffquant.data.synthetic import copy_targets as copy_targets
from diffquant.data.synthetic import is_synthetic as is_synthetic
from diffquant.data.synthetic import parse as synthetic_spec
from diffquant.data.tasks import load_task as load_task
from diffquant.data.tokens import byte_tokenizer as byte_tokenizer
from diffquant.data.tokens import encode as encode
from diffquant.data.tokens import sequences as sequences
from diffquant.data.tokens import train_tokenizer as train_tokenizer
from diffquant.task_selection import RULE as TASK_RULE
from diffquant.task_selection import select as select_task

# statistics: intervals, paired and Welch tests, Holm, equivalence, detectable effects
from diffquant.stats.intervals import detectable as detectable
from diffquant.stats.intervals import fmt_pm as fmt_pm
from diffquant.stats.intervals import holm_adjust as holm_adjust
from diffquant.stats.intervals import mcnemar_exact as mcnemar_exact
from diffquant.stats.intervals import minimum_detectable_effect as minimum_detectable_effect
from diffquant.stats.intervals import paired as paired
from diffquant.stats.intervals import pooled_sd as pooled_sd
from diffquant.stats.intervals import t_interval as t_interval
from diffquant.stats.intervals import tost as tost
from diffquant.stats.intervals import welch as welch
from diffquant.stats.intervals import wilson as wilson

# the outlier regime's criterion and the attention-sink definition, as the reports state them
from diffquant.stats.outlier_regime import HIDDEN_RATIO as HIDDEN_RATIO
from diffquant.stats.outlier_regime import NAME as REGIME_NAME
from diffquant.stats.outlier_regime import SINK_RATE as SINK_RATE
from diffquant.stats.outlier_regime import reached as regime_reached
from diffquant.stats.sinks import SINK_DEFINITION as SINK_DEFINITION

# reports: markdown tables, display names and colours, figures
from diffquant.report.emergence_plots import plot_emergence as plot_emergence
from diffquant.report.plots import pyplot as pyplot
from diffquant.report.plots import save_figure as save_figure
from diffquant.report.profile_report import TABLE5_RANKS as TABLE5_RANKS
from diffquant.report.profile_report import write_report as write_report
from diffquant.report.style import color as color
from diffquant.report.style import display as display
from diffquant.report.tables import markdown as markdown

# custom quantization schemes: formats, granularities, per-site configs, KV-cache schemes and static-grid errors
from diffquant.quant.numerics.config import QuantConfig as QuantConfig
from diffquant.quant.numerics.config import int_config as int_config
from diffquant.quant.numerics.formats import Format as Format
from diffquant.quant.numerics.granularity import KVChannel as KVChannel
from diffquant.quant.numerics.granularity import PerChannel as PerChannel
from diffquant.quant.numerics.granularity import PerGroup as PerGroup
from diffquant.quant.numerics.granularity import PerHead as PerHead
from diffquant.quant.numerics.granularity import PerTensor as PerTensor
from diffquant.quant.numerics.granularity import PerToken as PerToken
from diffquant.quant.grid_error import static_grid_errors as static_grid_errors
from diffquant.quant.numerics.scheme import attach_scheme as attach_scheme
from diffquant.quant.numerics.scheme import kv_config as kv_config
from diffquant.quant.numerics.scheme import kv_scheme as kv_scheme

# recipes spelled as the command line spells them, and weight solvers by name
from diffquant.quant.recipe import from_cli as recipe_from_cli
from diffquant.quant.algorithms.solvers import parse as parse_solver

# decoding through a quantized KV cache (prefill against token-by-token decoding, transformers' QuantizedCache)
from diffquant.quant.algorithms.kv_cache import decode_greedy as decode_greedy
from diffquant.quant.algorithms.kv_cache import decode_logits as decode_logits
from diffquant.quant.algorithms.kv_cache import residual_requant_cache as residual_requant_cache

# the sweep's cells, evaluators and tables, for an experiment that runs its own grid of cells
from diffquant.sweeps import Cell as Cell
from diffquant.sweeps import Evaluator as Evaluator
from diffquant.sweeps import build_cells as build_cells
from diffquant.sweeps import cell_text as cell_text
from diffquant.sweeps import run_cells as run_cells
from diffquant.sweeps import summary_table as summary_table
from diffquant.sweeps import task_label as task_label
from diffquant.sweeps import versus_float as versus_float

__all__ = [
    "atomic_write_json", "atomic_write_text", "fmt_ms", "parse_worker", "start_run",
    "command_line",
    "loglog_fit", "snapshot", "tokens_to_reach", "TrainConfig", "prepare_data", "train_pair",
    "DESIGNS", "fuse", "layer_lambdas", "PRESETS", "build_model", "build_pair", "get_preset", "zoo_entry",
    "from_pretrained",
    "load_text", "split_corpus", "needle_accuracy", "copy_targets", "is_synthetic", "synthetic_spec", "load_task",
    "byte_tokenizer", "encode", "sequences", "train_tokenizer", "TASK_RULE", "select_task",
    "detectable", "fmt_pm", "holm_adjust", "mcnemar_exact", "minimum_detectable_effect", "paired", "pooled_sd",
    "t_interval", "tost", "welch", "wilson",
    "HIDDEN_RATIO", "REGIME_NAME", "SINK_RATE", "regime_reached", "SINK_DEFINITION",
    "plot_emergence", "pyplot", "save_figure", "TABLE5_RANKS", "write_report", "color", "display", "markdown",
    "QuantConfig", "int_config", "Format", "KVChannel", "PerChannel", "PerGroup", "PerHead", "PerTensor", "PerToken",
    "static_grid_errors", "attach_scheme", "kv_config", "kv_scheme",
    "recipe_from_cli", "parse_solver",
    "decode_greedy", "decode_logits", "residual_requant_cache",
    "Cell", "Evaluator", "build_cells", "cell_text", "run_cells", "summary_table", "task_label", "versus_float",
]
