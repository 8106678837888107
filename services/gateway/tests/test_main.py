"""The gateway's process runs without torch, even where torch is installed.

transformers imports torch to load a tokenizer whenever it finds it installed; the
gateway's entry point marks it absent first, so a development checkout (every service
in one environment) runs the gateway as its image does, 300 MB lighter. Checked in a
fresh interpreter with the served default model's tokenizer (prepared by set-up).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from yb_core.config import load_config
from yb_core.model_files import model_dir

CHECK = textwrap.dedent(
    """
    import sys
    from yb_gateway.__main__ import hide_absent_libraries
    hide_absent_libraries()
    from yb_core.config import load_config
    from yb_text.tokenizer import load_tokenizer
    cfg = load_config(env={{}})
    tokenizer = load_tokenizer(cfg.model, cfg.model_cache_dir())
    text = tokenizer.apply_chat_template(
        [{{"role": "user", "content": "hi"}}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\\n"), text
    assert tokenizer.encode("The capital of France") == {expected}
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torch" and sys.modules[m])
    assert not loaded, loaded
    """
)


def test_the_gateway_loads_its_tokenizer_without_torch() -> None:
    cfg = load_config(env={})
    if not (model_dir(cfg.model, cfg.model_cache_dir()) / "tokenizer.json").exists():
        pytest.skip("the default model is not prepared (./setup.sh prepares it)")
    from yb_text.tokenizer import load_tokenizer

    expected = load_tokenizer(cfg.model, cfg.model_cache_dir()).encode("The capital of France")
    run = subprocess.run(
        [sys.executable, "-c", CHECK.format(expected=expected)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "PyTorch was not found" not in run.stderr
