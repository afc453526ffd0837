"""The engine config: one strict pydantic model tree, loaded from YAML with ``extends:`` and overrides.

A typo is an error (``extra="forbid"`` everywhere); cross-field rules live next to the fields they tie together;
a validation failure becomes one ``ConfigError`` whose lines each name the file, the YAML path, the bad value and
what would be valid. Callers import from here; the modules are:

- ``schema``: :class:`PipelineConfig`, the root, and the rules that tie its sections together;
- the sections: ``sources`` (model, text), ``quantization`` (compute, sensitivity, plan, quantization),
  ``build`` (build, vllm), ``serving`` (triton, verify, sla, bench, tune), ``release`` (alerts, image), on the
  shared types in ``base``;
- ``loader``: :func:`load_config` (``extends:``, merging, ``--set`` overrides, the family's and target's
  defaults, the local inputs checked to exist);
- ``messages``: a pydantic error turned into the ``ConfigError`` text.
"""

from pipeline.config.base import (
    SAFE_NAME,
    Dtype,
    Frontend,
    KVCacheFormat,
    SafeName,
    SensitivityFormat,
    Strict,
    WeightFormat,
)
from pipeline.config.build import BuildSection, CudaGraphs, PagedKVCache, VllmSection
from pipeline.config.loader import LoadedConfig, gguf_package_file, load_config
from pipeline.config.quantization import (
    AccuracyTask,
    AccuracyTolerance,
    ComputeSection,
    PlanBudget,
    PlanRule,
    PlanSection,
    QuantizationSection,
    SensitivitySection,
)
from pipeline.config.release import AlertsSection, ImageSection
from pipeline.config.schema import PipelineConfig
from pipeline.config.serving import (
    BenchSection,
    OptimizeCandidate,
    OptimizeSection,
    SlaSection,
    TritonSection,
    TuneSection,
    VerifySection,
    WatchdogSection,
)
from pipeline.config.sources import (
    DatasetText,
    FilesText,
    GGUFFileSource,
    GGUFPackageSource,
    HubSource,
    LocalSource,
    ModelSection,
    ModelSource,
    PydocTopicsText,
    TextSection,
    TextSource,
    TokenSet,
)

__all__ = [
    "SAFE_NAME", "AccuracyTask", "AccuracyTolerance", "AlertsSection", "BenchSection", "BuildSection",
    "ComputeSection", "CudaGraphs",
    "DatasetText", "Dtype", "FilesText", "Frontend", "GGUFFileSource", "GGUFPackageSource", "HubSource",
    "ImageSection", "KVCacheFormat", "LoadedConfig", "LocalSource", "ModelSection", "ModelSource",
    "OptimizeCandidate", "OptimizeSection", "PagedKVCache",
    "PipelineConfig", "PlanBudget", "PlanRule", "PlanSection", "PydocTopicsText", "QuantizationSection", "SafeName",
    "SensitivityFormat", "SensitivitySection", "SlaSection", "Strict", "TextSection", "TextSource", "TokenSet",
    "TritonSection", "TuneSection", "VerifySection", "VllmSection", "WatchdogSection", "WeightFormat",
    "gguf_package_file", "load_config",
]
