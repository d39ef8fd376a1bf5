"""The README's Python section shows code that runs: its ```python block, executed
as is against the built package (and the zero-copy page it ends with checked)."""
import os
import re

import numpy as np

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_python_block_runs():
    text = open(README).read()
    section = text[text.index("\n## Python\n"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    env = {}
    exec(compile(blocks[0], "README.md", "exec"), env)
    page, cache = env["page"], env["cache"]
    assert page.dtype == np.uint16 and page.shape == (2, 2, 8, 32)
    assert cache.len == 8 and env["y"].shape == (1, 1, 128)
    del page, env
