"""The architecture registry and ModelFolder: a folder's architecture is chosen by the classes its
config.json lists first, by its model_type only where it lists none; errors name both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from celeris_cli.arch.folder import ModelFolder
from celeris_cli.arch.registry import ARCHITECTURES, architecture_of
from celeris_cli.errors import ModelError

DATA = Path(__file__).parent / "data"


def test_a_llada_moe_config_saying_model_type_llada_loads_as_llada_moe() -> None:
    folder = ModelFolder.open(DATA / "llada_moe" / "lladamoe_tiny")
    assert folder.config["model_type"] == "llada" and folder.arch.name == "llada_moe"
    assert type(folder.cfg).__name__ == "LLaDAMoEConfig"


def test_architectures_choose_before_model_type() -> None:
    assert architecture_of({"architectures": ["LLaDAMoEModelLM"], "model_type": "llada"}).name == "llada_moe"
    assert architecture_of({"architectures": ["LLaDAModelLM"], "model_type": "llada"}).name == "llada"
    assert architecture_of({"architectures": ["SDARForCausalLM"], "model_type": "Dream"}).name == "sdar"
    assert architecture_of({"model_type": "llada"}).name == "llada"  # our own folders list no class
    assert architecture_of({"model_type": "llada", "block_causal": True}).name == "llada_block"


@pytest.mark.parametrize(
    "raw",
    [
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},  # Stable-DiffCoder's trap
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},  # Open-dCoder's
        {"architectures": ["SomethingNewLM"], "model_type": "llada"},  # a known model_type does not decide
        {"model_type": "mamba"},
    ],
)
def test_an_unknown_architecture_names_both_and_lists_the_supported_ones(raw: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ModelError) as e:
        architecture_of(raw)
    message = str(e.value)
    assert repr(raw["model_type"]) in message and str(raw.get("architectures", [])) in message
    for arch in ARCHITECTURES.values():
        for cls in arch.classes:
            assert cls in message


def test_the_folder_reads_its_generation_config_once_with_its_stops_and_presets(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(DATA / "sdar" / "sdar_tiny", folder)
    opened = ModelFolder.open(folder)
    assert opened.extra_stops == frozenset({318, 316})
    assert opened.defaults().temperature == 0.6 and opened.defaults().block_length == 4
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.2}))
    assert opened.defaults().temperature == 0.6  # read once, when opened
    assert ModelFolder.open(folder).defaults().temperature == 0.2
    (folder / "generation_config.json").write_text(json.dumps({"by_script": {"klingon": {}}}))
    with pytest.raises(ModelError, match="generation_config.json: by_script: unknown script"):
        ModelFolder.open(folder).by_script()


def test_the_random_moe_checkpoint_bench_loads_is_an_sdar_moe_of_experts() -> None:
    import torch

    from celeris_cli.measure.loading import _moe

    with torch.device("meta"):
        raw, model = _moe(2)
    params = {k: v.numel() for k, v in model.state_dict().items()}
    experts = sum(n for k, n in params.items() if ".experts." in k)
    assert architecture_of(raw).name == "sdar_moe" and experts > 0.8 * sum(params.values())
