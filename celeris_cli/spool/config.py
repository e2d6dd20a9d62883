"""`configs/batch.yaml`: typed, validated when loaded. Errors name the key: `batch_size: must be ...`.

Relative folders and a relative `model:` are resolved against `root`, which is itself relative to the
config file, so cron (which starts in $HOME) and a shell in the repo read the same queue. Folders that do
not exist yet are created when the queue starts (`Spool.start`); `root` itself must exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..arch.memory import QUANTIZE_CHOICES, parse_size
from ..errors import ConfigError, UsageError
from ..params import check_values

FOLDER_KEYS = ("inputs", "outputs", "processed", "logs")
OUTPUT_FORMATS = ("jsonl", "txt")


@dataclass(frozen=True)
class Folders:
    inputs: Path
    outputs: Path
    processed: Path
    logs: Path

    @property
    def work(self) -> Path:
        """Claimed files live here: inside the inbox, so claims are renames on one filesystem."""
        return self.inputs / ".work"

    @property
    def quarantine(self) -> Path:
        return self.processed / "quarantine"


@dataclass(frozen=True)
class RaySettings:
    """`engine: {ray: {...}}`: the queue's batches run on a pool of Ray actors, each loading the model once."""

    address: str | None = None  # None: a local Ray started with the daemon; "auto" or "ray://host:10001"
    actors: int = 1  # batches in flight at once, one per actor
    cpus_per_actor: float | None = None  # None: min(1, cluster CPUs / actors)
    gpus_per_actor: float = 0.0


@dataclass(frozen=True)
class EngineSettings:
    """Where the queue's batches run: in the daemon's own process (`ray` None), or on Ray."""

    ray: RaySettings | None = None


@dataclass(frozen=True)
class BatchConfig:
    folders: Folders
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    cuda_graphs: str = "auto"  # auto | on | off: each decode step a captured CUDA graph (`arch.capture`)
    threads: int | None = None
    quantize: str = "none"  # int8 / int4: weight-only (`arch.quantize`)
    max_memory: str | None = None  # the budget batches are sized to, "8GiB" (`arch.budget`)
    generation: dict[str, Any] = field(default_factory=dict)
    engine: EngineSettings = field(default_factory=EngineSettings)
    batch_size: int = 16
    token_budget: int = 16384
    batch_window_s: float = 0.5
    settle_s: float = 2.0
    rescan_s: float = 5.0
    max_attempts: int = 3
    output_formats: tuple[str, ...] = ("jsonl",)
    shutdown_grace_s: float = 30.0
    max_line_bytes: int = 1_000_000
    max_file_requests: int = 100_000
    log_prompts: bool = False
    private: bool = True  # files the queue writes 0600, its folders 0700; false: as the umask says (`folders`)
    request_timeout_s: float | None = None  # a batch run past this fails (bisected down to one request)
    max_claims: int = 3  # a request the process died on this many times, decoded alone, is poison (`poison`)
    publish_retry_s: float = 1.0  # first back-off after the filesystem refused a publish (doubles, max 60)
    metrics_textfile: Path | None = None  # Prometheus text file, rewritten as the queue works
    late_window_s: float = 600.0  # a published file is watched this long for lines that arrive late
    source: Path | None = None

    @property
    def root(self) -> Path:
        return self.folders.inputs.parent


_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str, type(None)),
    "device": (str,),
    "dtype": (str,),
    "cuda_graphs": (str, bool),  # YAML reads a bare on / off as true / false
    "threads": (int, type(None)),
    "quantize": (str,),
    "max_memory": (str, type(None)),
    "generation": (dict,),
    "engine": (dict, type(None)),
    "batch_size": (int,),
    "token_budget": (int,),
    "batch_window_s": (int, float),
    "settle_s": (int, float),
    "rescan_s": (int, float),
    "max_attempts": (int,),
    "output_formats": (list,),
    "shutdown_grace_s": (int, float),
    "max_line_bytes": (int,),
    "max_file_requests": (int,),
    "log_prompts": (bool,),
    "private": (bool,),
    "request_timeout_s": (int, float, type(None)),
    "max_claims": (int,),
    "publish_retry_s": (int, float),
    "metrics_textfile": (str, type(None)),
    "late_window_s": (int, float),
}
_POSITIVE = (
    "batch_size",
    "token_budget",
    "max_attempts",
    "max_line_bytes",
    "max_file_requests",
    "rescan_s",
    "max_claims",
    "publish_retry_s",
)
_NON_NEGATIVE = ("batch_window_s", "settle_s", "shutdown_grace_s", "late_window_s")
_RAY_TYPES: dict[str, tuple[type, ...]] = {
    "address": (str, type(None)),
    "actors": (int,),
    "cpus_per_actor": (int, float, type(None)),
    "gpus_per_actor": (int, float),
}


def parse_engine(raw: dict[str, Any] | None) -> EngineSettings:
    """`engine:` null or {} (the in-process engine), or `engine: {ray: {...}}` (see RaySettings)."""
    for key in raw or {}:
        if key != "ray":
            raise ConfigError(f"engine.{key}: unknown key (known: ray)")
    ray = (raw or {}).get("ray")
    if ray is None:
        return EngineSettings()
    if not isinstance(ray, dict):
        raise ConfigError(f"engine.ray: must be a mapping, got {ray!r}")
    for key, value in ray.items():
        types = _RAY_TYPES.get(key)
        if types is None:
            raise ConfigError(f"engine.ray.{key}: unknown key (known: {', '.join(_RAY_TYPES)})")
        if not isinstance(value, types) or isinstance(value, bool):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ConfigError(f"engine.ray.{key}: must be {names}, got {value!r}")
    if ray.get("actors", 1) < 1:
        raise ConfigError(f"engine.ray.actors: must be positive, got {ray['actors']!r}")
    if ray.get("cpus_per_actor") is not None and ray["cpus_per_actor"] <= 0:
        raise ConfigError(f"engine.ray.cpus_per_actor: must be positive or null, got {ray['cpus_per_actor']!r}")
    if ray.get("gpus_per_actor", 0) < 0:
        raise ConfigError(f"engine.ray.gpus_per_actor: must be >= 0, got {ray['gpus_per_actor']!r}")
    if ray.get("address") == "":
        raise ConfigError("engine.ray.address: must be null (a local Ray), auto or an address, got ''")
    return EngineSettings(ray=RaySettings(**ray))


def load_config(path: Path) -> BatchConfig:
    import yaml

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    return parse_config(raw if raw is not None else {}, path)


def parse_config(raw: Any, path: Path) -> BatchConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level")
    known = {f.name for f in fields(BatchConfig)} - {"source", "folders"} | {"root", "folders"}
    for key in raw:
        if key not in known:
            raise ConfigError(f"{key}: unknown key (known: {', '.join(sorted(known))})")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in ("root", "folders"):
            continue
        types = _TYPES[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ConfigError(f"{key}: must be {names}, got {value!r}")
        values[key] = value
    for key in _POSITIVE:
        if key in values and values[key] <= 0:
            raise ConfigError(f"{key}: must be positive, got {values[key]!r}")
    if values.get("request_timeout_s") is not None and values["request_timeout_s"] <= 0:
        raise ConfigError(f"request_timeout_s: must be positive or null, got {values['request_timeout_s']!r}")
    for key in _NON_NEGATIVE:
        if key in values and values[key] < 0:
            raise ConfigError(f"{key}: must be >= 0, got {values[key]!r}")
    if "output_formats" in values:
        formats = values["output_formats"]
        bad = [f for f in formats if f not in OUTPUT_FORMATS]
        if bad or "jsonl" not in formats:
            raise ConfigError(f"output_formats: must list jsonl, optionally txt; got {formats!r}")
        values["output_formats"] = tuple(formats)
    if "device" in values and values["device"] not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device: must be auto, cpu or cuda, got {values['device']!r}")
    if "dtype" in values and values["dtype"] not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"dtype: must be auto, float32 or bfloat16, got {values['dtype']!r}")
    if isinstance(values.get("cuda_graphs"), bool):
        values["cuda_graphs"] = "on" if values["cuda_graphs"] else "off"
    if "cuda_graphs" in values and values["cuda_graphs"] not in ("auto", "on", "off"):
        raise ConfigError(f"cuda_graphs: must be auto, on or off, got {values['cuda_graphs']!r}")
    if values.get("cuda_graphs") == "on" and values.get("device") == "cpu":
        raise ConfigError("cuda_graphs: on needs device cuda (or auto on a machine with CUDA), and device is cpu")
    if "quantize" in values and values["quantize"] not in QUANTIZE_CHOICES:
        raise ConfigError(f"quantize: must be one of {', '.join(QUANTIZE_CHOICES)}, got {values['quantize']!r}")
    if values.get("max_memory") is not None:
        try:
            parse_size(values["max_memory"], "max_memory")
        except UsageError as e:
            raise ConfigError(str(e)) from None
    for key in values.get("generation", {}):
        if not isinstance(key, str):
            raise ConfigError(f"generation: keys must be names, got {key!r}")
    values["engine"] = parse_engine(values.get("engine"))
    try:  # each setting on its own, now; how they combine with the model's defaults, when the model loads
        check_values(values.get("generation", {}))
    except UsageError as e:
        raise ConfigError(f"generation: {e}") from None

    base = path.parent
    root_raw = raw.get("root", ".")
    if not isinstance(root_raw, str):
        raise ConfigError(f"root: must be str, got {root_raw!r}")
    root = (base / root_raw).resolve()
    if not root.is_dir():
        raise ConfigError(f"root: folder does not exist: {root}")
    folders_raw = raw.get("folders", {})
    if not isinstance(folders_raw, dict):
        raise ConfigError(f"folders: must be a mapping, got {folders_raw!r}")
    folder_paths = {}
    for key in folders_raw:
        if key not in FOLDER_KEYS:
            raise ConfigError(f"folders.{key}: unknown key (known: {', '.join(FOLDER_KEYS)})")
    for key in FOLDER_KEYS:
        value = folders_raw.get(key, f"batch_{key}" if key != "logs" else "logs")
        if not isinstance(value, str):
            raise ConfigError(f"folders.{key}: must be str, got {value!r}")
        p = (root / value).resolve()
        if p.exists() and not p.is_dir():
            raise ConfigError(f"folders.{key}: not a folder: {p}")
        folder_paths[key] = p
    if "model" in values and values["model"] is not None:
        values["model"] = _model_path(values["model"], root)
    if values.get("metrics_textfile") is not None:
        metrics = (root / values["metrics_textfile"]).resolve()
        if not metrics.parent.is_dir():
            raise ConfigError(f"metrics_textfile: folder does not exist: {metrics.parent}")
        values["metrics_textfile"] = metrics
    return BatchConfig(folders=Folders(**folder_paths), source=path, **values)


def embedded_names() -> list[str]:
    """The models shipped inside the package (`celeris_cli/models/<name>/config.json`)."""
    folder = Path(__file__).parents[1] / "models"
    return sorted(p.name for p in folder.iterdir() if (p / "config.json").is_file()) if folder.is_dir() else []


def _model_path(model: str, root: Path) -> str:
    """A model folder, relative to `root`; or, where no such folder exists, the name of an embedded model
    (`celeris-tiny`), as the path of its folder inside the package (so that a folder of that name in the
    daemon's working directory is not taken instead). A bare name that is neither is a ConfigError that
    lists the embedded names."""
    if Path(model).is_absolute():
        return model
    folder = (root / model).resolve()
    if folder.exists() or "/" in model:
        return str(folder)
    if model in embedded_names():
        return str((Path(__file__).parents[1] / "models" / model).resolve())
    raise ConfigError(
        f"model: {model!r} is neither a folder ({folder}) nor an embedded model "
        f"(embedded: {', '.join(embedded_names())})"
    )
