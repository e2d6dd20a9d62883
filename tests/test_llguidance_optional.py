"""The engine loads and generates without `llguidance` (a GPU machine with no package registry, issue 59):
the grammar engine is imported where a constraint is first used, and its absence is then a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).parents[1]

BLOCKED = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class NoLLGuidance(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "llguidance" or name.startswith("llguidance."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoLLGuidance())
    from celeris_cli.engine import load_engine
    from celeris_cli.errors import UsageError

    engine = load_engine(None, device="cpu", dtype="float32")
    [plain] = engine.generate(["The jury said it"], engine.params({"gen_length": 8}))
    [scored] = engine.generate(["The jury"], engine.params({"gen_length": 8, "logprobs": True, "top_logprobs": 2}))
    try:
        engine.params({"structured_outputs": {"regex": "[a-z]+"}})
        refused = None
    except UsageError as e:
        refused = str(e)
    print(json.dumps({"text": plain.text, "logprobs": len(scored.logprobs or []), "refused": refused,
                      "imported": "llguidance" in sys.modules}))
    """
)


def test_the_engine_generates_without_llguidance_until_a_constraint_is_used() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", BLOCKED], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["text"] and out["logprobs"] == 8 and not out["imported"]
    assert out["refused"] and "llguidance" in out["refused"] and "structured_outputs" in out["refused"]
